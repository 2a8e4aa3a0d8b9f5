"""The whole-expert layer step: each expert is read whole, into its pool's slot or a buffer, and computed in its
held form. It runs on the engine (``loader/engine.py``) through ``loader.layer.StepHost`` only, a peer of the
neuron step (``loader/neuron.py``); the engine picks one per call.

1. the schedule decides how each wanted expert is served (``LayerSchedule.serve``): held, read into the cache,
   into a read buffer, once in its prefill form (a prompt chunk's), or, in a decode step under its
   ``CpuMissRule``, computed on the CPU;
2. the reads are submitted (prefill-form reads first, then the cache's, then the buffers' as buffers free); the
   reader thread makes the held form as the read lands;
3. hits compute while the reads fly, then the misses served on the CPU (from the host store's record, nothing
   copied or cached: ``load(cpu_misses=...)``); then each read is waited for (stall time) and computed;
4. the schedule ends the layer.

A decode step (one token) takes a lean path: one ``tolist()`` per layer, no per-expert ``torch.where``, one
weighted add per expert. Switched-off techniques cost nothing here: no prefetch bookkeeping without predictors.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from loader.layer import Mixer, StepHost
from loader.schedule import BUFFER, CACHE, CPU, HELD, PROMPT, Decision
from loader.store import DEMAND, ReadJob


class _Reads:
    """One call's misses to read, by where they go, and the reads submitted: (decision, entry or None, the
    buffer's arena or None, its slot, the job)."""

    __slots__ = ("prompt", "cache", "buffer", "submitted")

    def __init__(self) -> None:
        self.prompt, self.cache, self.buffer, self.submitted = [], [], [], []


class WholeStep:
    """The layer step that reads and computes whole experts. fill(layer, entry): makes a partly read neuron-layout
    record whole before it is computed whole (given where neuron loading is on: the neuron step's ``fill``)."""

    def __init__(self, host: StepHost, fill: Callable | None = None) -> None:
        self.host, self.fill = host, fill

    def run(self, layer: int, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H]."""
        host = self.host
        start = host.begin(layer, top_k_index, top_k_weights)
        mix = start.mixer(hidden, top_k_index)
        reads, ready, joins, on_cpu = _Reads(), [], [], []
        for d in start.decisions:
            served = d.served
            if served == HELD:  # a read in flight (a prefetch) is waited for after the rest
                (joins if d.entry.in_flight else ready).append(d)
            elif served == CACHE:
                reads.cache.append(d)
            elif served == BUFFER:
                reads.buffer.append(d)
            elif served == CPU:
                on_cpu.append(d)
            else:
                reads.prompt.append(d)
        self._submit(layer, reads)
        if self.fill is None:  # resident hits of one token: one kernel call where their forms allow
            resident = [d for d in ready if d.entry.payload.job is None and not d.entry.in_flight]
            left = {id(d) for d in (host.compute_together(module, resident, mix) if len(resident) > 1 else resident)}
            done = {id(d) for d in resident} - left
            ready = [d for d in ready if id(d) not in done]
        for d in ready:
            self._compute_held(layer, module, d, mix, start.prefetched)
        for d in on_cpu:  # while the reads fly (and, on a GPU, the hits' kernels run)
            self._compute_on_cpu(layer, module, d, mix)
        for d in joins:
            self._compute_held(layer, module, d, mix, start.prefetched)
        while reads.submitted:
            self._compute_read(layer, module, mix, *reads.submitted.pop(0))
            self._submit(layer, reads)
        host.finish_layer(layer)
        return mix.out

    def _submit(self, layer: int, reads: _Reads) -> None:
        """Submit what can be read now: every prefill-form read a prefill buffer is free for, every read into the
        cache, and the buffered ones a read buffer is free for."""
        host = self.host
        while reads.prompt and host.prefill_buffers.free:  # read once into a prefill buffer, in the prefill form
            d = reads.prompt.pop(0)
            arena = host.prefill_buffers
            slot = host.take_buffer(arena)
            host.note_read(d.expert)
            job = host.submit(ReadJob(host.stores[d.precision], host.key(layer, d.expert), (arena, slot), DEMAND,
                                      form=host.prefill_forms[d.precision][0]))
            reads.submitted.append((d, None, arena, slot, job))
        while reads.cache:
            d = reads.cache.pop(0)
            reads.submitted.append((d, d.entry, None, None, host.read_entry(d.entry, DEMAND)))
        while reads.buffer and host.buffers.free:
            d = reads.buffer.pop(0)
            slot = host.take_buffer()
            host.note_read(d.expert)
            job = host.submit(ReadJob(host.stores[d.precision], host.key(layer, d.expert), (host.buffers, slot),
                                      DEMAND, form=host.forms[d.precision]))
            reads.submitted.append((d, None, host.buffers, slot, job))

    def _compute_held(self, layer: int, module, d: Decision, mix: Mixer, prefetched: dict) -> None:
        """A hit, or a join of a read in flight (waited for: a prefetch still in flight saved what was read
        before the wait)."""
        host, entry = self.host, d.entry
        held = entry.payload
        job = held.job
        if job is None and not entry.in_flight:  # resident
            if self.fill is not None:
                self.fill(layer, entry)
            host.compute(module, d, held.weights, mix)
            return
        stalled = host.step_times.stalled
        host.land(layer, entry)
        if self.fill is not None:
            self.fill(layer, entry)
        if prefetched and prefetched.get(d.expert) is entry and job is not None:
            host.counters.prefetch_saved_seconds += max(0.0, job.seconds - (host.step_times.stalled - stalled))
        host.compute(module, d, held.weights, mix)

    def _compute_read(self, layer: int, module, mix: Mixer, d: Decision, entry, arena, slot, job) -> None:
        """A miss whose read was submitted: wait for it, compute, and give back its buffer."""
        host = self.host
        if entry is not None:
            host.land(layer, entry)
            host.compute(module, d, entry.payload.weights, mix)
            return
        host.await_job(layer, job)
        if d.served == PROMPT:
            host.compute(module, d, job.weights, mix, host.prefill_forms[d.precision][0])
            host.counters.prefill.prefill_form_computes += 1
        else:
            host.compute(module, d, job.weights, mix)
        host.give_buffer(slot, arena)

    def _compute_on_cpu(self, layer: int, module, d: Decision, mix: Mixer) -> None:
        """A miss served on the CPU from the host store: no copy to the GPU, nothing cached."""
        host = self.host
        start = time.perf_counter()
        record = host.stores[d.precision].host_record(host.key(layer, d.expert))
        tokens, x, w = mix.inputs(d.expert)
        form = host.cpu_form(d.precision)
        mix.add(tokens, form.forward(module, form.make(record), x.cpu()).to(mix.out.device), w)
        host.counters.cpu_computed += 1
        host.step_times.computed += time.perf_counter() - start
