"""Run an artifact: dense weights resident, experts streamed from the stores through the expert cache.

``load()`` builds the Hugging Face model skeleton on the meta device, assigns the dense weights, drops
the (never materialised) fused expert parameters, and plugs an offloaded experts forward into
transformers through its experts-implementation registry (``ALL_EXPERTS_FUNCTIONS``), so every
architecture whose experts module uses ``@use_experts_implementation`` works without patching classes.

The pieces, each in its own home: the plan and the budget arithmetic (``loader/plan.py``), the cache
core and eviction policies (``loader/cache.py``), stores, slot memory and the reader threads
(``loader/store.py``), routing and miss policies (``loader/routing.py``), predictors
(``loader/predict.py``). ``ExpertRuntime.run_layer`` is the per-layer step that ties them together:

1. the wanted experts (in the order of ``ordered_experts``) at their planned precision go to
   ``cache.begin_layer``: hits, joins (a read already in flight) and misses;
2. for each miss the miss policy picks a precision (or skip); the record is read into a cache slot the
   cache admits, or else into one of the K read buffers, demand reads ahead of prefetches;
3. hits compute while the reads fly; then each read is waited for (stall time) and computed;
4. ``cache.end_layer``. Every byte of expert data held (slots in use, read buffers in use) is counted
   by one meter at every change, and the arenas are sized by the budget, so the budget cannot be passed.

An expert computes exactly as transformers' eager experts loop does, using the module's own gate
function. Shapes: see the legend in ``loader/plan.py``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loader.cache import ExpertCache, MemoryMeter, PoolConfig, ordered_experts, policy_factory
from loader.codec import NeuronLayout, RecordLayout
from loader.format import ArtifactError, check_model, check_record, expert_key, open_artifact, read_manifest
from loader.kernels import (
    CPU_MISSES,
    INT4PACK_MAX_TOKENS,
    Int4PackLayout,
    KernelError,
    MissCosts,
    check_expert_dtype,
    expert_forward,
    held_layout,
    measure_miss_costs,
    needs_decoding,
)
from loader.neuron import NeuronConfig, NeuronError, TrustedPrediction, active_set, neuron_forward
from loader.plan import (
    Capacities,
    ModelSizes,
    Plan,
    PlanError,
    PolicySpec,
    capacities,
    read_plan,
    resolve_budget,
)
from loader.plan import minimum_budget as minimum_budget_of
from loader.predict import (
    PREDICTORS_FILE,
    Predictor,
    PredictorContext,
    PredictorError,
    PrefetchRequest,
    make_predictor,
)
from loader.routing import (
    MISS_POLICIES,
    ROUTING_POLICIES,
    SKIP,
    ChainedRouting,
    InstalledRouting,
    MissPolicy,
    RoutingPolicy,
    install_routing,
)
from loader.store import DEMAND, PREFETCH, ExpertStore, Reader, ReadJob, SlotArena

IMPLEMENTATION = "moeprep_offload"


class LoaderError(ArtifactError):
    """A request the loader cannot satisfy (budget too small, no GPU, ...); the message says what to do."""


def parse_device(device: str) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N'; anything else (or CUDA on a machine without one) is a LoaderError."""
    text = str(device).strip().lower()
    if text != "cpu" and not (text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise LoaderError(f"device {device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LoaderError(f"device {device!r} was asked for but torch sees no CUDA GPU; use device='cpu'")
        if ":" in text and int(text[5:]) >= torch.cuda.device_count():
            raise LoaderError(f"device {device!r}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(text)


@dataclass
class LayerTimes:
    read_seconds: float = 0.0
    stall_seconds: float = 0.0


class ExpertRuntime:
    """The offloading state shared by every MoE layer: plan, cache, stores, slot memory, reader,
    routing-side hooks (miss policy, predictors), and the per-layer step."""

    def __init__(self, plan: Plan, caps: Capacities, stores: dict[str, ExpertStore],
                 layouts: dict[str, RecordLayout], top_k: int, device: torch.device, workers: int,
                 miss_policy: MissPolicy, predictors: list[Predictor], layer_ids: list[int],
                 neuron: NeuronConfig | None = None, pairings: dict[str, str] | None = None,
                 decoded: dict | None = None) -> None:
        self.plan = plan
        self.layer_ids = layer_ids  # position among the MoE layers -> the model's layer index (record keys)
        self.caps = caps
        self.stores = stores
        self.layouts = layouts
        self.top_k = top_k
        self.device = device
        self.num_layers, self.num_experts = plan.num_layers, plan.num_experts
        # a quantized store's cached experts hold a decoded copy after their record (loader/kernels.py)
        self.decoded = {p: d for p, d in (decoded or {}).items() if d is not None}
        self.read_bytes = {p: slot_bytes(s) for p, s in stores.items()}
        self.slot_bytes = {p: held_bytes(s, self.decoded.get(p)) for p, s in stores.items()}
        self.quantized = {p for p, lay in layouts.items() if needs_decoding(lay)}
        self.decodes, self.decode_seconds = 0, 0.0  # decodes of a quantized record, and their time
        # on a GPU with the store in host RAM: decode-step misses computed on the CPU (``load(cpu_misses=...)``)
        self.cpu_misses = "never"
        self.miss_costs: MissCosts | None = None
        self.cpu_computed = 0
        self.meter = MemoryMeter()
        self.cache = ExpertCache(
            [PoolConfig(pool.name, pool.precision, pool.group, caps.pools[pool.name], self.slot_bytes[pool.precision])
             for pool in plan.pools],
            plan.num_layers, plan.num_experts, policy_factory(plan.eviction.name, plan.eviction.params),
            meter=self.meter)
        self.cache.on_evict = self._free_slot
        self.arenas = {pool.name: SlotArena(sum(b // self.slot_bytes[pool.precision] for b in caps.pools[pool.name].values()),
                                            self.slot_bytes[pool.precision], device) for pool in plan.pools}
        self.buffers = SlotArena(top_k, max(self.read_bytes.values()), device)
        self.reader = Reader(workers, device)
        self.miss_policy = miss_policy
        self.predictors = predictors
        self.times = [LayerTimes() for _ in range(plan.num_layers)]
        self.peak_cache_bytes = 0
        self._prefetching: list = []  # entries whose prefetch read may still be in flight
        self.routing: RoutingPolicy | None = None  # the installed routing policy (reset with the sequence)
        self.prefetch_saved_seconds = 0.0  # read time of used prefetches a demand did not wait for
        miss_policy.bind(plan.num_layers, plan.num_experts)
        miss_policy.view = self.cache.view
        # neuron-level loading (loader/neuron.py): the stores in the neuron layout and their gate_up pairing
        self.neuron = neuron
        self.pairings = pairings or {}
        self.neuron_layouts = {p: NeuronLayout(lay) for p, lay in layouts.items() if p in self.pairings}
        self.modules: list = []  # the experts module of each MoE layer (the neuron predictor's activation)
        self._neuron_pending: list = []  # (entry, router input): predicted experts whose header is on its way
        self.neuron_counts = dict.fromkeys(
            ("experts", "neurons", "active", "computed", "rows_read", "whole_reads", "partial_reads",
             "predicted_experts", "predicted_rows", "predicted_active", "active_predicted"), 0)

    def bind_predictors(self, routers: list, tensors: dict) -> None:
        """Hand every predictor the routers' weights, the artifact's predictor tensors and a view of the cache."""
        context = PredictorContext(
            self.num_layers, self.num_experts, self.top_k, routers, tensors,
            held=lambda layer, expert, precision: self.cache.find(layer, expert, precision) is not None,
            precision_of=lambda layer, expert: self.plan.expert_precision[layer][expert])
        for predictor in self.predictors:
            try:
                predictor.bind(context)
            except PredictorError as e:
                raise LoaderError(str(e)) from None

    # ----------------------------------------------------------------------------- slots and reads
    def _free_slot(self, entry) -> None:
        """The cache dropped ``entry``: its slot returns to the pool's free list once no read targets it."""
        if entry.slot < 0:
            return
        for job in (entry.ticket, entry.row_job):
            if job is not None and not self.reader.cancel(job):
                job.wait_done()  # already being read: let it land before the slot is reused
        self.arenas[entry.pool].give(entry.slot)
        entry.slot = -1
        entry.weights = None
        entry.ticket = entry.row_job = None

    def _reap(self) -> None:
        """Mark prefetches whose reads have landed as resident (evictable again); drop failed ones (a
        demand reads them again and reports the error)."""
        still = []
        for entry in self._prefetching:
            job = entry.ticket
            if entry.slot < 0 or job is None:
                continue
            if job.state == "done":
                self.cache.complete(entry, True)
                entry.read_seconds += job.seconds
            elif job.state in ("failed", "cancelled"):
                self.cache.cancel(entry)
            else:
                still.append(entry)
        self._prefetching = still

    def _read_into_entry(self, entry, priority: int) -> ReadJob:
        arena = self.arenas[entry.pool]
        entry.slot = arena.take()
        entry.weights = None
        job = ReadJob(self.stores[entry.precision], self.key(entry.layer, entry.expert), arena, entry.slot, priority)
        entry.ticket = job
        return self.reader.submit(job)

    def key(self, layer: int, expert: int) -> str:
        return expert_key(self.layer_ids[layer], expert)

    def _record(self, entry) -> torch.Tensor:
        return self.arenas[entry.pool].tensor(entry.slot, self.stores[entry.precision].record_bytes)

    def _await(self, layer: int, job: ReadJob) -> None:
        self.reader.promote(job)
        start = time.perf_counter()
        seconds = job.wait()
        self.times[layer].stall_seconds += time.perf_counter() - start
        self.times[layer].read_seconds += seconds

    def _begin(self, layer: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """The start of a layer step (both paths): the wanted experts classified by the cache, queued prefetches
        the router did not choose cancelled, and per wanted expert the precision to compute it at (the miss
        policy's for a miss; skipped experts left out, the weights renormalized after a skip when the policy
        says so). Returns ([(expert, entry or None, precision)], top_k_weights, {expert: prefetched entry})."""
        cache = self.cache
        self._reap()
        planned = self.plan.expert_precision[layer]
        active = top_k_weights != 0  # a routing policy drops a selection by giving it weight 0: never read
        chosen = top_k_index if bool(active.all()) else top_k_index.masked_fill(~active, -1)
        wanted = [(e, planned[e]) for e in ordered_experts(chosen.tolist(), self.num_experts)]
        prefetched = {e.expert: e for e in cache.layer_entries(layer) if e.prefetched}
        requests = cache.begin_layer(layer, wanted)
        self._cancel_unwanted(layer, prefetched, {e for e, _ in wanted})
        decisions, skipped = [], []
        for req in requests:
            entry, precision = req.entry, req.precision
            if entry is not None and prefetched.get(req.expert) is entry and not entry.in_flight:
                self.prefetch_saved_seconds += entry.read_seconds
            if req.kind == "miss":
                precision = self.miss_policy.decide(layer, req.expert, req.precision, top_k_index, top_k_weights)
                if precision == SKIP:
                    cache.skip(layer, req.expert)
                    skipped.append(req.expert)
                    continue
                if precision != req.precision:  # a lower precision may be held already
                    entry = cache.find(layer, req.expert, precision)
                if entry is None and precision not in self.stores:
                    raise LoaderError(f"the miss policy asked for precision {precision!r}, which the artifact has "
                                      f"no store for (stores: {sorted(self.stores)})")
            precision = entry.precision if entry is not None else precision
            cache.use(layer, req.expert, precision)
            decisions.append((req.expert, entry, precision))
        if skipped and self.miss_policy.renormalize:  # the token's remaining weights keep their former total
            top_k_weights = renormalized(top_k_weights, chosen, skipped)
        return decisions, top_k_weights, prefetched

    # ------------------------------------------------------------------------------ the layer step
    def run_layer(self, layer: int, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H]."""
        if self._neuron_on(hidden.shape[0]):
            out = self._run_neuron_layer(layer, module, hidden, top_k_index, top_k_weights)
            self._advance_neuron_prefetches()
            return out
        out = torch.zeros_like(hidden)
        cache = self.cache
        decisions, top_k_weights, prefetched = self._begin(layer, top_k_index, top_k_weights)
        ready, waiting, queue = [], [], []  # queue: misses to read, (expert, precision)
        for expert, entry, precision in decisions:
            if entry is None:
                queue.append((expert, precision))
            elif entry.in_flight:
                waiting.append((expert, entry))
            else:
                ready.append((expert, entry))
        reads = []  # (expert, entry or None, buffer slot or None, job)
        buffers_free = self.buffers.count

        def submit_next() -> None:
            nonlocal buffers_free
            while queue:
                expert, precision = queue[0]
                store = self.stores[precision]
                entry = cache.admit(layer, expert, precision, self.slot_bytes[precision])
                if entry is not None:
                    queue.pop(0)
                    reads.append((expert, entry, None, self._read_into_entry(entry, DEMAND)))
                    cache.count_read(layer, store.record_bytes)
                    continue
                if buffers_free == 0:
                    return  # wait for a read buffer to come back
                queue.pop(0)
                buffers_free -= 1
                slot = self.buffers.take()
                self.meter.add(self.buffers.slot_bytes)
                job = self.reader.submit(ReadJob(store, self.key(layer, expert), self.buffers, slot, DEMAND))
                reads.append((expert, None, slot, job))
                cache.count_read(layer, store.record_bytes)

        if queue and hidden.shape[0] == 1 and self.cpu_misses != "never":
            on_cpu = [(e, p) for e, p in queue if self.cpu_misses == "always" or self.miss_costs.prefer_cpu(p)]
            queue = [item for item in queue if item not in on_cpu]
            for expert, precision in on_cpu:
                self._compute_on_cpu(layer, module, expert, precision, hidden, top_k_index, top_k_weights, out)
        submit_next()
        for expert, entry in ready:
            self._fill(layer, entry)
            self._compute(module, expert, self._record(entry), entry.precision, hidden, top_k_index, top_k_weights, out,
                          entry=entry)
        for expert, entry in waiting:
            stalled = self.times[layer].stall_seconds
            self._await(layer, entry.ticket)
            if prefetched.get(expert) is entry:  # a prefetch still in flight: saved what was read before the wait
                self.prefetch_saved_seconds += max(0.0, entry.ticket.seconds - (self.times[layer].stall_seconds - stalled))
            cache.complete(entry, True)
            self._fill(layer, entry)
            self._compute(module, expert, self._record(entry), entry.precision, hidden, top_k_index, top_k_weights, out,
                          entry=entry)
        while reads:
            expert, entry, slot, job = reads.pop(0)
            self._await(layer, job)
            if entry is not None:
                cache.complete(entry, True)
                record, precision = self._record(entry), entry.precision
            else:
                record, precision = self.buffers.tensor(slot, job.store.record_bytes), job.store.precision
            self._compute(module, expert, record, precision, hidden, top_k_index, top_k_weights, out, entry=entry)
            if slot is not None:
                self.buffers.give(slot)
                self.meter.sub(self.buffers.slot_bytes)
                buffers_free += 1
            submit_next()
        self._end_layer(layer)
        self._advance_neuron_prefetches()
        return out

    def _compute_on_cpu(self, layer, module, expert, precision, hidden, top_k_index, top_k_weights, out) -> None:
        """A miss served on the CPU from the host store: no copy to the GPU, nothing cached."""
        tokens, slot = torch.where((top_k_index == expert) & (top_k_weights != 0))
        record = self.stores[precision].host_record(self.key(layer, expert))
        y = expert_forward(module, self.layouts[precision].decode(record), hidden[tokens].cpu())
        y = y.to(out.device, out.dtype) * top_k_weights[tokens, slot, None]
        out.index_add_(0, tokens, y)
        self.cpu_computed += 1

    def _end_layer(self, layer: int) -> None:
        self.cache.end_layer(layer)
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.cache.nbytes)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self.reader.after_compute = event

    def _weights(self, record: torch.Tensor, precision: str, entry) -> dict[str, torch.Tensor]:
        """The matrices to compute with: a cached expert's decoded copy (decoded into its slot on first use),
        a read buffer's record decoded for this one use, or the record itself (passthrough, or packed)."""
        decoded = self.decoded.get(precision)
        if entry is not None and entry.weights is not None:
            return entry.weights
        if decoded is None and precision not in self.quantized:
            return self.layouts[precision].decode(record)  # plain matrices: views of the record
        start = time.perf_counter()
        if decoded is None:
            weights = self.layouts[precision].decode(record)
        elif entry is None:
            weights = decoded.fill(record, torch.empty(decoded.nbytes, dtype=torch.uint8, device=record.device))
        else:
            arena = self.arenas[entry.pool]
            begin = entry.slot * arena.slot_bytes + self.read_bytes[precision]
            weights = entry.weights = decoded.fill(record, arena.data[begin:begin + decoded.nbytes])
        self.decodes += 1
        self.decode_seconds += time.perf_counter() - start
        return weights

    def _decode_once(self, record: torch.Tensor, precision: str) -> dict[str, torch.Tensor]:
        """The record decoded for one use (counted with the decodes)."""
        start = time.perf_counter()
        weights = self.layouts[precision].decode(record)
        self.decodes += 1
        self.decode_seconds += time.perf_counter() - start
        return weights

    def _compute(self, module, expert, record, precision, hidden, top_k_index, top_k_weights, out,
                 rows: torch.Tensor | None = None, header: dict | None = None, entry=None) -> None:
        """Add expert ``expert``'s weighted output for its tokens to ``out``; a neuron-layout record computes over
        the neurons of the bool mask ``rows`` (None: all), each token over its own active ones with
        ``compute: active``."""
        tokens, slot = torch.where((top_k_index == expert) & (top_k_weights != 0))
        x = hidden[tokens]
        if precision in self.neuron_layouts:
            index = None if rows is None or bool(rows.all()) else rows.nonzero().flatten()
            per_token = self.neuron.theta if self.neuron is not None and self.neuron.compute == "active" \
                and rows is not None else None
            y = neuron_forward(module, self.neuron_layouts[precision], record, self.pairings[precision], x, index,
                               header, per_token)
            out.index_add_(0, tokens, (y * top_k_weights[tokens, slot, None]).to(out.dtype))
            return
        if isinstance(self.decoded.get(precision), Int4PackLayout) and tokens.numel() > INT4PACK_MAX_TOKENS:
            weights = self._decode_once(record, precision)  # a long prefill: the int4 kernel is slow at many rows
        else:
            weights = self._weights(record, precision, entry)
        y = expert_forward(module, weights, x)  # in the weights' dtype
        y = y.to(out.dtype) * top_k_weights[tokens, slot, None]
        out.index_add_(0, tokens, y)

    # ----------------------------------------------------------------------------- neuron-level loading
    def _neuron_on(self, tokens: int) -> bool:
        """Whether a forward of ``tokens`` tokens takes the neuron path (decode only unless ``prefill``)."""
        return self.neuron is not None and bool(self.neuron_layouts) and (tokens == 1 or self.neuron.prefill)

    def _rows_job(self, layer: int, store: ExpertStore, arena: SlotArena, slot: int, expert: int,
                  rows: torch.Tensor, priority: int) -> tuple[ReadJob, torch.Tensor]:
        """Read the neuron rows of the bool mask ``rows`` into ``slot``: (the job, every row the read brings,
        which with O_DIRECT's whole blocks may be more than asked). The bytes fetched count as read."""
        layout = self.neuron_layouts[store.precision]
        spans = store.spans(layout.ranges(rows))
        job = self.reader.submit(ReadJob(store, self.key(layer, expert), arena, slot, priority, spans))
        self.cache.count_read(layer, sum(length for _s, length in spans))
        brought = rows | layout.covered(spans)
        self.neuron_counts["rows_read"] += int(brought.sum())
        return job, brought

    def _header_job(self, layer: int, store: ExpertStore, arena: SlotArena, slot: int, expert: int,
                    priority: int) -> tuple[ReadJob, torch.Tensor]:
        """Read a neuron record's header (W1 and the biases) into ``slot``: (the job, the rows its read brings
        along, the rest of its last 4 KiB block with O_DIRECT)."""
        layout = self.neuron_layouts[store.precision]
        spans = store.spans([(0, layout.rows_offset)])
        job = self.reader.submit(ReadJob(store, self.key(layer, expert), arena, slot, priority, spans))
        self.cache.count_read(layer, sum(length for _s, length in spans))
        return job, layout.covered(spans)

    def _land_rows(self, layer: int, entry, wait: bool = True) -> None:
        """Merge a finished neuron read into the entry's mask (waiting for it when ``wait``): the union rule."""
        job = entry.row_job
        if job is None or (not wait and job.state not in ("done", "failed", "cancelled")):
            return
        if wait:
            self._await(layer, job)
        if job.state == "done":
            entry.neurons = entry.neurons | entry.row_mask
        entry.row_job = entry.row_mask = None

    def _fill(self, layer: int, entry) -> None:
        """Make a partly read neuron record whole before a whole-expert compute (a prefill after decode)."""
        if entry.neurons is None:
            return
        self._land_rows(layer, entry)
        missing = ~entry.neurons
        if bool(missing.any()):
            store = self.stores[entry.precision]
            job, _ = self._rows_job(layer, store, self.arenas[entry.pool], entry.slot, entry.expert, missing, DEMAND)
            self._await(layer, job)
        entry.neurons = None

    def _to_read(self, resident: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """The rows to read for ``active`` given ``resident``: the active ones missing, or every missing row
        once the expert would hold more than ``crossover`` of its neurons (a whole read costs less)."""
        need = active & ~resident
        if bool(need.any()) and float((resident | need).float().mean()) > self.neuron.crossover:
            need = ~resident
            self.neuron_counts["whole_reads"] += 1
        elif bool(need.any()):
            self.neuron_counts["partial_reads"] += 1
        return need

    def _run_neuron_layer(self, layer: int, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
        """The layer step with neuron-level loading: a miss reads the record's header (W1), W1 names the active
        neurons, and only the rows the slot lacks are read (``_to_read``); hits add their missing active
        rows the same way. Headers are read for every miss first, then each expert's rows, so reads overlap."""
        out = torch.zeros_like(hidden)
        cache = self.cache
        decisions, top_k_weights, _ = self._begin(layer, top_k_index, top_k_weights)
        self._neuron_pending = [(e, x) for e, x in self._neuron_pending if e.layer != layer]
        items = [{"expert": expert, "entry": entry, "precision": precision} for expert, entry, precision in decisions]
        batch = []
        for item in items:
            if item["entry"] is None:
                precision = item["precision"]
                item["entry"] = cache.admit(layer, item["expert"], precision, self.slot_bytes[precision])
                if item["entry"] is None and not self.buffers.free:
                    self._neuron_batch(layer, module, hidden, top_k_index, top_k_weights, out, batch)
                    batch = []
                self._start_miss(layer, item)
            batch.append(item)
        self._neuron_batch(layer, module, hidden, top_k_index, top_k_weights, out, batch)
        self._end_layer(layer)
        return out

    def _start_miss(self, layer: int, item: dict) -> None:
        """A miss: take a slot (the admitted entry's, else a read buffer) and start reading the header (a
        neuron record) or the whole record."""
        entry, precision, expert = item["entry"], item["precision"], item["expert"]
        store = self.stores[precision]
        if entry is not None:
            arena, entry.slot = self.arenas[entry.pool], self.arenas[entry.pool].take()
            slot = entry.slot
        else:
            arena, slot = self.buffers, self.buffers.take()
            self.meter.add(self.buffers.slot_bytes)
            item["buffer"] = slot
        if precision in self.neuron_layouts:
            job, item["brought"] = self._header_job(layer, store, arena, slot, expert, DEMAND)
            if entry is not None:
                entry.neurons = item["brought"]
        else:
            job = self.reader.submit(ReadJob(store, self.key(layer, expert), arena, slot, DEMAND))
            self.cache.count_read(layer, store.record_bytes)
        if entry is not None:
            entry.ticket = job
        item["job"] = job

    def _neuron_batch(self, layer, module, hidden, top_k_index, top_k_weights, out, items: list) -> None:
        """Wait for each item's header, read the rows its active set lacks, then compute each over its rows."""
        cfg = self.neuron
        for item in items:
            entry, precision, expert = item["entry"], item["precision"], item["expert"]
            job = item.get("job") or (entry.ticket if entry is not None and entry.in_flight else None)
            if job is not None:
                self._await(layer, job)
                if entry is not None:
                    self.cache.complete(entry, True)
            if precision not in self.neuron_layouts:
                if entry is not None:
                    self._fill(layer, entry)
                continue
            layout = self.neuron_layouts[precision]
            if entry is not None:
                self._land_rows(layer, entry)
                arena, slot = self.arenas[entry.pool], entry.slot
                resident = entry.neurons if entry.neurons is not None else torch.ones(layout.intermediate, dtype=torch.bool)
            else:
                arena, slot = self.buffers, item["buffer"]
                resident = item.get("brought", torch.zeros(layout.intermediate, dtype=torch.bool))
            record = arena.tensor(slot, self.stores[precision].record_bytes)
            tokens, _ = torch.where((top_k_index == expert) & (top_k_weights != 0))
            header = layout.header(record)
            wanted = active_set(module, header, hidden[tokens], self.pairings[precision], cfg.theta)
            counts = self.neuron_counts
            counts["experts"] += 1
            counts["neurons"] += layout.intermediate
            counts["active"] += int(wanted.sum())
            predicted = entry.predicted if entry is not None else None
            if predicted is not None:
                counts["predicted_experts"] += 1
                counts["predicted_rows"] += int(predicted.sum())
                counts["predicted_active"] += int((predicted & wanted).sum())
                counts["active_predicted"] += int(wanted.sum())
                entry.predicted = None
            trusted = cfg.trust_prediction and predicted is not None
            need = torch.zeros_like(wanted) if trusted else self._to_read(resident, wanted)
            item.update(header=header, wanted=wanted, resident=resident, record=record)
            if bool(need.any()):
                job, brought = self._rows_job(layer, self.stores[precision], arena, slot, expert, need, DEMAND)
                item["rows"] = (brought, job)
        for item in items:
            entry, precision, expert = item["entry"], item["precision"], item["expert"]
            if precision not in self.neuron_layouts:
                record = self.arenas[entry.pool].tensor(entry.slot, self.stores[precision].record_bytes) \
                    if entry is not None else self.buffers.tensor(item["buffer"], self.stores[precision].record_bytes)
                self._compute(module, expert, record, precision, hidden, top_k_index, top_k_weights, out, entry=entry)
            else:
                resident = item["resident"]
                if "rows" in item:
                    need, job = item["rows"]
                    self._await(layer, job)
                    resident = resident | need
                    if entry is not None:
                        entry.neurons = resident
                rows = resident if self.neuron.compute == "resident" else item["wanted"] & resident
                self.neuron_counts["computed"] += int(rows.sum())
                self._compute(module, expert, item["record"], precision, hidden, top_k_index, top_k_weights, out,
                              rows, item["header"])
            if "buffer" in item:
                self.buffers.give(item["buffer"])
                self.meter.sub(self.buffers.slot_bytes)

    def _predict_rows(self, entry, x: torch.Tensor) -> None:
        """CORM's neuron prediction: the held W1 of a predicted expert on the earlier layer's router input names
        the active neurons; the rows the slot lacks are prefetched."""
        if entry.slot < 0 or entry.in_flight or entry.neurons is None or entry.row_job is not None:
            return
        layout = self.neuron_layouts[entry.precision]
        header = layout.header(self._record(entry))
        predicted = active_set(self.modules[entry.layer], header, x, self.pairings[entry.precision], self.neuron.theta)
        entry.predicted = predicted
        need = self._to_read(entry.neurons, predicted)
        if bool(need.any()):
            entry.row_job, entry.row_mask = self._rows_job(entry.layer, self.stores[entry.precision],
                                                           self.arenas[entry.pool], entry.slot, entry.expert, need,
                                                           PREFETCH)

    def _advance_neuron_prefetches(self) -> None:
        """After a layer's compute: predicted experts whose header has landed get their neuron rows prefetched;
        finished neuron reads are merged into their masks."""
        if not self._neuron_pending:
            return
        self._reap()  # headers that have landed become resident (they are prefetches like any other)
        still = []
        for entry, x in self._neuron_pending:
            if entry.slot < 0:
                continue
            if entry.in_flight:
                still.append((entry, x))
            else:
                self._predict_rows(entry, x)
        self._neuron_pending = still

    # ----------------------------------------------------------------------------------- prefetch
    def _cancel_unwanted(self, layer: int, prefetched: dict, wanted: set) -> None:
        """The router of ``layer`` has decided: a prefetch for it that was not chosen and whose read has not
        started is cancelled (its slot freed); one already read or reading is left to land (wasted)."""
        for expert, entry in prefetched.items():
            if expert in wanted or not entry.in_flight or entry.ticket is None:
                continue
            if self.reader.cancel(entry.ticket):
                self.cache.cancel(entry)

    def prefetch(self, requests: list[PrefetchRequest]) -> None:
        """Read each requested expert into its pool unless held (then it is only protected); skipped when
        no room can be made. Protection lasts until the expert's layer has run."""
        if not requests:
            return
        self._reap()
        wanted, inputs = [], {}
        for req in requests:
            if not (0 <= req.layer < self.num_layers and 0 <= req.expert < self.num_experts):
                continue
            precision = req.precision or self.plan.expert_precision[req.layer][req.expert]
            if precision in self.stores:
                wanted.append((req.layer, req.expert, precision, self.slot_bytes[precision]))
                if req.inputs is not None and precision in self.neuron_layouts and self._neuron_on(req.inputs.shape[0]):
                    inputs[(req.layer, req.expert, precision)] = req.inputs
        admitted = self.cache.prefetch(wanted)
        for entry in admitted:
            x = inputs.pop((entry.layer, entry.expert, entry.precision), None)
            if x is not None:  # CORM: the header (W1) first; its neurons once it has landed
                arena = self.arenas[entry.pool]
                entry.slot = arena.take()
                entry.ticket, entry.neurons = self._header_job(entry.layer, self.stores[entry.precision], arena,
                                                               entry.slot, entry.expert, PREFETCH)
                self._neuron_pending.append((entry, x))
            else:
                self._read_into_entry(entry, PREFETCH)
                self.cache.count_read(entry.layer, self.stores[entry.precision].record_bytes)
            self._prefetching.append(entry)
        for (layer, expert, precision), x in inputs.items():  # held already: predict its neurons now
            entry = self.cache.find(layer, expert, precision)
            if entry is not None and not entry.in_flight:
                self._predict_rows(entry, x)

    def after_router(self, layer: int, router_input, indices) -> None:
        for expert in indices.flatten().tolist():  # chosen now: no prefetch for a later layer may evict them
            if 0 <= expert < self.num_experts:
                self.cache.protect(layer, expert)
        for predictor in self.predictors:
            self.prefetch(predictor.after_router(layer, router_input, indices))

    def after_last_layer(self, hidden) -> None:
        for predictor in self.predictors:
            self.prefetch(predictor.after_last_layer(hidden))

    # ---------------------------------------------------------------------------------- sequences
    def start_forward(self, past_length: int, tokens: int) -> None:
        """A model forward of ``tokens`` new tokens after ``past_length`` cached ones; 0 = a new sequence."""
        if past_length == 0:
            self.cache.reset()
            for p in [self.miss_policy, *self.predictors, *([self.routing] if self.routing else [])]:
                p.reset()
        self.cache.clock.token = past_length + max(tokens, 1) - 1

    def neuron_stats(self) -> dict | None:
        """Neuron-level loading: experts computed on the neuron path, their active and computed share, rows
        read, whole and partial reads, and the predictor's accuracy at expert and neuron level; None when off."""
        if not self._neuron_on(1):
            return None
        c = self.neuron_counts
        experts = next((p.stats() for p in self.predictors if p.name == "neuron_gates"), None)
        return c | {
            "theta": self.neuron.theta, "crossover": self.neuron.crossover, "compute": self.neuron.compute,
            "trust_prediction": self.neuron.trust_prediction,
            "active_share": c["active"] / c["neurons"] if c["neurons"] else None,
            "computed_share": c["computed"] / c["neurons"] if c["neurons"] else None,
            # of the neurons active at a predicted expert, the share the prediction named
            "neuron_recall": c["predicted_active"] / c["active_predicted"] if c["active_predicted"] else None,
            # of the neurons the prediction named, the share that were active
            "neuron_precision": c["predicted_active"] / c["predicted_rows"] if c["predicted_rows"] else None,
            "expert_prediction": experts,
        }

    def close(self) -> None:
        self.reader.close()
        for store in self.stores.values():
            store.close()


def renormalized(weights: torch.Tensor, chosen: torch.Tensor, skipped: list[int]) -> torch.Tensor:
    """weights [T, K] with the selections of ``skipped`` experts zeroed and each token's rest rescaled to the
    token's former total (a token whose every selection was skipped keeps zeros)."""
    gone = torch.isin(chosen, torch.tensor(skipped, device=chosen.device))
    kept = weights.masked_fill(gone, 0)
    total, rest = weights.sum(-1, keepdim=True), kept.sum(-1, keepdim=True)
    return torch.where(rest != 0, kept * (total / rest.where(rest != 0, torch.ones_like(rest))), kept)


class OffloadedExperts:
    """Attached to one experts module: its MoE layer position and the shared runtime."""

    def __init__(self, layer: int, runtime: ExpertRuntime) -> None:
        self.layer = layer
        self.runtime = runtime

    def forward(self, module, hidden, top_k_index, top_k_weights):
        return self.runtime.run_layer(self.layer, module, hidden, top_k_index, top_k_weights)


def _offloaded_forward(module, hidden_states, top_k_index, top_k_weights):
    return module._moeprep.forward(module, hidden_states, top_k_index, top_k_weights)


def _register_implementation() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _offloaded_forward)


@dataclass
class LoadedModel:
    """What ``load`` returns: the model, its tokenizer, and the offloading state behind ``stats()``."""

    model: torch.nn.Module
    tokenizer: object
    runtime: ExpertRuntime
    budget: dict
    routing: InstalledRouting | None = None
    _tokens: int = 0
    _seconds: float = 0.0
    _started: list = field(default_factory=list)

    @property
    def cache(self) -> ExpertCache:
        return self.runtime.cache

    @property
    def meter(self) -> MemoryMeter:
        return self.runtime.meter

    def stats(self) -> dict:
        rt = self.runtime
        per_layer = {}
        for layer, counters in enumerate(rt.cache.counters):
            times = rt.times[layer]
            per_layer[str(layer)] = dataclasses.asdict(counters) | dataclasses.asdict(times)
        total = {k: sum(s[k] for s in per_layer.values()) for k in next(iter(per_layer.values()))}
        hits, misses = total["hits"], total["misses"]
        return {
            "layers": per_layer,
            **total,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "tokens": self._tokens,
            "forward_seconds": self._seconds,
            "tokens_per_second": self._tokens / self._seconds if self._seconds else None,
            "peak_cache_bytes": rt.peak_cache_bytes,
            # cache slots in use + read buffers in use, at the worst moment (never above the budget's
            # expert share: the caches' capacities plus the read buffers)
            "peak_expert_bytes": rt.meter.peak,
            "budget": self.budget,
            "direct_io": all(s.direct_io for s in rt.stores.values()),
            # issued: prefetch reads started; used / wasted / cancelled: what became of them (the rest are
            # still pending); saved_seconds: read time of used prefetches that no demand waited for
            "prefetch": {"predictors": [p.name for p in rt.predictors], "issued": total["prefetches"],
                         "used": total["prefetch_used"], "wasted": total["prefetch_wasted"],
                         "cancelled": total["prefetch_cancelled"], "saved_seconds": rt.prefetch_saved_seconds},
            # what the routing and miss policies decided (AdaptiveGating: single-expert decisions and expert
            # runs saved; DynamicPrecision: misses read high, low, skipped); None for the defaults
            "routing": self.routing.policy.stats() if self.routing and hasattr(self.routing.policy, "stats") else None,
            "miss_policy": rt.miss_policy.stats() if hasattr(rt.miss_policy, "stats") else None,
            "neuron": rt.neuron_stats(),
            # the compute path (loader/kernels.py): decodes of a quantized record (once per miss when decoded
            # copies are held, on every use when packed) and the seconds they took
            "compute": {"expert_dtype": self.budget["expert_dtype"], "decodes": rt.decodes,
                        "decode_seconds": rt.decode_seconds, "cpu_misses": rt.cpu_misses,
                        "cpu_computed": rt.cpu_computed,
                        "miss_costs": dataclasses.asdict(rt.miss_costs) if rt.miss_costs else None},
        }

    def close(self) -> None:
        self.runtime.close()


def _rebuild_meta_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies) are computed in __init__; on meta they are empty.

    Rebuild each module that holds one from its config, on the target device, and take its buffers.
    """
    for name, module in model.named_modules():
        metas = [b for b, t in module.named_buffers(recurse=False) if t.is_meta]
        if not metas:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise LoaderError(f"cannot materialise buffers {metas} of {name}: module has no config")
        with torch.device(device):
            fresh = type(module)(config)
        for buf in metas:
            module.register_buffer(buf, getattr(fresh, buf), persistent=False)


def _submodule(model: torch.nn.Module, path: str, what: str) -> torch.nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ArtifactError(f"the manifest names {what} module {path!r}, which the model does not have; "
                            "prepare the artifact again") from None


def _named(registry: dict, spec: PolicySpec, what: str, default: type):
    if spec.name in ("topk", "plan", "none") and not spec.params:
        return default()
    if spec.name not in registry:
        raise LoaderError(f"the plan names {what} {spec.name!r}, which this loader does not know "
                          f"(known: {sorted(registry) or 'none'}); upgrade the loader or prepare the artifact again")
    try:
        return registry[spec.name](**spec.params)
    except TypeError as e:
        raise LoaderError(f"the plan's {what} {spec.name!r}: {e}; prepare the artifact again") from None


def slot_bytes(store: ExpertStore) -> int:
    """Memory one read record takes: its 4 KiB-aligned stride when reads are O_DIRECT (which reads
    whole aligned blocks), else the record itself rounded up to 64 bytes."""
    return store.stride if store.direct_io else -(-store.record_bytes // 64) * 64


def held_bytes(store: ExpertStore, decoded) -> int:
    """Memory one cached expert takes: its record's slot, then its decoded copy when it has one (kept at the
    record's alignment so every slot of the pool starts aligned)."""
    align = 4096 if store.direct_io else 64
    return slot_bytes(store) + (-(-decoded.nbytes // align) * align if decoded is not None else 0)


def decoded_layouts(manifest, expert_dtype: str, device: torch.device) -> dict:
    """Per store: how its cached experts are held decoded (None: computed from the record). Neuron-layout
    stores stay packed: their rows are read and decoded a few at a time."""
    try:
        check_expert_dtype(expert_dtype)
    except KernelError as e:
        raise LoaderError(str(e)) from None
    out = {}
    for p, s in manifest.raw["stores"].items():
        layout = RecordLayout.from_json(s["layout"])
        out[p] = None if s.get("neuron") is not None else held_layout(expert_dtype, layout, device)
    return out


def _dense_bytes(path: Path) -> int:
    """Bytes of the tensors in a safetensors file: the file minus its 8-byte length and JSON header."""
    with open(path, "rb") as f:
        head = f.read(8)
    if len(head) < 8:
        raise ArtifactError(f"{path.name} is truncated; copy the artifact again or rerun `moeprep prepare`")
    return path.stat().st_size - 8 - int.from_bytes(head, "little")


def artifact_sizes(manifest, stores: dict[str, ExpertStore], device: torch.device,
                   decoded: dict | None = None) -> ModelSizes:
    """The sizes the budget arithmetic needs. A cached expert counts the memory its slot takes (record and
    decoded copy, ``held_bytes``); the dense weights count their tensor bytes, plus a host-mode store's
    whole file when the budget is RAM (CPU device)."""
    moe = manifest.raw["moe"]
    held = _dense_bytes(manifest.path("dense.safetensors"))
    if device.type == "cpu":
        held += sum(s.host_bytes for s in stores.values())
    return ModelSizes(len(moe["layers"]), moe["num_experts"], moe["top_k"], held,
                      int(moe["source_expert_bytes"]),
                      {p: held_bytes(s, (decoded or {}).get(p)) for p, s in stores.items()},
                      {p: slot_bytes(s) for p, s in stores.items()})


@dataclass(frozen=True)
class CacheLayout:
    """What ``load`` builds for a budget: the plan, the sizes, the byte capacities, and per precision the
    bytes a record takes in memory (its slot) and the bytes a read fetches."""

    plan: Plan
    sizes: ModelSizes
    capacities: Capacities
    slot_bytes: dict
    record_bytes: dict


def _capacities(plan: Plan, sizes: ModelSizes, memory_budget, host_bytes: int, device: torch.device) -> Capacities:
    """``capacities`` with the loader's error: a host-mode store on a CPU is named as what used the budget."""
    try:
        return capacities(plan, memory_budget, sizes)
    except PlanError as e:
        extra = (f" (store='host' holds the whole expert store, {host_bytes:,} bytes, in RAM inside the budget; "
                 "use store='disk' for a small budget)") if host_bytes and device.type == "cpu" else ""
        raise LoaderError(f"{e}{extra}") from None


NO_BUDGET = object()  # _held_form without a budget: sizes only


def _held_form(manifest, stores: dict[str, ExpertStore], plan: Plan, memory_budget, device: torch.device,
               expert_dtype: str, smallest: bool = False) -> tuple[dict, ModelSizes, Capacities | None]:
    """(decoded layouts, sizes, capacities for ``memory_budget``; None with ``NO_BUDGET``). ``auto`` falls back
    to packed records when the budget cannot hold one decoded expert per eviction group: a small budget
    still loads, decoding per use. ``smallest``: the packed form's sizes for ``auto`` (its minimum budget)."""
    host = sum(s.host_bytes for s in stores.values())
    decoded = decoded_layouts(manifest, expert_dtype, device)
    forms = [decoded]
    if expert_dtype == "auto" and any(d is not None for d in decoded.values()):
        forms.append(dict.fromkeys(decoded))
    if smallest:
        forms = forms[-1:]
    for i, form in enumerate(forms):
        sizes = artifact_sizes(manifest, stores, device, form)
        if memory_budget is NO_BUDGET:
            return form, sizes, None
        try:
            return form, sizes, _capacities(plan, sizes, memory_budget, host, device)
        except LoaderError:
            if i == len(forms) - 1:
                raise
    raise AssertionError("unreachable")


def _budget_inputs(artifact: str | Path, store: str, plan: Plan | None, device: torch.device,
                   expert_dtype: str = "auto", memory_budget=NO_BUDGET, smallest: bool = False,
                   ) -> tuple[Plan, ModelSizes, dict, Capacities | None]:
    """(plan, sizes, record bytes per precision, capacities or None) as ``load`` sees them, without the model."""
    manifest = read_manifest(artifact)
    plan = plan or read_plan(manifest.root)
    stores = {p: ExpertStore(manifest.path(s.file), p, mode=store) for p, s in manifest.stores.items()}
    try:
        _, sizes, caps = _held_form(manifest, stores, plan, memory_budget, device, expert_dtype, smallest)
        return plan, sizes, {p: s.record_bytes for p, s in stores.items()}, caps
    finally:
        for s in stores.values():
            s.close()


def cache_layout(artifact: str | Path, memory_budget=None, store: str = "disk", plan: Plan | None = None,
                 device: str = "cpu", expert_dtype: str = "auto") -> CacheLayout:
    """The cache ``load(artifact, memory_budget, store=store, plan=plan, device=device, expert_dtype=...)``
    builds, without building the model (the simulator replays traces through exactly this)."""
    dev = torch.device(device)
    plan, sizes, record_bytes, caps = _budget_inputs(artifact, store, plan, dev, expert_dtype, memory_budget)
    # the operating point the budget picked (its pools' shares and splits; names and groups are the plan's)
    return CacheLayout(plan.for_budget(caps.limit_bytes), sizes, caps, dict(sizes.record_bytes), record_bytes)


def minimum_budget(artifact: str | Path, store: str = "disk", plan: Plan | None = None, device: str = "cpu",
                   expert_dtype: str = "auto") -> int:
    """The smallest memory budget in bytes that ``load(artifact, ...)`` accepts (dense weights, the read
    buffers, and one record per eviction group); with ``store='host'`` on a CPU the store counts too. With
    ``auto`` it is the packed form's: below the decoded form's minimum, ``auto`` decodes per use."""
    plan, sizes, _, _ = _budget_inputs(artifact, store, plan, torch.device(device), expert_dtype, smallest=True)
    return minimum_budget_of(plan, sizes)


def budget_bytes(artifact: str | Path, memory_budget, store: str = "disk", plan: Plan | None = None,
                 device: str = "cpu") -> int:
    """What ``memory_budget`` means in bytes for ``artifact`` (the bench gives accelerate the same number)."""
    plan, sizes, _, _ = _budget_inputs(artifact, store, plan, torch.device(device), "packed")
    return int(min(resolve_budget(memory_budget, plan, sizes), 2**62))


def load(artifact: str | Path, device: str = "cpu", memory_budget=None, store: str = "disk",
         policy: str | None = None, workers: int = 2, routing: RoutingPolicy | None = None,
         predictors: list[Predictor] | None = None, miss_policy: MissPolicy | None = None,
         plan: Plan | None = None, neuron: NeuronConfig | bool | None = None,
         expert_dtype: str = "auto", cpu_misses: str = "auto") -> LoadedModel:
    """Open ``artifact`` and return a runnable model with its experts offloaded.

    memory_budget: None (the plan's default budget), bytes, a size string ("1.5GiB"), a percentage
    ("25%": the dense weights plus that share of the source model's expert bytes), or "unlimited".
    policy: an eviction policy name overriding the plan's. routing / predictors / miss_policy: objects
    overriding the plan's (``loader.routing``, ``loader.predict``); predictors may also be names
    (``loader.predict.PREDICTORS``), which take the plan's knobs for that name, and ``[]`` turns them
    off. plan: a whole ``Plan`` instead of the artifact's ``plan.json``. neuron: neuron-level loading
    (``loader/neuron.py``) on with the plan's knobs (True), off (False), these knobs (a ``NeuronConfig``),
    or as the plan says (None); it needs an artifact whose stores are in the neuron layout. expert_dtype:
    how a cached quantized expert is held (``loader/kernels.py``): "auto" (decoded, in the dtype measured
    fastest here), "float32", "bfloat16", "float16" (decoded in that dtype) or "packed" (decoded per use).
    cpu_misses: on a CUDA device with ``store="host"``, a decode step's missed expert is computed on the CPU
    from the host record instead of copied: "auto" (where the costs measured at load say the CPU is
    faster), "always" or "never"; elsewhere it has no effect ("always" is refused).

    ``prepare`` publishes a new artifact by swapping a symlink and then deletes the old version; a load
    that was reading the old version when it went is retried once on the new one.
    """
    args = dict(device=device, memory_budget=memory_budget, store=store, policy=policy, workers=workers,
                routing=routing, predictors=predictors, miss_policy=miss_policy, plan=plan, neuron=neuron,
                expert_dtype=expert_dtype, cpu_misses=cpu_misses)
    resolved = Path(artifact).resolve()
    try:
        return _load(artifact, **args)
    except (ArtifactError, OSError):
        if Path(artifact).resolve() == resolved:
            raise
    return _load(artifact, **args)  # the artifact was swapped under us: once more, on the new version


def _neuron_config(plan: Plan, neuron, pairings: dict) -> NeuronConfig | None:
    """The neuron-level loading the load runs with (see ``load``), checked against the artifact's stores."""
    if neuron is False or (neuron is None and plan.neuron.name == "off"):
        return None
    if isinstance(neuron, NeuronConfig):
        cfg = neuron
    else:
        if plan.neuron.name not in ("off", "sparse"):
            raise LoaderError(f"the plan's neuron entry {plan.neuron.name!r} is unknown (known: off, sparse); "
                              "upgrade the loader or prepare the artifact again")
        try:
            cfg = NeuronConfig.from_params(plan.neuron.params)
        except (NeuronError, TypeError) as e:
            raise LoaderError(f"{e}; prepare the artifact again") from None
    if not pairings:
        raise LoaderError("neuron-level loading needs an artifact whose expert stores are in the neuron layout; "
                          "prepare it with `--set neuron.layout=neuron` (or leave neuron loading off)")
    return cfg


def _load(artifact, device, memory_budget, store, policy, workers, routing, predictors, miss_policy,
          plan, neuron, expert_dtype, cpu_misses) -> LoadedModel:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    manifest = open_artifact(artifact)
    artifact = manifest.root
    dev = parse_device(device)
    if cpu_misses not in CPU_MISSES:
        raise LoaderError(f"cpu_misses {cpu_misses!r} unknown; use one of {', '.join(CPU_MISSES)}")
    if cpu_misses == "always" and (dev.type != "cuda" or store != "host"):
        raise LoaderError("cpu_misses='always' computes GPU misses on the CPU from a store held in host RAM; it needs "
                          "device='cuda' and store='host' (or leave it at 'auto')")
    plan = plan or manifest.plan
    if policy is not None:
        plan = dataclasses.replace(plan, eviction=PolicySpec(policy))
    try:
        policy_factory(plan.eviction.name, plan.eviction.params)
    except ValueError as e:
        raise LoaderError(str(e)) from None
    moe = manifest.raw["moe"]
    layers = moe["layers"]
    chosen = _predictors(plan, predictors)

    dense_path = manifest.path("dense.safetensors")
    stores = {p: ExpertStore(manifest.path(s.file), p, mode=store,
                             check=lambda key, data, p=p: check_record(manifest, p, key, data))
              for p, s in manifest.stores.items()}
    host_bytes = sum(s.host_bytes for s in stores.values())
    try:
        decoded, sizes, caps = _held_form(manifest, stores, plan, memory_budget, dev, expert_dtype)
    except LoaderError:
        for s in stores.values():
            s.close()
        raise
    layouts = {p: RecordLayout.from_json(s["layout"]) for p, s in manifest.raw["stores"].items()}
    pairings = {p: s.neuron["pairing"] for p, s in manifest.stores.items() if s.neuron is not None}
    try:
        neuron_cfg = _neuron_config(plan, neuron, pairings)
    except LoaderError:
        for s in stores.values():
            s.close()
        raise

    config = AutoConfig.from_pretrained(artifact)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, moe["dtype"]))
    try:
        check_model(manifest, model)
    except ArtifactError:
        for s in stores.values():
            s.close()
        raise
    dense = load_file(dense_path, device=str(dev))
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    expert_params = set(moe["expert_params"])
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.get_text_config().tie_word_embeddings else set()
    other = [k for k in missing if k not in expert_params and k not in tied]
    if unexpected or other:
        raise ArtifactError(f"dense.safetensors does not fit the model: missing {other[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    _rebuild_meta_buffers(model, dev)

    runtime = ExpertRuntime(
        plan, caps, stores, layouts, moe["top_k"], dev, workers,
        miss_policy if miss_policy is not None else _named(MISS_POLICIES, plan.miss, "miss policy", MissPolicy),
        chosen,
        list(layers), neuron_cfg, pairings, decoded)
    for position, path in enumerate(moe["experts_modules"]):
        module = _submodule(model, path, "experts")
        if getattr(module, "num_experts", moe["num_experts"]) != moe["num_experts"]:
            raise ArtifactError(f"the manifest says {moe['num_experts']} experts but {path} has {module.num_experts}; "
                                "the manifest was edited or the artifact is corrupt, prepare it again")
        for name in [n for n, p in module.named_parameters(recurse=False) if p.is_meta]:
            del module._parameters[name]  # never materialised: experts live in the store and the cache
        module._moeprep = OffloadedExperts(position, runtime)
        runtime.modules.append(module)
    if dev.type == "cuda" and store == "host" and cpu_misses != "never":
        runtime.cpu_misses = cpu_misses
        if cpu_misses == "auto":
            records = {p: s.host_record(runtime.key(0, 0)) for p, s in stores.items() if p not in pairings}
            runtime.miss_costs = measure_miss_costs(runtime.modules[0], records, layouts, runtime.decoded, dev,
                                                    config.get_text_config().hidden_size)
            if not any(runtime.miss_costs.prefer_cpu(p) for p in records):
                runtime.cpu_misses = "never"  # copying wins everywhere: keep the GPU path without the check
    _register_implementation()
    model.config._experts_implementation = IMPLEMENTATION
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ArtifactError(f"weights missing from the artifact: {leftover[:5]}")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    budget = caps.to_json() | {"dense_bytes": _dense_bytes(dense_path), "requested": memory_budget if memory_budget is not None else plan.default_budget,
                               "minimum_bytes": minimum_budget_of(plan, sizes), "host_store_bytes": host_bytes,
                               "record_bytes": {p: s.record_bytes for p, s in stores.items()},
                               "slot_bytes": runtime.slot_bytes, "eviction": plan.eviction.name,
                               "expert_dtype": {p: d.name if d is not None else "record" for p, d in decoded.items()},
                               "cache_slots": {name: a.count for name, a in runtime.arenas.items()},
                               "operating_point": (point.budget_bytes if (point := plan.point_for(caps.limit_bytes)) else None)}
    loaded = LoadedModel(model, tokenizer, runtime, budget)
    policy = routing if routing is not None else _named(ROUTING_POLICIES, plan.routing, "routing policy", RoutingPolicy)
    trusted = _trusted_prediction(runtime, moe)
    loaded.routing = install_routing(
        model, moe["experts_modules"], ChainedRouting(policy, trusted) if trusted is not None else policy,
        router_paths=moe.get("router_modules"), view=runtime.cache.view,
        after_router=runtime.after_router if runtime.predictors else None)
    runtime.routing = loaded.routing.policy
    if runtime.predictors:
        routers = [_submodule(model, path, "router") for path in moe["router_modules"]]
        try:
            runtime.bind_predictors([(r.weight, getattr(r, "bias", None)) for r in routers], _predictor_tensors(manifest))
        except LoaderError:
            runtime.close()
            raise
        # the LM head's input is the final-normed last hidden state, what the first-layer gate was trained on
        model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: runtime.after_last_layer(args[0]))
    _attach_counters(loaded)
    return loaded


def _trusted_prediction(runtime: ExpertRuntime, moe: dict) -> TrustedPrediction | None:
    """CORM's expert-level trust: with ``trust_prediction`` and the neuron_gates predictor, the layers compute
    the predicted experts (``loader.neuron.TrustedPrediction``); None otherwise."""
    gates = next((p for p in runtime.predictors if p.name == "neuron_gates"), None)
    if runtime.neuron is None or not runtime.neuron.trust_prediction or gates is None:
        return None
    if moe.get("routing_weights") is None:
        runtime.close()
        raise LoaderError("trust_prediction weighs the predicted experts with the router's weight function, which "
                          "this artifact's manifest does not record (moe.routing_weights); prepare it again")
    return TrustedPrediction(gates, moe["routing_weights"], runtime._neuron_on)


def _predictors(plan: Plan, given: list | None) -> list[Predictor]:
    """The predictors to run: ``given`` (objects, or names taking the plan's knobs for that name, else the
    defaults), or the plan's own."""
    knobs = {spec.name: spec.params for spec in plan.predictors}
    chosen = given if given is not None else [spec.name for spec in plan.predictors]
    out = []
    for p in chosen:
        if isinstance(p, Predictor):
            out.append(p)
            continue
        try:
            out.append(make_predictor(p, knobs.get(p)))
        except PredictorError as e:
            raise LoaderError(f"{e}; upgrade the loader or prepare the artifact again" if p in knobs else str(e)) from None
    return out


def _predictor_tensors(manifest) -> dict:
    """The artifact's ``predictors.safetensors`` ({} when it has none; the predictors that need it say so)."""
    from safetensors.torch import load_file

    if PREDICTORS_FILE not in manifest.raw["files"]:
        return {}
    return load_file(str(manifest.path(PREDICTORS_FILE)))


def _past_length(args, kwargs) -> int:
    """Tokens already in the KV cache (0: a new sequence). transformers 5.24 passes the cache to the model's
    forward as ``cache``, earlier versions as ``past_key_values``: both are read."""
    past = kwargs.get("past_key_values")
    if past is None:
        past = kwargs.get("cache")
    if past is None:
        return 0
    try:
        return int(past.get_seq_length())
    except (AttributeError, TypeError):
        return 0


def _attach_counters(loaded: LoadedModel) -> None:
    """On every forward of the model: start the sequence clock (reset on a new sequence), count tokens
    and forward time."""

    def before(_module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        tokens = ids.shape[-1] if ids is not None else 1
        loaded.runtime.start_forward(_past_length(args, kwargs), tokens)
        loaded._started.append(time.perf_counter())

    def after(_module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        loaded._seconds += time.perf_counter() - loaded._started.pop()
        if ids is not None:
            loaded._tokens += ids.numel()

    loaded.model.register_forward_pre_hook(before, with_kwargs=True)
    loaded.model.register_forward_hook(after, with_kwargs=True)
