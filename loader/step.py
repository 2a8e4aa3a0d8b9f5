"""The offloading engine and its whole-expert layer step: reads, waits, compute.

``ExpertEngine`` is the state every MoE layer shares: the plan, the cache and its schedule
(``loader/schedule.py``), the stores, the slot memory (one arena per pool, the read buffers, the reader
threads' staging buffers), the reader, the held form of each store (``loader/forms.py``), the miss policy
and the predictors. ``run_layer`` is the per-layer step:

1. the schedule classifies the wanted experts (hits, joins of reads in flight, misses) and decides each
   miss (read at a precision, skip, or, in a decode step under its ``CpuMissRule``, compute on the CPU);
2. each miss to read is admitted into its pool (read into its slot) or, where nothing can be evicted, read
   into one of the K read buffers; the reader thread makes the held form as the read lands;
3. hits compute while the reads fly, then the misses served on the CPU (from the host store's record,
   nothing copied or cached: ``load(cpu_misses=...)``); then each read is waited for (stall time) and
   computed;
4. the schedule ends the layer. Every byte of expert data held (slots, buffers, staging) is counted by one
   meter at every change, and the arenas are sized by the budget, so the budget cannot be passed.

A decode step (one token) takes a lean path: one ``tolist()`` per layer, no per-expert ``torch.where``,
one weighted add per expert. Switched-off techniques cost nothing here: no prefetch bookkeeping without
predictors, no neuron checks without neuron loading. ``decode_timing`` counts, over decode steps, the
wall time of the layer steps, of expert compute and of waiting for reads; what is in neither is the
loader's own overhead. Shapes: see the legend in ``loader/__init__.py``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from loader.budget import allocation
from loader.cache import ExpertCache, MemoryMeter, PoolConfig
from loader.codec import NeuronLayout
from loader.format import expert_key
from loader.forms import RecordForm, median_seconds
from loader.layer import Held, Mixer, renormalized
from loader.neuron import NeuronRecordForm, NeuronStep
from loader.policies import policy_factory
from loader.predict import PredictorContext, PrefetchRequest
from loader.schedule import CPU, CpuMissRule, LayerSchedule, PrefetchGate
from loader.store import DEMAND, PREFETCH, Reader, ReadJob, SlotArena
from loader.transfer import Link, link_for


@dataclass
class LayerTimes:
    read_seconds: float = 0.0
    stall_seconds: float = 0.0


@dataclass
class DecodeTiming:
    """Over decode steps (forwards of one token): MoE layer calls, and the seconds spent in them, in expert
    compute, and waiting for reads. On a GPU compute is launch time (kernels run asynchronously), and
    ``routing_sync_seconds`` is the one device-to-host copy of the routing per layer (it waits for the work
    queued before it)."""

    layer_steps: int = 0
    step_seconds: float = 0.0
    compute_seconds: float = 0.0
    stall_seconds: float = 0.0
    routing_sync_seconds: float = 0.0

    def to_json(self) -> dict:
        overhead = self.step_seconds - self.compute_seconds - self.stall_seconds  # routing sync included
        return {"layer_steps": self.layer_steps, "step_seconds": self.step_seconds,
                "compute_seconds": self.compute_seconds, "stall_seconds": self.stall_seconds,
                "routing_sync_seconds": self.routing_sync_seconds,
                "routing_sync_per_layer_step": (self.routing_sync_seconds / self.layer_steps
                                                if self.layer_steps else None),
                "overhead_seconds": overhead,
                "overhead_per_layer_step": overhead / self.layer_steps if self.layer_steps else None}


@dataclass
class PrefillTiming:
    """Over forwards of more than one token (prompt chunks): forwards, tokens, the MoE layer steps' seconds and
    stall, the expert reads, the most times one expert was read in one layer step (1: each read once per chunk),
    and the experts computed in a prefill form (``loader/prefill.py``)."""

    forwards: int = 0
    tokens: int = 0
    layer_steps: int = 0
    step_seconds: float = 0.0
    stall_seconds: float = 0.0
    reads: int = 0
    most_reads_per_layer_step: int = 0
    prefill_form_computes: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Counters:
    decodes: int = 0  # forms made (on reader threads) plus records decoded per use (the record form, packed)
    make_seconds: float = 0.0
    cpu_computed: int = 0
    prefetch_saved_seconds: float = 0.0  # read time of used prefetches a demand did not wait for
    timing: DecodeTiming = field(default_factory=DecodeTiming)
    prefill: PrefillTiming = field(default_factory=PrefillTiming)


class ExpertEngine:
    """The offloading state shared by every MoE layer, and the whole-expert layer step."""

    def __init__(self, plan, layout, stores: dict, layouts: dict, top_k: int, device: torch.device, workers: int,
                 miss_policy, predictors: list, layer_ids: list[int], neuron=None, pairings: dict | None = None,
                 cleanup=None, link: Link | None = None) -> None:
        """layout: ``loader.budget.HeldLayout`` (forms, sizes, capacities). cleanup: an ``ExitStack`` the
        engine registers its reader on (``load`` closes it on any error). link: how reads reach the device
        (``loader/transfer.py``; by default the device's own)."""
        self.plan = plan
        self.layer_ids = layer_ids  # position among the MoE layers -> the model's layer index (record keys)
        self.caps = layout.capacities
        self.stores = stores
        self.layouts = layouts
        self.forms = dict(layout.forms)
        self.top_k = top_k
        self.device = device
        self.link = link if link is not None else link_for(device)
        self.num_layers, self.num_experts = plan.num_layers, plan.num_experts
        self.read_bytes = {p: s.record_bytes for p, s in stores.items()}
        self.slot_bytes = dict(layout.sizes.record_bytes)
        self.counters = Counters()
        self.meter = MemoryMeter()
        self.cache = ExpertCache(
            [PoolConfig(pool.name, pool.precision, pool.group, self.caps.pools[pool.name],
                        self.slot_bytes[pool.precision]) for pool in plan.pools],
            plan.num_layers, plan.num_experts, policy_factory(plan.eviction.name, plan.eviction.params),
            meter=self.meter)
        self.cache.on_evict = self._free_slot
        self.allocation = allocation(plan, layout, layouts, top_k, workers, device)  # ``moeload plan`` prints it
        self.arenas = {name: SlotArena(count, size, device) for name, (count, size) in self.allocation.pools.items()}
        self.buffers = SlotArena(*self.allocation.read_buffers, device)
        self.staging = SlotArena(*self.allocation.staging, device) if self.allocation.staging[0] else None
        if self.staging is not None:
            self.meter.add(self.staging.count * self.staging.slot_bytes)  # held for the whole run
        self.reader = Reader(workers, device, self.staging, self.link)
        # a prompt's chunks: the budget's reserve for their activations and the largest chunk it fits at the
        # reserve's context (``loader.budget.capacities``); None: activations not counted, the plan's chunk
        self.activation_shape = layout.sizes.activation
        self.prefill_chunk = layout.capacities.prefill_chunk or plan.prefill.chunk
        self.activation_reserve = layout.capacities.prefill_bytes if self.activation_shape is not None else None
        # precision -> (prefill form, from tokens): only for a store whose held form is made from a staged record
        self.prefill_forms = self.allocation.prefill_forms
        self.prefill_buffers = SlotArena(*self.allocation.prefill_buffers, device) if self.prefill_forms else None
        self._multi = False  # the forward running is a prompt chunk (more than one token, or one of ``prefill``'s)
        self.prefilling = False  # ``loader.prefill.prefill`` is running: its one-token chunks are prompt chunks too
        self._step_reads: dict = {}  # expert -> reads in the layer step running (a prompt chunk's)
        if cleanup is not None:
            cleanup.callback(self.reader.close)
        self.miss_policy = miss_policy
        miss_policy.bind(plan.num_layers, plan.num_experts)
        miss_policy.view = self.cache.view
        # neuron loading reads predicted rows it may proceed with (trust_prediction): no gate there
        self.schedule = LayerSchedule(self.cache, plan.expert_precision, miss_policy, readable=stores,
                                      prefetch_gate=PrefetchGate() if neuron is None and predictors else None)
        self.predictors = predictors
        self.times = [LayerTimes() for _ in range(plan.num_layers)]
        self._prefetching: list = []  # entries whose prefetch read may still be in flight
        self.routing = None  # the installed routing policy (reset with the sequence)
        self.modules: list = []  # the experts module of each MoE layer
        self.miss_costs = None  # measured at load for ``cpu_misses="auto"`` (``MissCosts``)
        self.threads: tuple[int, int] | None = None  # torch threads for (decode steps, longer forwards); None: as set
        self.neuron = None
        if pairings:  # neuron-layout stores compute from their records, whether neuron loading is on or off
            for p, pairing in pairings.items():
                self.forms[p] = NeuronRecordForm(NeuronLayout(layouts[p]), pairing)
            if neuron is not None:
                self.neuron = NeuronStep(self, neuron, pairings)

    @property
    def cpu_misses(self) -> str:
        """The schedule's CPU rule in effect: ``never`` where it serves nothing on the CPU."""
        rule = self.schedule.cpu_rule
        return rule.mode if rule is not None and not rule.off else "never"

    def bind_predictors(self, routers: list, tensors: dict) -> None:
        """Hand every predictor the routers' weights, the artifact's predictor tensors and a view of the cache."""
        context = PredictorContext(
            self.num_layers, self.num_experts, self.top_k, routers, tensors,
            held=lambda layer, expert, precision: self.cache.find(layer, expert, precision) is not None,
            precision_of=lambda layer, expert: self.plan.expert_precision[layer][expert])
        for predictor in self.predictors:
            predictor.bind(context)

    # ----------------------------------------------------------------------------------- slots and reads
    def key(self, layer: int, expert: int) -> str:
        return expert_key(self.layer_ids[layer], expert)

    def _free_slot(self, entry) -> None:
        """The cache dropped ``entry``: its slot returns to the pool's free list once no read targets it."""
        held = entry.payload
        if held is None:
            return
        for job in (held.job, held.row_job):
            if job is not None and not self.reader.cancel(job):
                job.wait_done()  # already being read: let it land before the slot is reused
                self.link.synchronize(job.ready)  # (rare: an eviction of a read in flight) its copy too
        self.arenas[entry.pool].give(held.slot)
        entry.payload = None

    def read_entry(self, entry, priority: int) -> ReadJob:
        """Take a slot of the entry's pool and read its record there (making the held form)."""
        arena = self.arenas[entry.pool]
        held = entry.payload = Held(arena.take())
        held.job = ReadJob(self.stores[entry.precision], self.key(entry.layer, entry.expert), (arena, held.slot),
                           priority, form=self.forms[entry.precision])
        self._note_read(entry.expert)
        return self.reader.submit(held.job)

    def _note_read(self, expert: int) -> None:
        """A prompt chunk's layer step reads ``expert`` (counted: each expert once per layer step)."""
        if self._multi:
            self._step_reads[expert] = self._step_reads.get(expert, 0) + 1

    def take_buffer(self) -> int:
        slot = self.buffers.take()
        self.meter.add(self.buffers.slot_bytes)
        return slot

    def give_buffer(self, slot: int) -> None:
        self.buffers.give(slot)
        self.meter.sub(self.buffers.slot_bytes)
        self._mark_compute()

    def await_job(self, layer: int, job: ReadJob) -> None:
        self.reader.promote(job)
        start = time.perf_counter()
        seconds = job.wait()
        self.link.wait(job.ready)  # the compute stream waits for the copy; the host does not
        stalled = time.perf_counter() - start
        self.times[layer].stall_seconds += stalled
        self.times[layer].read_seconds += seconds
        self._stalled += stalled
        self._count_made(job)

    def _count_made(self, job: ReadJob) -> None:
        """A landed read whose reader made a held form: one decode, and the reader's seconds making it."""
        if job.form is not None and job.form.staged:
            self.counters.decodes += 1
            self.counters.make_seconds += job.make_seconds

    def land(self, layer: int, entry) -> None:
        """Wait for the entry's read; then it is resident, with its form's weights."""
        held = entry.payload
        if held.job is not None:
            self.await_job(layer, held.job)
            held.weights, held.read_seconds, held.job = held.job.weights, held.job.seconds, None
        if entry.in_flight:
            self.cache.complete(entry)

    def _reap(self) -> None:
        """Prefetches whose reads have landed become resident (evictable again); failed ones are dropped (a
        demand reads them again and reports the error)."""
        if not self._prefetching:
            return
        still = []
        for entry in self._prefetching:
            held = entry.payload
            if held is None or held.job is None:
                continue
            job = held.job
            if job.state == "done":
                self.link.wait(job.ready)
                self._count_made(job)
                held.weights, held.read_seconds, held.job = job.weights, job.seconds, None
                self.cache.complete(entry)
            elif job.state in ("failed", "cancelled"):
                self.cache.cancel(entry)
            else:
                still.append(entry)
        self._prefetching = still

    def _mark_compute(self) -> None:
        """GPU: the reader's copies wait for the compute issued so far before overwriting a slot or buffer."""
        if self.link.accelerated:
            self.reader.after_compute = self.link.event()

    # ------------------------------------------------------------------------------------ the layer step
    def begin(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, cpu: bool = True):
        """The schedule's start of a layer step (both paths; cpu: whether the step serves misses on the CPU):
        (decisions, weights [T, K] after skips, and as lists: rows [T][K] of expert ids, -1 where a selection
        has weight 0, and their weights)."""
        self._reap()
        synced = time.perf_counter()
        rows, weights = top_k_index.tolist(), top_k_weights.tolist()  # the one device sync of the step
        self._synced = time.perf_counter() - synced
        if any(w == 0 for row in weights for w in row):  # a routing policy drops a selection by weight 0
            rows = [[e if w != 0 else -1 for e, w in zip(r, ws, strict=True)] for r, ws in zip(rows, weights, strict=True)]
        prefetched = self.schedule.prefetched(layer) if self.predictors else None
        decisions, skipped = self.schedule.begin(layer, rows, top_k_index, top_k_weights, cpu)
        if prefetched:
            self._cancel_unwanted(prefetched, {d.expert for d in decisions} | set(skipped))
            for d in decisions:
                held = d.entry.payload if d.entry is not None else None
                if prefetched.get(d.expert) is d.entry and held is not None and not d.entry.in_flight:
                    self.counters.prefetch_saved_seconds += held.read_seconds
        if skipped and self.miss_policy.renormalize:  # the token's remaining weights keep their former total
            chosen = top_k_index.masked_fill(top_k_weights == 0, -1)
            top_k_weights = renormalized(top_k_weights, chosen, skipped)
            rows, weights = top_k_index.masked_fill(top_k_weights == 0, -1).tolist(), top_k_weights.tolist()
        return decisions, top_k_weights, rows, weights, prefetched

    def run_layer(self, layer: int, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H]."""
        start = time.perf_counter()
        self._stalled = self._computed = self._synced = 0.0
        self._step_reads = {}
        tokens = hidden.shape[0]
        if self.neuron is not None and self.neuron.applies(tokens):
            out = self.neuron.run_layer(layer, module, hidden, top_k_index, top_k_weights)
        else:
            out = self._whole_layer(layer, module, hidden, top_k_index, top_k_weights)
        if self._multi:
            p = self.counters.prefill
            p.layer_steps += 1
            p.step_seconds += time.perf_counter() - start
            p.stall_seconds += self._stalled
            p.reads += sum(self._step_reads.values())
            p.most_reads_per_layer_step = max(p.most_reads_per_layer_step, max(self._step_reads.values(), default=0))
        if tokens == 1 and not self._multi:
            t = self.counters.timing
            t.layer_steps += 1
            t.step_seconds += time.perf_counter() - start
            t.compute_seconds += self._computed
            t.stall_seconds += self._stalled
            t.routing_sync_seconds += self._synced
        return out

    def _whole_layer(self, layer: int, module, hidden, top_k_index, top_k_weights) -> torch.Tensor:
        decisions, top_k_weights, rows, weights, prefetched = self.begin(layer, top_k_index, top_k_weights)
        out = torch.zeros_like(hidden)
        mix = Mixer(hidden, rows, weights, top_k_index, top_k_weights, out)
        ready, waiting, queue, on_cpu = [], [], [], []
        for d in decisions:
            if d.served == CPU:
                on_cpu.append(d)
            elif d.entry is None:
                queue.append(d)
            elif d.entry.in_flight:
                waiting.append(d)
            else:
                ready.append(d)
        reads = []  # (decision, entry or None, buffer slot or None, job)
        unbuffered = []  # misses the cache could not admit, waiting for a read buffer
        in_form = self._prefill_misses(queue, rows) if self._multi and self.prefill_forms else []

        def submit() -> None:
            while in_form and self.prefill_buffers.free:  # read once into a prefill buffer, in the prefill form
                d = in_form.pop(0)
                form = self.prefill_forms[d.precision][0]
                slot = self.prefill_buffers.take()
                self.meter.add(self.prefill_buffers.slot_bytes)
                self.cache.count_read(layer, self.read_bytes[d.precision])
                self._note_read(d.expert)
                job = self.reader.submit(ReadJob(self.stores[d.precision], self.key(layer, d.expert),
                                                 (self.prefill_buffers, slot), DEMAND, form=form))
                reads.append((d, None, -1 - slot, job))
            while queue:
                d = queue.pop(0)
                entry = self.schedule.admit(layer, d.expert, d.precision, self.slot_bytes[d.precision],
                                            self.read_bytes[d.precision])
                if entry is not None:
                    reads.append((d, entry, None, self.read_entry(entry, DEMAND)))
                else:
                    unbuffered.append(d)
            while unbuffered and self.buffers.free:
                d = unbuffered.pop(0)
                slot = self.take_buffer()
                self._note_read(d.expert)
                job = self.reader.submit(ReadJob(self.stores[d.precision], self.key(layer, d.expert),
                                                 (self.buffers, slot), DEMAND, form=self.forms[d.precision]))
                reads.append((d, None, slot, job))

        submit()
        for d in ready:
            if self.neuron is not None:
                self.neuron.fill(layer, d.entry)
            self.compute(module, d, d.entry.payload.weights, mix)
        for d in on_cpu:  # while the reads fly (and, on a GPU, the hits' kernels run)
            self._compute_on_cpu(layer, module, d, mix)
        for d in waiting:
            held, stalled = d.entry.payload, self._stalled
            job = held.job
            self.land(layer, d.entry)
            if self.neuron is not None:
                self.neuron.fill(layer, d.entry)
            if prefetched and prefetched.get(d.expert) is d.entry and job is not None:
                # a prefetch still in flight: it saved what was read before the wait
                self.counters.prefetch_saved_seconds += max(0.0, job.seconds - (self._stalled - stalled))
            self.compute(module, d, held.weights, mix)
        while reads:
            d, entry, slot, job = reads.pop(0)
            if entry is not None:
                self.land(layer, entry)
                weights = entry.payload.weights
            else:
                self.await_job(layer, job)
                weights = job.weights
            if slot is not None and slot < 0:  # a prefill buffer (``-1 - slot``), in its prefill form
                self.compute(module, d, weights, mix, self.prefill_forms[d.precision][0])
                self.counters.prefill.prefill_form_computes += 1
                self.prefill_buffers.give(-1 - slot)
                self.meter.sub(self.prefill_buffers.slot_bytes)
                self._mark_compute()
            else:
                self.compute(module, d, weights, mix)
                if slot is not None:
                    self.give_buffer(slot)
            submit()
        self.finish_layer(layer)
        if self.neuron is not None:
            self.neuron.advance()
        return out

    def _prefill_misses(self, queue: list, rows: list) -> list:
        """The misses of a prompt chunk to read in their precision's prefill form (taken out of ``queue``): those
        whose tokens in this chunk reach the form's ``from_tokens``. Not admitted to the cache: read, used for the
        chunk, dropped."""
        given: dict = {}
        for row in rows:
            for e in row:
                given[e] = given.get(e, 0) + 1
        chosen = [d for d in queue if d.precision in self.prefill_forms
                  and given.get(d.expert, 0) >= self.prefill_forms[d.precision][1]]
        for d in chosen:
            queue.remove(d)
        return chosen

    def compute(self, module, d, weights, mix: Mixer, form=None) -> None:
        """Add expert ``d.expert``'s weighted output for its tokens, from ``weights`` in ``form`` (its held form
        unless given)."""
        start = time.perf_counter()
        form = form if form is not None else self.forms[d.precision]
        if isinstance(form, RecordForm) and form.packed:
            self.counters.decodes += 1  # the record form of a quantized store decodes on every use
        tokens, x, w = mix.inputs(d.expert)
        mix.add(tokens, form.forward(module, weights, x), w)
        self._computed += time.perf_counter() - start

    def _compute_on_cpu(self, layer: int, module, d, mix: Mixer) -> None:
        """A miss served on the CPU from the host store: no copy to the GPU, nothing cached."""
        start = time.perf_counter()
        record = self.stores[d.precision].host_record(self.key(layer, d.expert))
        tokens, x, w = mix.inputs(d.expert)
        form = self.cpu_form(d.precision)
        mix.add(tokens, form.forward(module, form.make(record), x.cpu()).to(mix.out.device), w)
        self.counters.cpu_computed += 1
        self._computed += time.perf_counter() - start

    def cpu_form(self, precision: str):
        """How the CPU computes a host record of ``precision``: from the record as it is, in the store's own
        layout (a neuron-layout store's rows are not a plain record's matrices)."""
        form = self.forms[precision]
        return form if form.name == "record" else RecordForm(self.layouts[precision])

    def finish_layer(self, layer: int) -> None:
        self.schedule.end(layer)
        self._mark_compute()

    # ------------------------------------------------------------------------------------------ prefetch
    def _cancel_unwanted(self, prefetched: dict, wanted: set) -> None:
        """The router has decided: a prefetch for the layer that was not chosen and whose read has not started
        is cancelled (its slot freed); one already read or reading is left to land (wasted)."""
        for expert, entry in prefetched.items():
            held = entry.payload
            if expert in wanted or not entry.in_flight or held is None or held.job is None:
                continue
            if self.reader.cancel(held.job):
                self.cache.cancel(entry)

    def prefetch(self, requests: list[PrefetchRequest]) -> None:
        """Read each requested expert into its pool unless held (then it is only protected); skipped when no
        room can be made. Protection lasts until the expert's layer has run."""
        if not requests:
            return
        self._reap()
        if self.neuron is not None:
            requests = self.neuron.take_inputs(requests)
        for entry in self.schedule.prefetch(requests, self.slot_bytes):
            if self.neuron is None or not self.neuron.prefetch_header(entry):
                self.read_entry(entry, PREFETCH)
                self.cache.count_read(entry.layer, self.read_bytes[entry.precision])
            self._prefetching.append(entry)
        if self.neuron is not None:
            self.neuron.predict_held()

    def after_router(self, layer: int, router_input, indices) -> None:
        if not self.schedule.prefetching:  # the gate closed: the predictors' own time is saved too
            return
        self.schedule.routed(layer, indices.flatten().tolist())  # chosen now: no prefetch may evict them
        for predictor in self.predictors:
            self.prefetch(predictor.after_router(layer, router_input, indices))

    def after_last_layer(self, hidden) -> None:
        if not self.schedule.prefetching:
            return
        for predictor in self.predictors:
            self.prefetch(predictor.after_last_layer(hidden))

    # ------------------------------------------------------------------------------------------ sequences
    def start_forward(self, past_length: int, tokens: int) -> None:
        """A model forward of ``tokens`` new tokens after ``past_length`` cached ones; 0 = a new sequence. With
        ``threads`` set (``load(threads="auto")`` on a CPU), a decode step runs on the first count of torch threads
        and a longer forward on the second: see ``loader.runtime.compute_threads``."""
        self._multi = tokens > 1 or self.prefilling
        if self._multi:
            self.counters.prefill.forwards += 1
            self.counters.prefill.tokens += tokens
        if self.threads is not None:
            want = self.threads[0] if tokens <= 1 else self.threads[1]
            if torch.get_num_threads() != want:
                torch.set_num_threads(want)
        if past_length == 0:
            self.cache.reset()
            for p in [self.miss_policy, *self.predictors, *([self.routing] if self.routing else [])]:
                p.reset()
        self.cache.clock.token = past_length + max(tokens, 1) - 1

    def close(self) -> None:
        self.reader.close()
        for store in self.stores.values():
            store.close()


@dataclass(frozen=True)
class MissCosts:
    """Measured at load on a GPU with the store in host RAM: per precision, seconds for one decode step's
    expert on the CPU (decode + products) against copying its record to the GPU and making its held form
    there. The switch Fiddler, ktransformers and llama.cpp make: a miss is computed where it is cheaper."""

    cpu_seconds: dict
    gpu_seconds: dict

    def prefer_cpu(self, precision: str) -> bool:
        """False for a precision not measured (copying is the default)."""
        if precision not in self.cpu_seconds or precision not in self.gpu_seconds:
            return False
        return self.cpu_seconds[precision] < self.gpu_seconds[precision]

    def rule(self) -> CpuMissRule:
        """The schedule's ``auto`` rule: the precisions whose misses the CPU serves faster."""
        return CpuMissRule("auto", frozenset(p for p in self.cpu_seconds if self.prefer_cpu(p)))

    def to_json(self) -> dict:
        return {"cpu_seconds": self.cpu_seconds, "gpu_seconds": self.gpu_seconds,
                "computed_on_cpu": sorted(p for p in self.cpu_seconds if self.prefer_cpu(p))}


def measure_miss_costs(module, records: dict, cpu_forms: dict, held: dict, device: torch.device,
                       hidden: int) -> MissCosts:
    """``records``: one host record per precision; ``cpu_forms``: how the CPU computes each
    (``ExpertEngine.cpu_form``). Times both ways of serving a one-token miss."""
    cpu, gpu = {}, {}
    x = torch.randn(1, hidden)
    for precision, record in records.items():
        plain = cpu_forms[precision]
        cpu[precision] = median_seconds(lambda r=record, f=plain: f.forward(module, f.make(r), x), repeats=5)
        form = held[precision]
        staging = record.pin_memory() if device.type == "cuda" else record
        xd = x.to(device)

        def on_gpu(form=form, staging=staging, xd=xd):
            rec = staging.to(device, non_blocking=True)
            weights = form.make(rec, torch.empty(form.nbytes, dtype=torch.uint8, device=device))
            form.forward(module, weights, xd)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        gpu[precision] = median_seconds(on_gpu, repeats=5)
    return MissCosts(cpu, gpu)
