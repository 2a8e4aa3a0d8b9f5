"""The offloading engine: the host every MoE layer step runs on.

``ExpertEngine`` holds the state all MoE layers share: the plan, the cache and its schedule
(``loader/schedule.py``), the stores, the slot memory (one arena per pool, the read buffers, the reader
threads' staging buffers, the prefill buffers), the reader, the held form of each store (``loader/forms.py``),
the miss policy and the predictors. It offers the steps their I/O primitives (read into a slot, take and give a
buffer, wait for a read, compute an expert) through the typed interface ``loader.layer.StepHost``.

The layer steps are its peers, chosen per call by ``run_layer``: the whole-expert step (``loader/step.py``)
and, where the artifact's stores are in the neuron layout and neuron loading is on, the neuron step
(``loader/neuron.py``). Both ask the schedule how each wanted expert is served (``LayerSchedule.serve``) and
carry the decision out; the cost model asks the same question (``loader/simulate.py``). Every byte of expert
data held (slots, buffers, staging) is counted by one meter at every change, and the arenas are sized by the
budget (``loader.budget.allocation``), so the budget cannot be passed.

``decode_timing`` counts, over decode steps, the wall time of the layer steps, of expert compute and of
waiting for reads; what is in neither is the loader's own overhead. Shapes: see the legend in
``loader/__init__.py``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from loader import kernels
from loader.budget import allocation
from loader.cache import ExpertCache, MemoryMeter, PoolConfig
from loader.codec import NeuronLayout
from loader.format import expert_key
from loader.forms import RecordForm, median_seconds
from loader.layer import Held, LayerStart, Mixer, StepTimes, renormalized
from loader.neuron import NeuronConfig, NeuronRecordForm, NeuronStep
from loader.policies import policy_factory
from loader.predict import PredictorContext, PrefetchRequest
from loader.schedule import CpuMissRule, LayerSchedule, PrefetchGate
from loader.step import WholeStep
from loader.store import PREFETCH, Reader, ReadJob, SlotArena
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


@dataclass(frozen=True)
class EngineSetup:
    """What the engine runs beyond the plan and the budget's layout: the stores (precision -> ``loader.store``
    store) and their record layouts, the model's top-k, the device, the reader threads, the miss policy and
    predictors (``loader.routing``, ``loader.predict``), each MoE layer's index in the model (record keys),
    neuron loading (None: off) with the pairing of each neuron-layout store, and how reads reach the device
    (``loader/transfer.py``; None: the device's own)."""

    stores: dict
    layouts: dict
    top_k: int
    device: torch.device
    workers: int
    miss_policy: object
    predictors: list
    layer_ids: list
    neuron: NeuronConfig | None = None
    pairings: dict | None = None
    link: Link | None = None


class ExpertEngine:
    """The offloading state shared by every MoE layer, its I/O primitives (``loader.layer.StepHost``), and the
    choice of layer step per call."""

    def __init__(self, plan, layout, setup: EngineSetup, cleanup=None) -> None:
        """layout: ``loader.budget.HeldLayout`` (forms, sizes, capacities). cleanup: an ``ExitStack`` the
        engine registers its reader on (``load`` closes it on any error)."""
        self.plan = plan
        self.layer_ids = setup.layer_ids  # position among the MoE layers -> the model's layer index (record keys)
        self.stores, self.layouts = setup.stores, setup.layouts
        self.forms = dict(layout.forms)
        self.top_k, self.device = setup.top_k, setup.device
        self.link = setup.link if setup.link is not None else link_for(setup.device)
        self.num_layers, self.num_experts = plan.num_layers, plan.num_experts
        self.read_bytes = {p: s.record_bytes for p, s in setup.stores.items()}
        self.slot_bytes = dict(layout.sizes.record_bytes)
        self.counters = Counters()
        self.step_times = StepTimes()
        self.meter = MemoryMeter()
        self._build_cache(plan, layout)
        self._build_memory(plan, layout, setup, cleanup)
        self.miss_policy = setup.miss_policy
        self.miss_policy.bind(plan.num_layers, plan.num_experts)
        self.miss_policy.view = self.cache.view
        self.predictors = setup.predictors
        # neuron loading reads predicted rows it may proceed with (trust_prediction): no gate there
        gate = PrefetchGate() if setup.neuron is None and setup.predictors else None
        self.schedule = LayerSchedule(self.cache, plan.expert_precision, setup.miss_policy, readable=setup.stores,
                                      prefetch_gate=gate)
        self.times = [LayerTimes() for _ in range(plan.num_layers)]
        self._prefetching: list = []  # entries whose prefetch read may still be in flight
        self.routing = None  # the installed routing policy (reset with the sequence)
        self.modules: list = []  # the experts module of each MoE layer
        self.miss_costs = None  # measured at load for ``cpu_misses="auto"`` (``MissCosts``)
        self.threads: tuple[int, int] | None = None  # torch threads for (decode steps, longer forwards); None: as set
        self.neuron = None
        if setup.pairings:  # neuron-layout stores compute from their records, whether neuron loading is on or off
            for p, pairing in setup.pairings.items():
                self.forms[p] = NeuronRecordForm(NeuronLayout(setup.layouts[p]), pairing)
            if setup.neuron is not None:
                self.neuron = NeuronStep(self, setup.neuron, setup.pairings)
        self.whole = WholeStep(self, fill=self.neuron.fill if self.neuron is not None else None)

    def _build_cache(self, plan, layout) -> None:
        pools = [PoolConfig(pool.name, pool.precision, pool.group, layout.capacities.pools[pool.name],
                            self.slot_bytes[pool.precision]) for pool in plan.pools]
        self.cache = ExpertCache(pools, plan.num_layers, plan.num_experts,
                                 policy_factory(plan.eviction.name, plan.eviction.params), meter=self.meter)
        self.cache.on_evict = self._free_slot

    def _build_memory(self, plan, layout, setup: EngineSetup, cleanup) -> None:
        """The arenas, buffers and reader the budget's allocation names (``moeload plan`` prints the same)."""
        self.allocation = allocation(plan, layout, setup.layouts, setup.top_k, setup.workers, setup.device)
        device = setup.device
        self.arenas = {name: SlotArena(count, size, device) for name, (count, size) in self.allocation.pools.items()}
        self.buffers = SlotArena(*self.allocation.read_buffers, device)
        self.staging = SlotArena(*self.allocation.staging, device) if self.allocation.staging[0] else None
        if self.staging is not None:
            self.meter.add(self.staging.count * self.staging.slot_bytes)  # held for the whole run
        self.reader = Reader(setup.workers, device, self.staging, self.link)
        if cleanup is not None:
            cleanup.callback(self.reader.close)
        # a prompt's chunks: the budget's reserve for their activations and the largest chunk it fits at the
        # reserve's context (``loader.budget.capacities``); None: activations not counted, the plan's chunk
        self.activation_shape = layout.sizes.activation
        self.prefill_chunk = layout.capacities.prefill_chunk or plan.prefill.chunk
        self.activation_reserve = layout.capacities.prefill_bytes if self.activation_shape is not None else None
        # precision -> (prefill form, from tokens): only for a store whose held form is made from a staged record
        self.prefill_forms = self.allocation.prefill_forms
        self.prefill_buffers = SlotArena(*self.allocation.prefill_buffers, device) if self.prefill_forms else None
        self.prompt_chunk = False  # the forward running is a prompt chunk (more than one token, or one of ``prefill``'s)
        self.prefilling = False  # ``loader.prefill.prefill`` is running: its one-token chunks are prompt chunks too
        self._step_reads: dict = {}  # expert -> reads in the layer step running (a prompt chunk's)

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

    # -------------------------------------------------------------------- slots and reads (``StepHost``)
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

    def submit(self, job: ReadJob) -> ReadJob:
        """Queue a read on the reader threads."""
        return self.reader.submit(job)

    def take_slot(self, entry) -> Held:
        """A slot of the entry's pool, now the entry's payload."""
        held = entry.payload = Held(self.arenas[entry.pool].take())
        return held

    def read_entry(self, entry, priority: int) -> ReadJob:
        """Take a slot of the entry's pool and read its record there (making the held form)."""
        held = self.take_slot(entry)
        held.job = ReadJob(self.stores[entry.precision], self.key(entry.layer, entry.expert),
                           (self.arenas[entry.pool], held.slot), priority, form=self.forms[entry.precision])
        self.note_read(entry.expert)
        return self.submit(held.job)

    def note_read(self, expert: int) -> None:
        """A prompt chunk's layer step reads ``expert`` (counted: each expert once per layer step)."""
        if self.prompt_chunk:
            self._step_reads[expert] = self._step_reads.get(expert, 0) + 1

    def take_buffer(self, arena: SlotArena | None = None) -> int:
        """A slot of ``arena`` (default: the read buffers), counted by the meter while taken."""
        arena = arena if arena is not None else self.buffers
        slot = arena.take()
        self.meter.add(arena.slot_bytes)
        return slot

    def give_buffer(self, slot: int, arena: SlotArena | None = None) -> None:
        arena = arena if arena is not None else self.buffers
        arena.give(slot)
        self.meter.sub(arena.slot_bytes)
        self.mark_compute()

    def await_job(self, layer: int, job: ReadJob) -> None:
        self.reader.promote(job)
        start = time.perf_counter()
        seconds = job.wait()
        self.link.wait(job.ready)  # the compute stream waits for the copy; the host does not
        stalled = time.perf_counter() - start
        self.times[layer].stall_seconds += stalled
        self.times[layer].read_seconds += seconds
        self.step_times.stalled += stalled
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

    def reap(self) -> None:
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

    def mark_compute(self) -> None:
        """GPU: the reader's copies wait for the compute issued so far before overwriting a slot or buffer."""
        if self.link.accelerated:
            self.reader.after_compute = self.link.event()

    def compute(self, module, d, weights, mix: Mixer, form=None) -> None:
        """Add expert ``d.expert``'s weighted output for its tokens, from ``weights`` in ``form`` (its held form
        unless given)."""
        start = time.perf_counter()
        form = form if form is not None else self.forms[d.precision]
        if isinstance(form, RecordForm) and form.packed:
            self.counters.decodes += 1  # the record form of a quantized store decodes on every use
        tokens, x, w = mix.inputs(d.expert)
        mix.add(tokens, form.forward(module, weights, x), w)
        self.step_times.computed += time.perf_counter() - start

    def compute_together(self, module, ds: list, mix: Mixer) -> list:
        """A one-token step's resident hits ``ds`` in one kernel call (``kernels.experts_product``) where their held
        form is ``qdot`` and the module's gate is the default SiLU one; returns the decisions left to ``compute``."""
        together = [d for d in ds if self.forms[d.precision].name == "qdot" and not d.entry.payload.weights.vectors]
        if not mix.single or len(together) < 2 or len(together) > kernels.MAX_EXPERTS or not silu_gated(module):
            return ds
        start = time.perf_counter()
        held = [d.entry.payload.weights.matrices for d in together]
        y = kernels.experts_product([m["gate_up_proj"] for m in held], [m["down_proj"] for m in held],
                                    [float(mix.weight_of[d.expert]) for d in together], mix.hidden)
        mix.add(None, y, 1.0)
        self.step_times.computed += time.perf_counter() - start
        done = {id(d) for d in together}
        return [d for d in ds if id(d) not in done]

    def cpu_form(self, precision: str):
        """How the CPU computes a host record of ``precision``: from the record as it is, in the store's own
        layout (a neuron-layout store's rows are not a plain record's matrices)."""
        form = self.forms[precision]
        return form if form.name == "record" else RecordForm(self.layouts[precision])

    # ------------------------------------------------------------------------------------ the layer step
    def begin(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, *, cpu: bool = True,
              read_bytes: dict | None = None, prefill_forms: bool = True) -> LayerStart:
        """The schedule's decisions for a layer call, every miss placed (``LayerSchedule.serve``). cpu: whether the
        step serves misses on the CPU; read_bytes: the reads the schedule counts (default: every whole record);
        prefill_forms: whether a prompt chunk's misses may be read in their prefill form."""
        self.reap()
        synced = time.perf_counter()
        rows, weights = top_k_index.tolist(), top_k_weights.tolist()  # the one device sync of the step
        self.step_times.synced = time.perf_counter() - synced
        if any(w == 0 for row in weights for w in row):  # a routing policy drops a selection by weight 0
            rows = [[e if w != 0 else -1 for e, w in zip(r, ws, strict=True)] for r, ws in zip(rows, weights, strict=True)]
        forms = {p: n for p, (_f, n) in self.prefill_forms.items()} if prefill_forms and self.prompt_chunk else None
        served = self.schedule.serve(
            layer, rows, top_k_index, top_k_weights, cpu=cpu, slot_bytes=self.slot_bytes,
            read_bytes=self.read_bytes if read_bytes is None else read_bytes, prompt_forms=forms or None,
            cancel=self._cancel_read if self.predictors else None)
        for d in served.decisions if served.prefetched else ():
            held = d.entry.payload if d.entry is not None else None
            if served.prefetched.get(d.expert) is d.entry and not d.miss and held is not None and not d.entry.in_flight:
                self.counters.prefetch_saved_seconds += held.read_seconds
        if served.skipped and self.miss_policy.renormalize:  # the token's remaining weights keep their former total
            chosen = top_k_index.masked_fill(top_k_weights == 0, -1)
            top_k_weights = renormalized(top_k_weights, chosen, served.skipped)
            rows, weights = top_k_index.masked_fill(top_k_weights == 0, -1).tolist(), top_k_weights.tolist()
        return LayerStart(served.decisions, rows, weights, top_k_weights, served.prefetched)

    def _cancel_read(self, entry) -> bool:
        """The schedule's cancellation: whether the entry's prefetch read was stopped before it started."""
        held = entry.payload
        return held is not None and held.job is not None and self.reader.cancel(held.job)

    def run_layer(self, layer: int, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H], by the step this call takes."""
        start = time.perf_counter()
        self.step_times.reset()
        self._step_reads = {}
        tokens = hidden.shape[0]
        step = self.neuron if self.neuron is not None and self.neuron.applies(tokens) else self.whole
        out = step.run(layer, module, hidden, top_k_index, top_k_weights)
        if self.neuron is not None:
            self.neuron.advance()
        self._count_step(tokens, time.perf_counter() - start)
        return out

    def _count_step(self, tokens: int, seconds: float) -> None:
        if self.prompt_chunk:
            p = self.counters.prefill
            p.layer_steps += 1
            p.step_seconds += seconds
            p.stall_seconds += self.step_times.stalled
            p.reads += sum(self._step_reads.values())
            p.most_reads_per_layer_step = max(p.most_reads_per_layer_step, max(self._step_reads.values(), default=0))
        if tokens == 1 and not self.prompt_chunk:
            t = self.counters.timing
            t.layer_steps += 1
            t.step_seconds += seconds
            t.compute_seconds += self.step_times.computed
            t.stall_seconds += self.step_times.stalled
            t.routing_sync_seconds += self.step_times.synced

    def finish_layer(self, layer: int) -> None:
        self.schedule.end(layer)
        self.mark_compute()

    # ------------------------------------------------------------------------------------------ prefetch
    def track_prefetch(self, entry) -> None:
        """A prefetch read was issued into ``entry``: it becomes resident when it lands (``reap``)."""
        self._prefetching.append(entry)

    def prefetch(self, requests: list[PrefetchRequest]) -> None:
        """Read each requested expert into its pool unless held (then it is only protected); skipped when no
        room can be made. Protection lasts until the expert's layer has run. With neuron loading the neuron
        step issues them (it reads a predicted expert's header first)."""
        if not requests:
            return
        self.reap()
        if self.neuron is not None:
            self.neuron.prefetch(requests)
            return
        for entry in self.schedule.prefetch(requests, self.slot_bytes):
            self.read_entry(entry, PREFETCH)
            self.cache.count_read(entry.layer, self.read_bytes[entry.precision])
            self.track_prefetch(entry)

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
        self.prompt_chunk = tokens > 1 or self.prefilling
        if self.prompt_chunk:
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


def silu_gated(module) -> bool:
    """Whether an experts module's gate is transformers' default: SiLU of the first half of gate_up times the
    second (what ``kernels.experts_product`` computes), with no norm after the expert."""
    known = getattr(module, "_moeprep_silu_gated", None)
    if known is None:
        from transformers.activations import SiLUActivation
        from transformers.integrations.moe import _default_apply_gate

        known = (getattr(type(module), "_apply_gate", None) is _default_apply_gate
                 and type(getattr(module, "act_fn", None)) in (SiLUActivation, torch.nn.SiLU)
                 and getattr(module, "is_concatenated", True) and not getattr(module, "has_post_expert_norm", False))
        module._moeprep_silu_gated = known
    return known


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
