"""The preparation's side of the simulator: traces on disk, N-experts-per-layer caches, sweeps, Belady and the
command line, over the loader's cost model.

The replay itself (one call per token per MoE layer through the loader's own ``ExpertCache`` and ``LayerSchedule``,
a token's experts protected together, each sequence cold unless ``cold_start=False``, the CPU rule applied to every
miss) lives in ``loader/simulate.py``, whose docstring gives the call order; ``simulate`` here adds ``belady``, the
clairvoyant floor, which exists only in the simulator.

Capacity comes from a ``loader.plan.Plan`` and a budget through ``loader.budget.capacities`` (the same
arithmetic as the loader: ``plan_spec``; ``artifact_spec`` also takes the artifact's held-form and read
sizes exactly as ``loader.runtime.load`` does), or from a number of experts per layer
(``capacity_spec``): N records per layer group, or one global group of N x L records.

Shapes use the legend declared in ``loader/__init__.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

from loader.budget import ModelSizes
from loader.cache import PoolConfig
from loader.codec import MX_GROUP, MatrixSpec, RecordLayout
from loader.device import DeviceProfile, load_profile
from loader.format import read_manifest
from loader.plan import Plan, read_plan_file
from loader.policies import POLICIES
from loader.predict import PREDICTORS, PREDICTORS_FILE, make_predictor
from loader.schedule import CPU_MISSES, CpuMissRule
from loader.simulate import (  # noqa: F401  (the cost model's home is the loader; these names are the simulator's API)
    CacheSpec,
    LayerResult,
    PredictionFeed,
    Replay,
    SimResult,
    artifact_spec,
    capacities_spec,
    plan_spec,
)
from loader.simulate import simulate as replay_decode
from loader.vocab import GROUPS, MX, PRECISIONS
from prep.errors import MoeprepError
from prep.methods.trace import open_trace
from prep.sim.belady import BeladyPolicy, FutureUses
from prep.sim.replay import load_replay

POLICY_NAMES = (*POLICIES, "belady")  # every policy the simulator runs; belady only here
MIXTRAL_GROUP_SIZE = 64


def mixtral_record_bytes(precision: str = "int4", group_size: int = MIXTRAL_GROUP_SIZE) -> int:
    """Bytes of one Mixtral-8x7B expert record in this project's store format.

    The expert is three matrices of 4096 x 14336 (gate, up: [I, H]; down: [H, I]), 176,160,768
    weights. intN stores N-bit codes plus a float16 scale and zero per group of ``group_size``
    weights, each part 16-byte aligned (``loader.codec.RecordLayout``); int4 with groups of 64:
    3 x (29,360,128 + 2 x 1,835,008) = 99,090,432 bytes (94.5 MiB). ``passthrough`` is the source
    bfloat16: 352,321,536 bytes.
    """

    hidden, inter = 4096, 14336
    if precision not in PRECISIONS:
        raise MoeprepError(f"no record size for precision {precision!r}; use one of {PRECISIONS}")
    group_size = 0 if precision == "passthrough" else MX_GROUP if precision in MX else group_size
    shapes = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    return RecordLayout(tuple(MatrixSpec(n, s, precision, "bfloat16", group_size)
                              for n, s in shapes.items())).nbytes


DEFAULT_RECORD_BYTES = 99_090_432  # mixtral_record_bytes("int4"), checked by a test
MAX_RECORD_BYTES = 1 << 40  # 1 TiB: far above any expert record (Mixtral's bfloat16 expert is 336 MiB)


def check_record_bytes(record_bytes, what: str = "--record-bytes") -> int:
    """``record_bytes`` when it is a whole number of bytes from 1 to ``MAX_RECORD_BYTES``, else a MoeprepError
    naming ``what``: 0 would be a record that costs nothing (and ``0 or default`` silently the default)."""
    if isinstance(record_bytes, bool) or not isinstance(record_bytes, int) or not 1 <= record_bytes <= MAX_RECORD_BYTES:
        raise MoeprepError(f"{what} {record_bytes!r} must be a whole number of bytes from 1 to {MAX_RECORD_BYTES:,} "
                           f"(one expert record; leave it out for {DEFAULT_RECORD_BYTES:,}, an int4 Mixtral-8x7B "
                           "expert)")
    return record_bytes


def capacity_spec(num_layers: int, num_experts: int, capacity: int, group: str = "layer",
                  record_bytes: int = DEFAULT_RECORD_BYTES, precision: str = "int4") -> CacheSpec:
    """One pool at ``precision`` holding ``capacity`` records per layer (``group="layer"``) or one global
    group of ``capacity * num_layers`` records (``group="global"``)."""
    if group not in GROUPS:
        raise MoeprepError(f"--group must be one of {', '.join(GROUPS)}, not {group!r}")
    if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= num_experts:
        raise MoeprepError(f"capacity {capacity!r} must be a whole number of experts per layer from 1 to "
                           f"{num_experts} (the model's experts per layer)")
    check_record_bytes(record_bytes, "record bytes")
    per_group = ({layer: capacity * record_bytes for layer in range(num_layers)} if group == "layer"
                 else {"global": capacity * num_layers * record_bytes})
    return CacheSpec((PoolConfig("main", precision, group, per_group, record_bytes),),
                     tuple((precision,) * num_experts for _ in range(num_layers)), {precision: record_bytes},
                     capacity, group)


def belady(params: dict | None):
    """``loader.simulate.policy_builder``'s entry for Belady's clairvoyant policy, which only the simulator runs."""
    if params:
        raise MoeprepError(f"the belady policy takes no parameters, got {sorted(params)}")
    future = FutureUses()
    return (lambda clock, num_experts: BeladyPolicy(clock, num_experts, future)), future


EXTRA_POLICIES = {"belady": belady}


def simulate(replay: Replay, spec: CacheSpec, policy: str | None = None, params: dict | None = None,
             profile: DeviceProfile | None = None, cold_start: bool = True, predictors: list | None = None,
             feed: PredictionFeed | None = None, routing=None, miss=None,
             cpu_misses: CpuMissRule | None = None) -> SimResult:
    """``loader.simulate.simulate`` with the simulator's own policies too (``belady``)."""
    return replay_decode(replay, spec, policy, params, profile, cold_start, predictors, feed, routing, miss, cpu_misses,
                         extra_policies=EXTRA_POLICIES)


def prediction_feed(trace_dir, artifact) -> PredictionFeed:
    """The feed of a project trace directory and the artifact whose routers and predictor tensors to use."""
    from safetensors import safe_open
    from safetensors.torch import load_file


    manifest = read_manifest(artifact)
    routers = []
    with safe_open(str(manifest.path("dense.safetensors")), framework="pt") as f:
        names = set(f.keys())
        for path in manifest.raw["moe"]["router_modules"]:
            bias = f"{path}.bias"
            routers.append((f.get_tensor(f"{path}.weight").float(),
                            f.get_tensor(bias).float() if bias in names else None))
    tensors = load_file(str(manifest.path(PREDICTORS_FILE))) if PREDICTORS_FILE in manifest.raw["files"] else {}
    return trace_feed(trace_dir, routers, tensors)


def trace_feed(trace_dir, routers: list, tensors: dict) -> PredictionFeed:
    """The feed of a project trace directory with the given routers ([(weight, bias)] per MoE layer) and
    predictor tensors: per sequence the router inputs and, when recorded, the LM head's inputs."""
    import torch


    trace = open_trace(trace_dir)
    if f"layers.{trace.layers[0]}.router_input" not in trace.index["tensors"]:
        if "recorded" in trace.index:  # imported routing: only the predictors that read nothing else replay
            return PredictionFeed(None, None, routers, tensors)
        raise MoeprepError(f"{trace_dir} holds no router inputs; record it with hidden states (record_hidden)")
    inputs = torch.stack([trace.router_inputs(layer) for layer in trace.layers], dim=1)  # [N, L, H]
    head = trace.tensor("head_input") if "head_input" in trace.index["tensors"] else None
    slices = trace.sequence_slices()
    return PredictionFeed([inputs[s] for s in slices], [head[s] for s in slices] if head is not None else None,
                          routers, tensors)


def sweep(replay: Replay, policies: Iterable[str], capacities_per_layer: Iterable[int],
          groups: Iterable[str] = ("layer",), record_bytes: int = DEFAULT_RECORD_BYTES, precision: str = "int4",
          params: dict | None = None, profile: DeviceProfile | None = None,
          cold_start: bool = True, cpu_misses: CpuMissRule | None = None) -> list[SimResult]:
    """``simulate`` for every (group, capacity, policy), in that nesting order. ``params`` go to every
    policy that is not belady (so pass them only with one policy)."""
    results = []
    policies = list(policies)
    for group in groups:
        for capacity in capacities_per_layer:
            spec = capacity_spec(replay.num_layers, replay.num_experts, capacity, group, record_bytes, precision)
            for policy in policies:
                results.append(simulate(replay, spec, policy, params if policy != "belady" else None, profile,
                                        cold_start, cpu_misses=cpu_misses))
    return results


def _synthetic_sizes(plan: Plan, replay: Replay, record_bytes: int | None) -> ModelSizes:
    """Sizes for a plan without its artifact: Mixtral-8x7B-shaped records (``mixtral_record_bytes``; or
    ``record_bytes`` for every precision), no dense weights, source experts in bfloat16."""
    sizes = {p: record_bytes or mixtral_record_bytes(p) for p in plan.precisions}
    return ModelSizes(plan.num_layers, plan.num_experts, replay.top_k, 0,
                      plan.num_layers * plan.num_experts * (record_bytes or mixtral_record_bytes("passthrough")), sizes)


def parse_list(text: str | None, what: str, convert=str) -> list:
    """"a,b,c" -> [a, b, c] converted; an unconvertible item is a MoeprepError naming ``what``."""
    if text is None:
        return []
    items = [t.strip() for t in str(text).split(",") if t.strip()]
    try:
        return [convert(t) for t in items]
    except ValueError:
        raise MoeprepError(f"{what} {text!r} is not a comma-separated list of {convert.__name__} values") from None


def cpu_miss_rule(text) -> CpuMissRule | None:
    """The CPU rule ``text`` names: ``never`` (or None), ``always``, or comma-separated precisions whose
    misses the CPU computes (what ``load(cpu_misses="auto")`` measures at load); a rule passes as it is."""
    if text is None or isinstance(text, CpuMissRule):
        return text
    names = parse_list(text, "--cpu-misses")
    if names in (["never"], ["always"]):
        return CpuMissRule(names[0])
    if not names or set(names) & set(CPU_MISSES):
        raise MoeprepError(f"--cpu-misses {text!r}: give never, always, or the precisions computed on the CPU "
                           "(e.g. int4,int2)")
    return CpuMissRule("auto", frozenset(names))


def simulate_trace(trace, plan=None, budget=None, policies=None, capacity=None, groups=("layer",),
                   params: dict | None = None, record_bytes: int | None = None, precision: str = "int4",
                   profile=None, cold_start: bool = True, predictors=None,
                   cpu_misses=None) -> tuple[Replay, list[SimResult]]:
    """What ``moeprep simulate`` runs: load the trace, build the cache(s), replay.

    trace: a project trace directory or the real Mixtral traces (``load_replay``). Either ``plan`` (a
    ``plan.json`` path, an artifact directory, or a ``Plan``) with ``budget`` (None: the plan's default),
    or ``capacity`` (experts per layer: an int, a list, or "2,4,6") with ``groups``. policies: names,
    "a,b", "all", or None (the plan's policy; "lru" without a plan). profile: a ``DeviceProfile`` or a
    path to one. predictors: names (a list or "a,b"; "plan": the plan's) replayed with the artifact's knobs
    and tensors on the trace's router inputs; they need ``plan`` to be an artifact and a project trace.
    cpu_misses: the loader's CPU rule (``cpu_miss_rule``: a rule, or never / always / "int4,int2"). Returns
    the replay and one ``SimResult`` per (group, capacity, policy).
    """
    from pathlib import Path


    rule = cpu_miss_rule(cpu_misses)
    if record_bytes is not None:  # before the trace is read: 0 must not fall back to the default below
        check_record_bytes(record_bytes)
    replay = load_replay(trace)
    if profile is not None and not isinstance(profile, DeviceProfile):
        profile = load_profile(profile)
    if isinstance(policies, str):
        policies = list(POLICY_NAMES) if policies.strip() == "all" else parse_list(policies, "--policy")
    for name in policies or ():
        if name not in POLICY_NAMES:
            raise MoeprepError(f"eviction policy {name!r} unknown; use one of {', '.join(POLICY_NAMES)} or 'all'")
    if plan is not None and capacity is not None:
        raise MoeprepError("give either --plan (capacities from the plan and a budget) or --capacity, not both")
    if plan is not None:
        if isinstance(plan, Plan):
            spec = plan_spec(plan, budget, _synthetic_sizes(plan, replay, record_bytes))
        else:
            path = Path(plan)
            if path.is_dir():
                if not (path / "manifest.json").is_file():
                    raise MoeprepError(f"{path} is not an artifact (no manifest.json); pass its plan.json or an artifact")
                spec = artifact_spec(path, budget)
            elif path.name == "plan.json" and (path.parent / "manifest.json").is_file():
                spec = artifact_spec(path.parent, budget)
            else:
                loaded = read_plan_file(path, fix="pass a plan.json or an artifact directory")
                spec = plan_spec(loaded, budget, _synthetic_sizes(loaded, replay, record_bytes))
        names, feed = _predictor_request(predictors, plan, trace)
        runs = []
        for p in (policies or [None]):
            chosen = _make_predictors(names, plan)
            runs.append(simulate(replay, spec, p, params if p != "belady" else None, profile, cold_start, chosen, feed,
                                 cpu_misses=rule))
        return replay, runs
    if predictors:
        raise MoeprepError("--predictors needs --plan ARTIFACT (its routers and predictors.safetensors)")
    if capacity is None:
        raise MoeprepError("give --plan PLAN.json, or --policy NAME with --capacity N (experts per layer)")
    if budget is not None:
        raise MoeprepError("--budget goes with --plan; with --capacity the cache holds N experts per layer")
    capacities_ = capacity if isinstance(capacity, list | tuple) else (
        parse_list(capacity, "--capacity", int) if isinstance(capacity, str) else [capacity])
    if not capacities_:
        raise MoeprepError("--capacity needs at least one number of experts per layer")
    return replay, sweep(replay, policies or ["lru"], capacities_, groups,
                         record_bytes or DEFAULT_RECORD_BYTES, precision, params, profile, cold_start, rule)


def _predictor_request(predictors, plan, trace) -> tuple[list[str], PredictionFeed | None]:
    from pathlib import Path


    if not predictors or predictors == "none":
        return [], None
    path = Path(plan) if not isinstance(plan, Plan) else None
    artifact = path.parent if path is not None and path.name == "plan.json" else path
    if artifact is None or not (artifact / "manifest.json").is_file():
        raise MoeprepError("--predictors needs --plan to be an artifact directory (its routers and predictors)")
    if predictors == "plan":
        names = [s.name for s in read_plan_file(artifact / "plan.json").predictors]
    else:
        names = parse_list(predictors, "--predictors") if isinstance(predictors, str) else list(predictors)
    if unknown := [n for n in names if n not in PREDICTORS]:
        raise MoeprepError(f"--predictors: unknown {unknown}; use any of {', '.join(PREDICTORS)}, 'plan' or 'none'")
    if not Path(trace).is_dir():
        raise MoeprepError("--predictors replays hidden-state inputs: give a project trace directory (the real "
                           "Mixtral traces hold expert ids only)")
    return names, prediction_feed(trace, artifact)


def _make_predictors(names: list[str], plan) -> list:
    from pathlib import Path


    if not names:
        return []
    path = Path(plan)
    knobs = {s.name: s.params for s in read_plan_file((path if path.is_dir() else path.parent) / "plan.json").predictors}
    return [make_predictor(n, knobs.get(n)) for n in names]


def parse_params(items) -> dict:
    """["w_lru=0.4", "shares=[[...]]"] -> {"w_lru": 0.4, ...}: each value JSON, else the plain string."""
    import json

    params = {}
    for item in items or ():
        key, sep, value = str(item).partition("=")
        if not sep or not key.strip():
            raise MoeprepError(f"--param {item!r} must be KEY=VALUE, e.g. --param w_lru=0.4")
        try:
            params[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            params[key.strip()] = value
    return params
