"""Run an artifact: dense weights resident, experts streamed from the stores through the expert cache.

``load()`` builds the Hugging Face model skeleton on the meta device, assigns the dense weights, drops
the (never materialised) fused expert parameters, and plugs an offloaded experts forward into
transformers through its experts-implementation registry (``ALL_EXPERTS_FUNCTIONS``), so every
architecture whose experts module uses ``@use_experts_implementation`` works without patching classes.

The rooms of the loader: the plan schema (``plan.py``), every size and budget (``budget.py``), the cache
core and its policies (``cache.py``, ``policies.py``), the layer schedule shared with the simulator
(``schedule.py``), held forms (``forms.py``), stores and reader threads (``store.py``), the engine and its
whole-expert step (``step.py``), neuron-level loading (``neuron.py``), routing and miss policies
(``routing.py``), predictors (``predict.py``). Everything ``_load`` opens is registered on one
``ExitStack``, so an error at any step closes the stores and stops the reader threads.

An expert computes exactly as transformers' eager experts loop does, using the module's own gate
function. Shapes: see the legend in ``loader/__init__.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loader.artifact import open_artifact
from loader.binding import check_model, check_predictors, read_predictor_tensors, read_tokenizer
from loader.budget import (  # noqa: F401
    budget_bytes,
    cache_layout,
    dense_bytes,
    held_layout,
    lowest_budget,
    minimum_budget,
    minimum_bytes,
)
from loader.cache import ExpertCache, MemoryMeter
from loader.codec import RecordLayout
from loader.dense import hold_dense_int8
from loader.engine import EngineSetup, ExpertEngine, measure_miss_costs
from loader.errors import BudgetError, LoaderError
from loader.format import DENSE, ArtifactError, Manifest, MoeSection, resolve_artifact
from loader.hashing import check_record, read_block_table
from loader.io import hold_for_reading
from loader.layer import renormalized  # noqa: F401 (part of the loader's API)
from loader.lean import install_lean
from loader.memory import auto_budget, is_auto
from loader.neuron import NeuronConfig, TrustedPrediction, neuron_config
from loader.options import (  # noqa: F401 (DEFAULT_WORKERS, MAX_WORKERS, max_threads, parse_device: the loader's API)
    DEFAULT_WORKERS,
    MAX_WORKERS,
    LoadOptions,
    compute_threads,
    max_threads,
    parse_device,
    reader_workers,
)
from loader.plan import Plan, PolicySpec
from loader.policies import policy_factory
from loader.predict import Predictor, PredictorError, make_predictor
from loader.routing import (
    ChainedRouting,
    InstalledRouting,
    MissPolicy,
    RoutingPolicy,
    install_routing,
    plan_miss,
    plan_routing,
)
from loader.schedule import CpuMissRule
from loader.store import ExpertStore
from loader.transfer import link_for
from loader.tuning import Applied, apply_tuning, read_tuning

IMPLEMENTATION = "moeprep_offload"


def process_rss_bytes() -> int | None:
    """This process's resident set size now (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class OffloadedExperts:
    """Attached to one experts module: its MoE layer position and the shared runtime."""

    def __init__(self, layer: int, runtime: ExpertEngine) -> None:
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
    runtime: ExpertEngine
    budget: dict
    routing: InstalledRouting | None = None
    _tokens: int = 0
    _seconds: float = 0.0
    _started: list = field(default_factory=list)
    _threads_before: int | None = None  # torch's threads before ``load(threads=...)`` changed them
    last_prefill: object = None  # the last ``prefill()``'s ``loader.prefill.PrefillResult``

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
            "peak_cache_bytes": rt.cache.peak_bytes,
            # cache slots in use + read buffers in use + the staging buffers, at the worst moment (never above
            # the budget's expert share: the caches' capacities plus the read and staging buffers)
            "peak_expert_bytes": rt.meter.peak,
            "budget": self.budget,
            # the device file's decisions this load runs with (``moeload tune``; loader/tuning.py)
            "tuning": self.budget.get("tuning"),
            # the whole process in RAM now, beside the budget: the budget counts the dense weights and every byte of
            # expert data held; the interpreter, torch, the KV cache and activations are outside it
            "process_rss_bytes": process_rss_bytes(),
            "direct_io": all(s.direct_io for s in rt.stores.values()),
            # checking the 4 KiB blocks of partial (neuron) reads against their hashes, on the reader threads
            "block_check_seconds": sum(s.check_seconds for s in rt.stores.values()),
            # issued: prefetch reads started; used / wasted / cancelled: what became of them (the rest are
            # still pending); saved_seconds: read time of used prefetches that no demand waited for
            "prefetch": {"predictors": [p.name for p in rt.predictors], "issued": total["prefetches"],
                         "used": total["prefetch_used"], "wasted": total["prefetch_wasted"],
                         "cancelled": total["prefetch_cancelled"],
                         "saved_seconds": rt.counters.prefetch_saved_seconds},
            # what the routing and miss policies decided (AdaptiveGating: single-expert decisions and expert
            # runs saved; DynamicPrecision: misses read high, low, skipped); None for the defaults
            "routing": self.routing.policy.stats() if self.routing and hasattr(self.routing.policy, "stats") else None,
            "miss_policy": rt.miss_policy.stats() if hasattr(rt.miss_policy, "stats") else None,
            "neuron": rt.neuron.stats(rt.predictors) if rt.neuron is not None else None,
            # the compute path (loader/forms.py): forms made from records (once per read, on the reader threads)
            # plus records decoded per use (the record form of a quantized store), and the reader time spent
            # making forms
            "compute": {"expert_dtype": self.budget["expert_dtype"], "torch_threads": torch.get_num_threads(),
                        "decodes": rt.counters.decodes,
                        "decode_seconds": rt.counters.make_seconds, "cpu_misses": rt.cpu_misses,
                        "cpu_computed": rt.counters.cpu_computed,
                        "miss_costs": rt.miss_costs.to_json() if rt.miss_costs else None},
            # whole records read from the disk, and the reader threads' seconds per part of a miss: the read call,
            # checking its xxh3_64, making its held form (0 where the record is stored in the form's layout)
            "reads": {"records": sum(s.records_read for s in rt.stores.values()),
                      "read_seconds": sum(s.read_seconds for s in rt.stores.values()),
                      "check_seconds": sum(s.record_check_seconds for s in rt.stores.values()),
                      "make_seconds": rt.counters.make_seconds, "forms_made": rt.counters.decodes},
            # decode steps: MoE layer calls and the seconds in them, in expert compute, waiting for reads, and
            # the rest (the loader's own overhead)
            "decode_timing": rt.counters.timing.to_json(),
            # prompt chunks (forwards of more than one token): their MoE layer steps, reads and prefill forms; and
            # the last ``prefill()``: time to the first token's logits, tokens/s, chunks
            "prefill_timing": rt.counters.prefill.to_json(),
            "prefill": self.last_prefill.to_json() if self.last_prefill is not None else None,
        }

    def prefill(self, ids, chunk: int | None = None, all_logits: bool = False):
        """Run a prompt in chunks (``loader.prefill.prefill``): its logits, KV cache and time to first token."""
        from loader.prefill import prefill

        return prefill(self, ids, chunk, all_logits)

    def close(self) -> None:
        self.runtime.close()
        if getattr(self, "_held", None) is not None:  # let go of the artifact version (``hold_for_reading``)
            os.close(self._held)
            self._held = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None


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


def load(artifact: str | Path, device: str = "cpu", memory_budget=None, store: str = "disk",
         policy: str | None = None, workers: int | str = "auto", routing: RoutingPolicy | None = None,
         predictors: list[Predictor] | None = None, miss_policy: MissPolicy | None = None,
         plan: Plan | None = None, neuron: NeuronConfig | bool | None = None,
         expert_dtype: str = "auto", cpu_misses: str = "auto", threads="auto",
         replay: RoutingPolicy | None = None, ignore_device_file: bool = False, dense: str | None = None) -> LoadedModel:
    """Open ``artifact`` and return a runnable model with its experts offloaded.

    memory_budget: None (the plan's default budget), bytes, a size string ("1.5GiB"), a percentage
    ("25%": the dense weights plus that share of the source model's expert bytes), "unlimited", or "auto" (the
    memory free for this process less a margin: ``loader/memory.py``; ``budget["auto"]`` says what it chose).
    policy: an eviction policy name overriding the plan's. routing / predictors / miss_policy: objects
    overriding the plan's (``loader.routing``, ``loader.predict``); predictors may also be names
    (``loader.predict.PREDICTORS``), which take the plan's knobs for that name, and ``[]`` turns them
    off. replay: recorded decisions (``loader.routing.ReplayRouting``) taken before the routing policy, which
    then decides on them as on the router's own (the bench replays the real Mixtral traces through the plan's
    adaptive gating). plan: a whole ``Plan`` instead of the artifact's ``plan.json``. neuron: neuron-level loading
    (``loader/neuron.py``) on with the plan's knobs (True), off (False), these knobs (a ``NeuronConfig``),
    or as the plan says (None); it needs an artifact whose stores are in the neuron layout. expert_dtype:
    the held form of a cached expert (``loader/forms.py``): "auto" (fixed before the run: the environment's
    pin, the plan's ``forms``, else int4pack on a CPU where it fits and bfloat16 otherwise; plain matrices
    as stored), "float32", "bfloat16", "float16" (decoded in that dtype), "int4pack", or "packed" (the
    record, decoded per use). workers: reader threads, the reads in flight; each makes the held forms of the
    reads it serves. "auto": the plan's ``read_depth`` (the depth ``moeprep profile-device`` measured best on
    the planned device), else ``DEFAULT_WORKERS``.
    threads: torch's intra-op threads while the model is loaded (restored by ``close``): None leaves them,
    an int sets them; "auto" (the default) runs each decode step on ``compute_threads`` (on a CPU, the cores the
    reader threads leave free) and a longer forward (a prompt) on torch's own count.
    cpu_misses: on a CUDA device with ``store="host"``, a decode step's missed expert is computed on the CPU
    from the host record instead of copied: "auto" (where the costs measured at load say the CPU is
    faster), "always" or "never"; elsewhere it has no effect ("always" is refused).

    store: "disk" (each miss read from the file) or "host" (the stores held in host RAM).
    dense: the dense weights' held form (``loader/dense.py``): None (the plan's ``dense``), "int8" (attention, shared
    experts and the LM head computed by the compiled kernels from int8 codes; on a CPU with the kernels, else float)
    or "float" (as stored).

    The device file (``tuning.json``, written by ``moeload tune`` on a device: ``loader/tuning.py``): where the artifact
    has one and no ``plan`` is given, the plan runs without the techniques it switched off on this device kind at the
    nearest budget (``budget["tuning"]`` and ``stats()["tuning"]`` say which); ``ignore_device_file`` runs the plan
    as prepared. A damaged device file is refused either way.

    The options are checked first, before the artifact is opened (``loader.options.LoadOptions``: a bad one is a
    LoaderError naming it). ``prepare`` publishes a new artifact by swapping a symlink and then deletes the old
    version; a load that was reading the old version when it went is retried once on the new one.
    """
    options = LoadOptions(device, memory_budget, store, policy, workers, routing, predictors, miss_policy, plan, neuron,
                          expert_dtype, cpu_misses, threads, replay, ignore_device_file, dense)
    resolved = Path(artifact).resolve()
    try:
        return _load(artifact, options)
    except (ArtifactError, OSError):
        if Path(artifact).resolve() == resolved:
            raise
    return _load(artifact, options)  # the artifact was swapped under us: once more, on the new version


def neuron_pairings(manifest) -> dict:
    """Precision -> pairing of each of the artifact's neuron-layout stores (empty: no neuron layout)."""
    return {p: s.neuron["pairing"] for p, s in manifest.stores.items() if s.neuron is not None}


def check_bindings(manifest) -> None:
    """Every check a plain ``load(artifact)`` runs that needs no weights, each from its one home, without building
    the model: the plan's routing and miss policies (names, parameters, adaptive gating's sensitivities per layer),
    its neuron entry against the stores, its predictors against the routers and the predictor file, and the
    tokenizer. ``verify`` calls it on the checked manifest (``open_artifact``'s, with its plan; the eviction policy,
    ``default_budget`` and the plan's value bounds are ``Plan.from_json``'s), so it refuses what ``load`` would, with
    the same message. Not here: whether ``default_budget`` covers the minimum budget, which depends on the device and
    the held forms of a load (``capacities`` refuses it there, naming the plan's default_budget)."""
    plan = manifest.plan
    plan_routing(plan)
    plan_miss(plan)
    neuron_config(plan, None, neuron_pairings(manifest))
    check_predictors(manifest, plan)
    read_tokenizer(manifest.root)
    read_tuning(manifest)  # the device file, when there is one: sealed and naming only techniques the plan runs


def _load(artifact, options: LoadOptions) -> LoadedModel:
    """``load`` once. Everything opened is registered on one ExitStack: on any error it is all closed."""
    with contextlib.ExitStack() as cleanup:
        loaded = _build(artifact, options, cleanup)
        cleanup.pop_all()  # success: the LoadedModel owns them now (``LoadedModel.close``)
        return loaded


@dataclass(frozen=True)
class _Resolved:
    """What the options come to for one artifact: the plan it runs, its reader threads, the budget asked for (bytes
    where "auto" chose them), the torch threads, and the policy and predictor objects."""

    device: torch.device
    link: object  # loader.transfer.Link: how bytes reach the device
    plan: Plan
    workers: int
    memory_budget: object
    auto: object  # loader.memory's choice for memory_budget="auto", else None
    decode_threads: int | None  # threads="auto": decode steps on the cores the readers leave free
    wanted_threads: int | None  # threads=N
    predictors: list
    routing: RoutingPolicy
    miss_policy: MissPolicy
    tuning: Applied | None  # the device file's decisions (None: a plan was given)


def _build(artifact, options: LoadOptions, cleanup: contextlib.ExitStack) -> LoadedModel:
    """The steps of a load, in order; each registers what it opens on ``cleanup``."""
    manifest, held = _open_checked(artifact, cleanup)
    run = _resolve(manifest, options)
    stores = _open_stores(manifest, options.store, run.device, cleanup)
    layout = _size_budget(manifest, stores, run, options.expert_dtype)
    model, config = _build_model(manifest, run.device)
    dense = _hold_dense(model, manifest, options.dense or run.plan.dense, run.device)
    engine = _make_engine(manifest, options.neuron, run, layout, stores, cleanup)
    _attach_experts(model, manifest.moe, engine)
    _plan_cpu_misses(engine, stores, options, run, config)
    _finish_model(model)
    budget = _budget_report(manifest, options, run, layout, engine, stores) | {"dense": dense}
    loaded = LoadedModel(model, read_tokenizer(manifest.root), engine, budget)
    loaded._held = held
    _set_threads(loaded, run)
    _attach_routing(loaded, manifest, run, options.replay)
    _attach_counters(loaded)
    budget["decode_path"] = install_lean(model, run.device)
    return loaded


def _open_checked(artifact, cleanup: contextlib.ExitStack):
    """The artifact's version held for reading (a prepare that swaps in a new version removes this one only after
    close) and its manifest, every load-time check run (``loader.artifact.open_artifact``)."""
    root = resolve_artifact(artifact)
    held = hold_for_reading(root)
    cleanup.callback(os.close, held)
    return open_artifact(root), held


def _resolve(manifest: Manifest, options: LoadOptions) -> _Resolved:
    """The options against this artifact: the plan (the artifact's, the caller's, the eviction policy overridden),
    the reader threads, the "auto" budget and threads, the routing, miss and predictor objects."""
    dev = options.torch_device
    link = link_for(dev)
    options.check_cpu_misses(link)
    plan = options.plan or manifest.plan
    memory_budget, auto = options.memory_budget, None
    if is_auto(memory_budget):
        auto = auto_budget(str(dev))
        memory_budget = auto.budget_bytes
    applied = None
    if options.plan is None:  # the device file's decisions for this device kind and budget (``loader/tuning.py``)
        applied = apply_tuning(manifest, plan, str(dev), lambda: budget_bytes(manifest.root, memory_budget,
                                                                              options.store, plan, str(dev)),
                               ignore=options.ignore_device_file)
        plan = applied.plan
    workers = reader_workers(options.workers, plan)
    threads = options.threads
    if options.policy is not None:
        plan = dataclasses.replace(plan, eviction=PolicySpec(options.policy))
    policy_factory(plan.eviction.name, plan.eviction.params)
    return _Resolved(dev, link, plan, workers, memory_budget, auto,
                     compute_threads(dev, workers) if threads == "auto" else None,
                     None if threads == "auto" else threads, _predictors(plan, options.predictors),
                     options.routing if options.routing is not None else plan_routing(plan),
                     options.miss_policy if options.miss_policy is not None else plan_miss(plan), applied)


def _open_stores(manifest: Manifest, mode: str, dev: torch.device, cleanup: contextlib.ExitStack) -> dict:
    """Every expert store, each record checked against its xxh3_64 as it is read (a neuron store's blocks too)."""
    stores = {}
    for p, s in manifest.stores.items():
        stores[p] = ExpertStore(manifest.path(s.file), p, mode=mode,
                                check=lambda key, data, p=p: check_record(manifest, p, key, data),
                                pinned=dev.type == "cuda",
                                blocks=read_block_table(manifest, p) if s.blocks is not None else None)
        cleanup.callback(stores[p].close)
    return stores


def _size_budget(manifest: Manifest, stores: dict, run: _Resolved, expert_dtype: str):
    """The held forms and the pools' capacities within the budget (``loader.budget.held_layout``); a budget
    "auto" chose that does not fit says what it chose."""
    try:
        return held_layout(manifest, stores, run.plan, run.memory_budget, run.device, expert_dtype, run.workers)
    except BudgetError as e:
        if run.auto is None:
            raise
        raise BudgetError(f"{run.auto.describe()}; that does not fit this artifact: {e}") from None


def _build_model(manifest: Manifest, dev: torch.device):
    """The model skeleton on the meta device, checked against the manifest (``check_model``), with the dense weights
    assigned on ``dev``; the fused expert parameters stay on meta (``_attach_experts`` drops them). Returns the
    model and its config."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    moe = manifest.moe
    config = AutoConfig.from_pretrained(manifest.root)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, moe.dtype))
    check_model(manifest, model)
    dense = load_file(manifest.path(DENSE), device=str(dev))
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    expert_params = set(moe.expert_params)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.get_text_config().tie_word_embeddings else set()
    other = [k for k in missing if k not in expert_params and k not in tied]
    if unexpected or other:
        raise ArtifactError(f"dense.safetensors does not fit the model: missing {other[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    _rebuild_meta_buffers(model, dev)
    return model, config


def _hold_dense(model: torch.nn.Module, manifest: Manifest, form: str, dev: torch.device) -> dict:
    """The dense weights in ``form`` (``loader/dense.py``): int8 on a CPU where the compiled kernels run, else as
    stored; returns what was done (``budget["dense"]``)."""
    if form != "int8":
        return {"form": "float"}
    if dev.type != "cpu":
        return {"form": "float", "why": f"int8 dense weights are computed by the CPU kernels, not on {dev.type}"}
    return hold_dense_int8(model, keep_float=manifest.moe.router_modules)


def _make_engine(manifest: Manifest, neuron, run: _Resolved, layout, stores: dict,
                 cleanup: contextlib.ExitStack) -> ExpertEngine:
    """The expert engine over the stores, with the neuron-level loading the plan or ``neuron`` (``load``'s) asks
    for."""
    moe, plan, dev, workers, link = manifest.moe, run.plan, run.device, run.workers, run.link
    miss_policy, chosen = run.miss_policy, run.predictors
    layouts = {p: RecordLayout.from_json(s.layout) for p, s in manifest.stores.items()}
    pairings = neuron_pairings(manifest)
    neuron_cfg = neuron_config(plan, neuron, pairings)
    setup = EngineSetup(stores, layouts, moe.top_k, dev, workers, miss_policy, chosen, list(moe.layers), neuron_cfg,
                        pairings, link)
    return ExpertEngine(layout.plan if layout.capacities is not None else plan, layout, setup, cleanup)


def _attach_experts(model: torch.nn.Module, moe: MoeSection, engine: ExpertEngine) -> None:
    """Each experts module computes through the engine: its never materialised fused parameters dropped."""
    for position, path in enumerate(moe.experts_modules):
        module = _submodule(model, path, "experts")
        if getattr(module, "num_experts", moe.num_experts) != moe.num_experts:
            raise ArtifactError(f"the manifest says {moe.num_experts} experts but {path} has {module.num_experts}; "
                                "the manifest was edited or the artifact is corrupt, prepare it again")
        for name in [n for n, p in module.named_parameters(recurse=False) if p.is_meta]:
            del module._parameters[name]  # never materialised: experts live in the store and the cache
        module._moeprep = OffloadedExperts(position, engine)
        engine.modules.append(module)


def _plan_cpu_misses(engine: ExpertEngine, stores: dict, options: LoadOptions, run: _Resolved, config) -> None:
    """On a GPU with the stores in host RAM: which decode misses compute on the CPU (``cpu_misses``; "auto"
    measures both ways on the first expert)."""
    if not (run.link.accelerated and options.store == "host" and options.cpu_misses != "never"):
        return
    rule = CpuMissRule(options.cpu_misses)
    if options.cpu_misses == "auto":
        records = {p: s.host_record(engine.key(0, 0)) for p, s in stores.items()}
        engine.miss_costs = measure_miss_costs(engine.modules[0], records,
                                               {p: engine.cpu_form(p) for p in records}, engine.forms, run.device,
                                               config.get_text_config().hidden_size)
        rule = engine.miss_costs.rule()  # off (serves nothing) where copying wins everywhere
    engine.schedule.cpu_rule = rule


def _finish_model(model: torch.nn.Module) -> None:
    """Plug the offloaded experts forward into transformers and check that no weight is left on meta."""
    _register_implementation()
    model.config._experts_implementation = IMPLEMENTATION
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ArtifactError(f"weights missing from the artifact: {leftover[:5]}")
    model.eval()


def _budget_report(manifest: Manifest, options: LoadOptions, run: _Resolved, layout, engine: ExpertEngine,
                   stores: dict) -> dict:
    """``LoadedModel.budget``: what the budget was asked for and what it bought (capacities, slots, forms)."""
    caps, sizes, plan = layout.capacities, layout.sizes, run.plan
    requested = options.memory_budget
    return caps.to_json() | {
        "dense_bytes": dense_bytes(manifest.path(DENSE)),
        "requested": requested if requested is not None else plan.default_budget,
        "minimum_bytes": lowest_budget(plan, sizes), "host_store_bytes": sum(s.host_bytes for s in stores.values()),
        "record_bytes": {p: s.record_bytes for p, s in stores.items()},
        "slot_bytes": engine.slot_bytes, "eviction": plan.eviction.name,
        "staging_bytes": sizes.staging_bytes,
        # one prompt chunk's activations and the prefill forms' buffers (loader/prefill.py)
        "prefill_form_bytes": sizes.prefill_form_bytes,
        "prefill_forms": {p: {"form": f.name, "from_tokens": n} for p, (f, n) in engine.prefill_forms.items()},
        "expert_dtype": {p: f.name for p, f in engine.forms.items()},
        "cache_slots": {name: a.count for name, a in engine.arenas.items()},
        "auto": run.auto.to_json() if run.auto is not None else None,
        "operating_point": (point.budget_bytes if (point := plan.point_for(caps.limit_bytes)) else None),
        "tuning": run.tuning.to_json() if run.tuning is not None else {"applied": False, "why": "a plan was given"}}


def _set_threads(loaded: LoadedModel, run: _Resolved) -> None:
    """torch's threads while the model is loaded (``close`` restores them): ``threads=N`` now, "auto" per step."""
    if run.wanted_threads is not None:
        loaded._threads_before = torch.get_num_threads()
        torch.set_num_threads(run.wanted_threads)
    elif run.decode_threads is not None:  # "auto" on a CPU: decode steps on the cores the readers leave free
        loaded._threads_before = torch.get_num_threads()
        loaded.runtime.threads = (run.decode_threads, loaded._threads_before)


def _attach_routing(loaded: LoadedModel, manifest: Manifest, run: _Resolved, replay) -> None:
    """Install the routing policy (after the replay, before CORM's trusted prediction) on the routers, and bind the
    predictors to the routers' weights and the artifact's predictor tensors."""
    model, engine, moe = loaded.model, loaded.runtime, manifest.moe
    policy = run.routing if replay is None else ChainedRouting(replay, run.routing)
    trusted = _trusted_prediction(engine, moe)
    loaded.routing = install_routing(
        model, moe.experts_modules, ChainedRouting(policy, trusted) if trusted is not None else policy,
        router_paths=moe.router_modules, view=engine.cache.view,
        after_router=engine.after_router if engine.predictors else None)
    engine.routing = loaded.routing.policy
    if engine.predictors:
        routers = [_submodule(model, path, "router") for path in moe.router_modules]
        engine.bind_predictors([(r.weight, getattr(r, "bias", None)) for r in routers], read_predictor_tensors(manifest))
        # the LM head's input is the final-normed last hidden state, what the first-layer gate was trained on
        model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: engine.after_last_layer(args[0]))


def _trusted_prediction(engine: ExpertEngine, moe: MoeSection) -> TrustedPrediction | None:
    """CORM's expert-level trust: with ``trust_prediction`` and the neuron_gates predictor, the layers compute
    the predicted experts (``loader.neuron.TrustedPrediction``); None otherwise."""
    gates = next((p for p in engine.predictors if p.name == "neuron_gates"), None)
    if engine.neuron is None or not engine.neuron.cfg.trust_prediction or gates is None:
        return None
    if moe.routing_weights is None:
        raise LoaderError("trust_prediction weighs the predicted experts with the router's weight function, which "
                          "this artifact's manifest does not record (moe.routing_weights); prepare it again")
    return TrustedPrediction(gates, moe.routing_weights, engine.neuron.applies)


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
