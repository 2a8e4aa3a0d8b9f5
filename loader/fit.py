"""What a load would hold where, and how fast it would run, before it loads: ``moeload plan`` and ``loader.preview``.

Nothing here reads an expert or builds the model. The bytes come from the arithmetic ``load`` itself runs
(``loader.budget.held_layout`` and ``allocation``: the engine allocates exactly what is printed); the speed comes from
the loader's cost model (``loader.simulate``) replaying the routing sample the artifact carries (``routing.safetensors``)
through the cache this budget builds, timed with a device profile: one given (``moeload profile-device`` on this
device), else the one the artifact was planned with (``device.json``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from loader.artifact import read_report
from loader.budget import (
    allocation,
    budget_bytes,
    buffer_bytes,
    held_layout,
    minimum_budget,
    prefill_floor,
    resolve_budget,
)
from loader.codec import RecordLayout
from loader.device import (
    DEVICE_FILE,
    DeviceProfile,
    check_profile_for,
    load_profile,
    model_profile,
    read_artifact_profile,
)
from loader.errors import BudgetError, LoaderError
from loader.format import read_manifest
from loader.memory import auto_budget, is_auto
from loader.options import reader_workers
from loader.plan import read_plan
from loader.predict import ROUTING_ONLY, make_predictor
from loader.prefill import chunk_sizes
from loader.simulate import (
    ROUTING_SAMPLE,
    PredictionFeed,
    Replay,
    capacities_spec,
    first_tokens,
    read_routing_sample,
    simulate,
    simulate_prefill,
)
from loader.store import ExpertStore
from loader.tuning import apply_tuning

PROMPT_TOKENS = 512  # the prompt whose time to first token is predicted unless one is given
# decode steps replayed for the prediction: the routing sample's first tokens (every token of a 1,024-token sample
# replays in ~3.5 s on the reference model here, with its predictors and routing policy in Python)
SAMPLE_TOKENS = 256


def preview(artifact, memory_budget=None, device: str = "cpu", store: str = "disk", profile=None,
            prompt_tokens: int = PROMPT_TOKENS, expert_dtype: str = "auto", workers="auto", routing=None,
            sample_tokens: int = SAMPLE_TOKENS, ignore_device_file: bool = False) -> dict:
    """One JSON-ready object: the budget (and what ``auto`` chose), the minimum budget and its parts, whether the
    budget fits (``fits``; ``error`` says why not), the operating point, the held forms, every byte of the budget by
    what holds it (``accounting``), and the predicted decode tokens/s and time to first token of a ``prompt_tokens``
    prompt (``prediction``; its ``why`` says what is missing where it cannot be made). ``profile``: a
    ``DeviceProfile`` or a path to one (None: the artifact's). ``routing``: a routing file to replay instead of the
    artifact's sample (``loader.simulate.read_routing_sample``); ``sample_tokens``: how many of its first tokens the
    decode prediction replays. The plan is the one ``load`` would run: with the device file's decisions
    (``loader/tuning.py``) unless ``ignore_device_file``; ``tuning`` says which, or that the techniques are untested."""
    manifest = read_manifest(artifact)
    # every file the prediction reads, through its one reader, before the budget: a refused file is refused whatever
    # the budget, with the message verify and generate give
    inputs = prediction_inputs(manifest, profile, routing)
    report = read_report(manifest)
    plan = read_plan(manifest.root)
    dev = torch.device(device)
    requested, auto = memory_budget, None
    if is_auto(memory_budget):
        auto = auto_budget(str(dev))
        memory_budget = auto.budget_bytes
    applied = apply_tuning(manifest, plan, str(dev), lambda: budget_bytes(manifest.root, memory_budget, store, plan,
                                                                          str(dev)), ignore=ignore_device_file)
    plan = applied.plan
    n_workers = reader_workers(workers, plan)
    stores = {p: ExpertStore(manifest.path(s.file), p, mode=store) for p, s in manifest.stores.items()}
    try:
        minimum = minimum_budget(manifest.root, store, plan, device, expert_dtype, n_workers)
        out = {"artifact": str(manifest.root), "device": str(dev), "store": store, "workers": n_workers,
               "budget": {"requested": requested if requested is not None else plan.default_budget,
                          "bytes": None, "auto": auto.to_json() if auto is not None else None},
               "minimum_budget_bytes": minimum, "fits": True, "error": None, "tuning": applied.to_json(),
               "tuning_line": applied.describe()}
        try:
            layout = held_layout(manifest, stores, plan, memory_budget, dev, expert_dtype, n_workers)
        except LoaderError as e:
            layout = None
            out["fits"] = False
            out["error"] = f"{auto.describe()}; that does not fit: {e}" if auto is not None else str(e)
        smallest = held_layout(manifest, stores, plan, minimum, dev, expert_dtype, n_workers)  # what the minimum holds
        out["minimum_parts"] = _minimum_parts(smallest, minimum)
        if layout is None:
            out["budget"]["bytes"] = _budget_bytes(memory_budget, smallest)
            out["prediction"] = {"available": False, "why": "the budget does not fit"}
            return finite_only(out)
        caps = layout.capacities
        out["budget"]["bytes"] = None if math.isinf(caps.limit_bytes) else int(caps.limit_bytes)
        layouts = {p: RecordLayout.from_json(s["layout"]) for p, s in manifest.raw["stores"].items()}
        top_k = manifest.moe.top_k
        alloc = allocation(layout.plan, layout, layouts, top_k, n_workers, dev)
        point = plan.point_for(caps.limit_bytes)
        out["operating_point"] = _operating_point(report, point.budget_bytes) if point is not None else None
        out["held_forms"] = {p: f.name for p, f in sorted(layout.forms.items())}
        out["accounting"] = _accounting(layout, alloc)
        out["prediction"] = _prediction(manifest, layout, inputs, prompt_tokens,
                                        {p: s.record_bytes for p, s in stores.items()}, sample_tokens, n_workers)
        return finite_only(out)
    finally:
        for s in stores.values():
            s.close()


def finite_only(value, path: str = ""):
    """``value`` with every non-finite float (inf, NaN) made null, so ``plan --json`` is strict JSON; none is expected
    (each is refused or named where it is made), so one that gets here is listed under ``not_finite`` at the top."""
    found: list[str] = []

    def walk(x, at: str):
        if isinstance(x, float) and not math.isfinite(x):
            found.append(at)
            return None
        if isinstance(x, dict):
            return {k: walk(v, f"{at}.{k}" if at else str(k)) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [walk(v, f"{at}[{i}]") for i, v in enumerate(x)]
        return x

    out = walk(value, path)
    if found and isinstance(out, dict):
        out["not_finite"] = found
    return out


def _budget_bytes(memory_budget, layout) -> int | None:
    value = resolve_budget(memory_budget, layout.plan, layout.sizes)
    return None if math.isinf(value) else int(value)


def _minimum_parts(layout, minimum: int) -> dict:
    """The minimum budget by what it holds: the dense weights, the read and staging buffers, one prompt token's
    activations, and (the rest) one record per eviction group of each pool."""
    plan, sizes = layout.plan, layout.sizes
    parts = {"dense_bytes": sizes.dense_bytes, "buffer_bytes": buffer_bytes(plan, sizes),
             "one_token_activation_bytes": prefill_floor(plan, sizes)}
    parts["one_record_per_group_bytes"] = max(0, minimum - sum(parts.values()))
    return parts


def _operating_point(report: dict, budget_bytes: int) -> dict:
    """The point's figures from report.json (read and checked by ``loader.artifact.read_report``); None where the
    report has no such point."""
    points = report.get("operating_points") or []
    found = next((p for p in points if p.get("budget_bytes") == budget_bytes), {})
    return {"budget_bytes": budget_bytes, "modeled_tokens_per_s": found.get("modeled_tokens_per_s"),
            "accuracy_delta": found.get("accuracy_delta")}


def _accounting(layout, alloc) -> dict:
    """Every byte of the budget by what holds it; ``unused_bytes`` is what no slot, buffer or reserve takes."""
    caps = layout.capacities
    pools = {}
    for pool in layout.plan.pools:
        slots, slot_bytes = alloc.pools[pool.name]
        pools[pool.name] = {"precision": pool.precision, "group": pool.group, "groups": len(caps.pools[pool.name]),
                            "slots": slots, "slot_bytes": slot_bytes, "bytes": slots * slot_bytes,
                            "capacity_bytes": int(sum(caps.pools[pool.name].values()))}

    def buffers(pair) -> dict:
        return {"count": pair[0], "bytes_each": pair[1], "bytes": pair[0] * pair[1]}

    out = {"dense_bytes": caps.dense_bytes, "pools": pools, "read_buffers": buffers(alloc.read_buffers),
           "staging_buffers": buffers(alloc.staging), "prefill_buffers": buffers(alloc.prefill_buffers),
           "prefill_activations": {"bytes": caps.prefill_bytes, "chunk": caps.prefill_chunk}}
    held = caps.dense_bytes + alloc.bytes + caps.prefill_bytes
    out["held_bytes"] = held
    out["unused_bytes"] = None if math.isinf(caps.limit_bytes) else int(caps.limit_bytes) - held
    return out


def device_profile(manifest, profile) -> tuple[DeviceProfile | None, str]:
    """(the profile, where it came from): the one given (a ``DeviceProfile`` or a path, ``load_profile``), else the
    artifact's (``read_artifact_profile``, sealed); (None, "") where there is neither. A file that cannot be used
    raises, naming it."""
    if isinstance(profile, DeviceProfile):
        return profile, "given"
    if profile is not None:
        given = load_profile(profile)
        check_profile_for(manifest, given)
        return given, str(profile)
    carried = read_artifact_profile(manifest)
    if carried is not None:
        return carried, f"the artifact's {DEVICE_FILE} (the device it was planned for)"
    return None, ""


@dataclass(frozen=True)
class PredictionInputs:
    """What the prediction replays and with what profile, each read through its one reader; ``why`` says what is
    missing where nothing was given and the artifact carries none (the prediction is then unavailable, no error)."""

    profile: DeviceProfile | None
    source: str
    replay: Replay | None
    feed: PredictionFeed | None
    routing: str
    why: str | None


def prediction_inputs(manifest, profile=None, routing=None) -> PredictionInputs:
    """The device profile (``device_profile``) and the routing sample (``read_routing_sample``: ``routing``, else the
    artifact's) the prediction needs. A file given or carried that is refused raises its reader's MoeError (``moeload
    plan`` exits 1 with it, ``generate`` refuses before it loads); only files neither given nor carried leave the
    prediction unavailable (``why``)."""
    chosen, source = device_profile(manifest, profile)
    replay = feed = None
    why = None
    if routing is not None or ROUTING_SAMPLE in manifest.files:
        replay, feed = read_routing_sample(manifest, routing)
    else:
        why = (f"{manifest.root} carries no routing sample ({ROUTING_SAMPLE}: artifacts packaged before package stage "
               "version 11 lack it); prepare it again, or pass --routing FILE")
    if chosen is None:
        why = (f"no device profile: pass --device-profile (measure one with `moeload profile-device`); the artifact "
               f"carries no {DEVICE_FILE}")
    return PredictionInputs(chosen, source, replay, feed, str(routing or ROUTING_SAMPLE), why)


def _prediction(manifest, layout, inputs: PredictionInputs, prompt_tokens: int, record_bytes: dict,
                sample_tokens: int = SAMPLE_TOKENS, workers: int = 1) -> dict:
    if inputs.why is not None:
        return {"available": False, "why": inputs.why}
    chosen, source = inputs.profile, inputs.source
    scaled = model_profile(manifest, chosen)
    full, feed = inputs.replay, inputs.feed
    plan, caps = layout.plan, layout.capacities
    replay, feed = first_tokens(full, feed, sample_tokens)
    spec = capacities_spec(plan, caps, record_bytes, dict(layout.sizes.record_bytes))
    names = [s.name for s in plan.predictors]
    runnable = names if feed is not None else [n for n in names if n in ROUTING_ONLY]
    if feed is None and runnable:
        feed = PredictionFeed(None, None, [], {})
    knobs = {s.name: s.params for s in plan.predictors}
    result = simulate(replay, spec, profile=scaled, predictors=[make_predictor(n, knobs.get(n)) for n in runnable],
                      feed=feed if runnable else None, workers=workers)
    seconds = result.seconds or 0.0
    shape = layout.sizes.activation
    chunk = caps.prefill_chunk or plan.prefill.chunk
    out = {}
    try:
        chunks = (chunk_sizes(shape, caps.prefill_bytes, chunk, prompt_tokens) if shape is not None
                  else [min(chunk, prompt_tokens - start) for start in range(0, prompt_tokens, chunk)])
        prefill = simulate_prefill(full, spec, scaled, prompt_tokens, chunks, plan.prefill,
                                   {p: f.name for p, f in layout.forms.items()}, workers)
        finite = math.isfinite(prefill.tokens_per_second)
        out |= {"prefill_chunks": len(chunks), "time_to_first_token_s": prefill.seconds,
                "prefill_tokens_per_s": prefill.tokens_per_second if finite else None,
                "prefill_why": None if finite else "unbounded: the profile models the prompt as taking no time"}
    except BudgetError as e:  # the prompt does not fit this budget's activations: ``load`` would refuse it too
        out |= {"prefill_chunks": None, "time_to_first_token_s": None, "prefill_tokens_per_s": None,
                "prefill_why": str(e)}
    return out | {"available": True, "profile": source, "routing": inputs.routing, "profile_device": chosen.device,
            "calibrated": bool(chosen.calibration), "sample_tokens": result.tokens,
            "decode_tokens_per_s": result.tokens / seconds if seconds > 0 else None,
            "decode_why": None if seconds > 0 else "unbounded: the profile models decode as taking no time",
            "decode_seconds_per_token": seconds / result.tokens if result.tokens else None,
            "hit_rate": 1 - result.miss_rate, "bytes_read_per_token": result.bytes_read / max(1, result.tokens),
            "predictors": runnable, "predictors_not_modelled": [n for n in names if n not in runnable],
            "prompt_tokens": prompt_tokens}


def describe(view: dict) -> list[str]:
    """``moeload plan``'s lines for a preview."""
    mib = 2 ** 20

    def size(n) -> str:
        if n is None:
            return "unlimited"
        for unit, scale in (("GiB", 2 ** 30), ("MiB", mib), ("KiB", 1024)):
            if abs(n) >= scale:
                return f"{n / scale:,.2f} {unit} ({n:,} B)"
        return f"{n:,} B"

    lines = [f"artifact  {view['artifact']}", f"device    {view['device']}  store {view['store']}  reader threads "
                                                f"{view['workers']}"]
    budget = view["budget"]
    lines.append(f"budget    {budget['requested']} = {size(budget['bytes'])}")
    if budget["auto"]:
        a = budget["auto"]
        lines.append(f"          auto: {a['free_bytes']:,} B free ({a['source']}) less a margin of {a['margin_bytes']:,} B")
    parts = view.get("minimum_parts", {})
    lines.append(f"minimum   {size(view['minimum_budget_bytes'])}: dense {parts.get('dense_bytes', 0):,} B + buffers "
                 f"{parts.get('buffer_bytes', 0):,} B + one prompt token {parts.get('one_token_activation_bytes', 0):,} B"
                 f" + one record per eviction group {parts.get('one_record_per_group_bytes', 0):,} B; a smaller "
                 "budget cannot hold one expert where the plan caches one")
    if view.get("tuning_line"):
        lines.append(view["tuning_line"])
    if not view["fits"]:
        lines.append(f"DOES NOT FIT: {view['error']}")
        return lines
    point = view.get("operating_point")
    if point:
        speed = point["modeled_tokens_per_s"]
        delta = point["accuracy_delta"] or {}
        lines.append(f"operating point  {size(point['budget_bytes'])}: modelled at preparation "
                     + (f"{speed:.1f} tok/s" if isinstance(speed, int | float) else "-")
                     + (", accuracy " + ", ".join(f"{k} {100 * v:+.2f} points" for k, v in delta.items()
                                                  if isinstance(v, int | float)) if delta else ""))
    lines.append("held forms  " + "  ".join(f"{p} {f}" for p, f in view["held_forms"].items()))
    acc = view["accounting"]
    lines.append(f"  dense weights          {size(acc['dense_bytes'])}")
    for name, pool in acc["pools"].items():
        lines.append(f"  pool {name:17s} {size(pool['bytes'])}: {pool['slots']} slots of {pool['slot_bytes']:,} B "
                     f"({pool['precision']}, {pool['groups']} {pool['group']} group(s))")
    for key, label in (("read_buffers", "read buffers"), ("staging_buffers", "staging buffers"),
                       ("prefill_buffers", "prefill buffers")):
        b = acc[key]
        lines.append(f"  {label:22s} {size(b['bytes'])}: {b['count']} x {b['bytes_each']:,} B")
    pa = acc["prefill_activations"]
    lines.append(f"  prompt activations     {size(pa['bytes'])}: chunks of up to {pa['chunk']} tokens")
    if acc["unused_bytes"] is not None:
        lines.append(f"  unused                 {size(acc['unused_bytes'])}")
    p = view["prediction"]
    if not p["available"]:
        lines.append(f"predicted  none: {p['why']}")
        return lines
    ttft = (f"{p['time_to_first_token_s']:.3f} s in {p['prefill_chunks']} chunk(s)"
            if p["time_to_first_token_s"] is not None else f"none ({p['prefill_why']})")
    decode = (f"{p['decode_tokens_per_s']:.2f} tok/s" if p["decode_tokens_per_s"] is not None
              else f"none ({p.get('decode_why')})")
    lines.append(f"predicted  decode {decode} (hit rate {p['hit_rate']:.3f}, "
                 f"{p['bytes_read_per_token'] / mib:.2f} MiB read per token); time to first token of a "
                 f"{p['prompt_tokens']}-token prompt {ttft}")
    lines.append(f"           profile: {p['profile']} ({p['profile_device']}"
                 f"{', calibrated' if p['calibrated'] else ', not calibrated: reads and compute only'})"
                 + (f"; predictors not modelled: {p['predictors_not_modelled']}" if p["predictors_not_modelled"]
                    else ""))
    return lines
