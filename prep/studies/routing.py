"""The routing study: accuracy against miss rate and bytes read for each way of doing
less per token, swept across its knob, at several per-layer cache budgets.

One artifact is prepared from the recipe with what every method needs: the Fisher sensitivity (gating
stage) and a low-precision copy of every expert (dynamic_precision stage); the calibration
logit ranges of cache routing are measured on the same trace (``prep.stages.cache_routing``). Each point is
that artifact run with one plan variant:

- ``exact``: the model's own routing, every miss read at its planned precision (the baseline);
- ``gating``: AdapMoE's rule at the T that leaves a target share of single-expert decisions on the
  calibration routing;
- ``dynamic_precision``: HOBBIT's thresholds for a target (high, skip) split of the calibration routing;
  the low copies take slots of the main pool (they have no pool of their own);
- ``cache_prior`` / ``max_rank``: cache-conditional routing at each lambda / m.

Accuracy per suite comes from ``moeprep eval`` with that plan (paired against the original model, which
for a lossless artifact is exact routing; flips and McNemar's p). Miss rate and bytes read per token come
from the simulator, which runs the loader's own cache and policies (the tests hold them to identical
decisions), on fresh text (another calibration seed) one token per call, as decode reads.

Each (budget, point) is one work unit (``study_point``, ``prep/executor.py``) writing its dict to
``points/<slug>.json``, so points run side by side on a Ray cluster (``--executor ray``) and an interrupted
study resumes with the points written. A rerun keeps a point file measured with the same package key and
settings; one that is not is set aside (``points/set-aside/``) and measured again. study.json, study.md and
study.png are assembled from the point files, in order.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path

from loader.io import write_json_atomic
from loader.plan import Plan, PolicySpec, read_plan
from prep.errors import MoeprepError
from prep.evals.compare import evaluate_artifact
from prep.evals.data import SUITES
from prep.executor import Unit, UnitPaths, executor_overrides, make_executor
from prep.integrity import drop_unit, notice, seal_unit, unit_binding, unit_damage
from prep.methods.routing_stats import split_thresholds
from prep.methods.trace import open_trace
from prep.pipeline import prepare
from prep.recipe import load_recipe
from prep.report import ROUTING_PLOT, merge_section
from prep.sim.replay import load_replay
from prep.sim.simulate import artifact_spec, simulate
from prep.stages.cache_routing import measure_ranges
from prep.stages.gating import threshold_for_share
from prep.stages.table import REPORT
from prep.stages.trace import RoutingTraces
from prep.store import StageStore
from prep.studies.common import figure_png, fresh_trace, write_outputs

DEFAULT_KNOBS = {"gating": (0.1, 0.25, 0.4), "dynamic_precision": ((0.85, 0.0), (0.67, 0.03), (0.5, 0.1)),
                 "cache_prior": (0.25, 0.5, 1.0), "max_rank": (3, 4)}
PREPARE_OVERRIDES = ("gating.enabled=true", "dynamic_precision.enabled=true", "cache_routing.enabled=false",
                     "evaluate.enabled=false")
SUITE_METRIC = {"gsm8k": "strict_match"}


def _plans(artifact: Path, weights, routing: dict, knobs: dict) -> list[tuple[str, str, object, object]]:
    """(method, knob label, knob value, Plan) for every point, from the artifact's plan and report and the
    calibration routing ``weights`` [N, L, K] (where the gating and precision thresholds come from);
    ``routing``: the cache_routing params (logit ranges, weight function) every cache point starts from."""

    plan = read_plan(artifact)
    report = json.loads((artifact / "report.json").read_text())
    manifest = json.loads((artifact / "manifest.json").read_text())
    stores = manifest["stores"]
    exact = Plan.mixed(plan.expert_precision, {p: s["record_bytes"] for p, s in stores.items()
                                               if any(p in row for row in plan.expert_precision)},
                       default_budget=plan.default_budget)
    sensitivity = report["gating"]["sensitivity"]
    points = [("exact", "-", None, exact)]
    for share in knobs.get("gating", ()):
        t = threshold_for_share(weights, sensitivity, share)
        points.append(("gating", "target single", share, dataclasses.replace(exact, routing=PolicySpec(
            "adaptive_gating", {"threshold": t, "sensitivity": sensitivity, "decode_only": False}))))
    dynamic = plan.miss.params
    flat = weights.reshape(-1, weights.shape[-1])
    for high, skip in knobs.get("dynamic_precision", ()):
        t1, t2 = split_thresholds(flat, high, skip)
        points.append(("dynamic_precision", "high/skip", f"{high}/{skip}", dataclasses.replace(
            exact, pools=plan.pools, miss=PolicySpec("dynamic_precision", dynamic | {"t1": t1, "t2": t2}))))
    for lam in knobs.get("cache_prior", ()):
        points.append(("cache_prior", "lambda", lam, dataclasses.replace(exact, routing=PolicySpec(
            "cache_routing", routing | {"method": "prior", "lam": lam}))))
    for m in knobs.get("max_rank", ()):
        points.append(("max_rank", "m", m, dataclasses.replace(exact, routing=PolicySpec(
            "cache_routing", routing | {"method": "max_rank", "m": m}))))
    return points




STUDY = "routing-study"  # the executor's name for the point units (their seeds derive from it)
POINTS = "points"  # one file per (budget, point), written by its unit
SET_ASIDE = "set-aside"  # under POINTS: point files measured with another package key or other settings


def point_slug(budget: str, method: str, knob) -> str:
    """A filesystem-safe name for one (budget, point): ``25pct-cache_prior-0.5``."""
    text = f"{budget}-{method}-{knob}".replace("%", "pct")
    return re.sub(r"[^A-Za-z0-9._]+", "-", text).strip("-.") or "point"


def study_point(context, out: Path, *, artifact: str, model: str, trace: str, output: str, plan: dict, budget: str,
                method: str, knob_name: str, knob, package_key: str, settings: dict, data: str | None) -> None:
    """One unit: simulate the point's plan on the fresh trace and evaluate the artifact with it at ``budget``;
    writes the point's dict (its entry of study.json) to ``out``. The plan comes as its JSON (``Plan.to_json``)."""
    plan = Plan.from_json(plan)
    replays = context.cache(f"{STUDY}:{trace}")  # one load of the trace per process, not per point
    if "replay" not in replays:
        replays["replay"] = load_replay(trace)
    sim = simulate(replays["replay"], artifact_spec(artifact, budget, plan=plan)).to_json()
    evaluation = evaluate_artifact(artifact, model, suites=tuple(settings["suites"]), data=data,
                                   limit=settings["limit"], memory_budget=budget,
                                   reuse_original=Path(output) / "original", plan=plan)
    write_json_atomic(out, {
        "budget": budget, "method": method, "knob_name": knob_name, "knob": knob, "package_key": package_key,
        "settings": settings, "miss_rate": sim["miss_rate"], "bytes_per_token": sim["bytes_read_per_token"],
        "skipped": sum(x["skipped"] for x in sim["layers"]), "tokens": sim["tokens"],
        "suites": {name: {"n": s["n"], "original": s["original"][SUITE_METRIC.get(name, "acc")],
                          "prepared": s["prepared"][SUITE_METRIC.get(name, "acc")], "delta": s["delta"],
                          "flips": s["flips"], "mcnemar_p": s["mcnemar_p"]}
                   for name, s in evaluation["suites"].items()},
        "routing": evaluation["loader_stats"].get("routing"),
        "miss_policy": evaluation["loader_stats"].get("miss_policy")})


def _kept(done: dict | None, budget: str, method: str, knob, key: str, settings: dict) -> bool:
    """Whether a point measured before still stands: the same point, package key and settings."""
    return (done is not None and (done.get("budget"), done.get("method"), str(done.get("knob"))) == (budget, method, str(knob))
            and done.get("package_key") == key and done.get("settings") == settings)


def run_study(recipe_path: str | Path, output: str | Path, root: str | Path = ".", *, budgets=("25%", "50%"),
              knobs: dict | None = None, suites=SUITES, limit: int | None = None,
              data=None, seed: int = 1, sequences: int = 8, low: str | None = None, executor: str | None = None,
              ray_address: str | None = None, echo=print) -> dict:
    """Prepare the artifact, then measure every (budget, point), one executor unit each (``study_point``, writing
    ``points/<slug>.json``); writes study.json, study.md, study.png from the point files, in order.

    low: the precision of dynamic precision's low copies (default: the recipe's ``dynamic_precision.low``),
    added to what quantize writes. executor/ray_address: where the points run (``local``, one after another in
    this process, or ``ray``), over the recipe's ``executor`` section; the artifact's own prepare is unchanged."""

    output, root = Path(output).resolve(), Path(root).resolve()
    knobs = DEFAULT_KNOBS if knobs is None else knobs
    chosen = executor_overrides(executor, ray_address)
    base = load_recipe(recipe_path, chosen)
    runner = make_executor(base.executor)  # before any work: --executor ray without Ray is one clear error
    try:
        return _run(recipe_path, output, root, base, runner, budgets=budgets, knobs=knobs, suites=suites,
                    limit=limit, data=data, seed=seed, sequences=sequences, low=low, echo=echo)
    finally:
        runner.close()


def _run(recipe_path, output: Path, root: Path, base, runner, *, budgets, knobs, suites, limit, data, seed, sequences,
         low, echo) -> dict:
    low = low or base.dynamic_precision.low
    also = ", ".join(dict.fromkeys([*base.quantize.also, low]))
    recipe = load_recipe(recipe_path, (*PREPARE_OVERRIDES, f"dynamic_precision.low={low}", f"quantize.also=[{also}]"))
    if recipe.quantize.precision == recipe.dynamic_precision.low:
        raise MoeprepError(f"the study's low copies ({recipe.dynamic_precision.low}) must be below the experts' "
                           f"precision ({recipe.quantize.precision}); set dynamic_precision.low and quantize.also")
    artifact = output / "artifact"
    echo("prepare the study's artifact (gating, dynamic precision and cache routing stages on)")
    summary = prepare(recipe, root=root, output=artifact)
    trace_dir = RoutingTraces.path(StageStore(root / "artifacts" / recipe.name / "stages").final_dir(
        "trace", summary["trace"]["key"]))
    import torch

    weights = torch.cat([r.expert_weights for r in open_trace(trace_dir).routing()])
    trace = fresh_trace(recipe_path, root, output, seed, sequences)
    settings = {"suites": list(suites), "limit": limit, "data": str(data) if data else None, "seed": seed,
                "sequences": sequences}
    path = output / "study.json"
    # a study made before points were units has its points in study.json only
    previous = {(p["budget"], p["method"], str(p["knob"])): p for p in json.loads(path.read_text())["points"]} \
        if path.is_file() else {}
    manifest = json.loads((artifact / "manifest.json").read_text())
    key = manifest["package_key"]
    study = {"recipe": str(recipe_path), "settings": settings, "budgets": list(budgets), "points": []}

    routing = measure_ranges(trace_dir, recipe.cache_routing).knobs | {"weights": manifest["moe"]["routing_weights"]}
    points = _plans(artifact, weights, routing, knobs)
    shared = {"artifact": str(artifact), "model": str(Path(recipe.model_path(root)).resolve()), "trace": str(trace),
              "output": str(output), "package_key": key, "settings": settings,
              "data": str(Path(data).resolve()) if data else None}
    started = time.perf_counter()
    total = len(points) * len(budgets)
    units, seen = [], set()
    for b, budget in enumerate(budgets):
        for i, (method, knob_name, knob, plan) in enumerate(points):
            n = b * len(points) + i + 1
            slug = point_slug(budget, method, knob)
            if slug in seen:
                raise MoeprepError(f"two points of the routing study share the file name {slug!r}; give each budget "
                                   "and knob once")
            seen.add(slug)
            file = output / POINTS / f"{slug}.json"
            bound = unit_binding(STUDY, slug, f"{POINTS}/{slug}.json")  # what its unit's seal says (prep/executor.py)
            if file.is_file() and (problem := unit_damage(file, bound)) is not None:  # truncated, swapped, edited
                notice(f"routing study: point file {file} is not reused: {problem}; measuring it again")
                drop_unit(file)
            done = json.loads(file.read_text()) if file.is_file() else None
            if done is not None and not _kept(done, budget, method, knob, key, settings):
                (file.parent / SET_ASIDE).mkdir(parents=True, exist_ok=True)
                file.replace(file.parent / SET_ASIDE / file.name)  # measured with other settings: measure again
                done = None
            if done is None and _kept(previous.get((budget, method, str(knob))), budget, method, knob, key, settings):
                done = previous[(budget, method, str(knob))]
                write_json_atomic(file, done)
                seal_unit(file, file, bound)  # as its unit would have sealed it
            echo(f"[{n}/{total}] {budget} {method} {knob_name} {knob}: "
                 + ("measured before, kept" if done is not None else "simulate, eval"))
            units.append(Unit(name=slug, output=f"{POINTS}/{slug}.json", fn=study_point,
                              args={"plan": plan.to_json(), "budget": budget, "method": method, "knob_name": knob_name,
                                    "knob": knob, **shared}))
    stats = runner.map(STUDY, units, output, UnitPaths(model_dir=shared["model"]), desc="routing study")
    echo(f"{stats.ran} point(s) measured, {stats.reused} kept, on the {runner.kind} executor")
    study["points"] = [json.loads((output / u.output).read_text()) for u in units]
    study["seconds"] = round(time.perf_counter() - started, 1)
    study["goals"] = goals(study)
    write_outputs(output, study, study_markdown(study), study_plot(study))
    return study


def goals(study: dict, delta: float = 0.005) -> dict:
    """Where each of the routing study's goals lands, per budget: the best point within |delta| <= 0.5 point
    on every suite.

    cache prior: miss rate at most half of exact's; gating: at least 25% single-expert decisions (the
    loader's count in the eval); dynamic precision: at least 1.2x fewer bytes per token than exact."""
    out = {}
    for budget in study["budgets"]:
        pts = [p for p in study["points"] if p["budget"] == budget]
        exact = next((p for p in pts if p["method"] == "exact"), None)
        if exact is None:
            continue

        prior = _best(pts, "cache_prior", delta, lambda p: -p["miss_rate"])
        gating = _best(pts, "gating", delta, lambda p: (p["routing"] or {}).get("single_ratio") or 0)
        dynamic = _best(pts, "dynamic_precision", delta, lambda p: -p["bytes_per_token"])
        out[budget] = {
            "cache_prior": {"exact_miss_rate": exact["miss_rate"], "best": prior and {
                "lambda": prior["knob"], "miss_rate": prior["miss_rate"],
                "met": prior["miss_rate"] <= exact["miss_rate"] / 2}},
            "gating": {"best": gating and {"target": gating["knob"], "single": (gating["routing"] or {}).get("single_ratio"),
                                           "met": ((gating["routing"] or {}).get("single_ratio") or 0) >= 0.25}},
            "dynamic_precision": {"exact_bytes_per_token": exact["bytes_per_token"], "best": dynamic and {
                "split": dynamic["knob"], "bytes_per_token": dynamic["bytes_per_token"],
                "ratio": exact["bytes_per_token"] / dynamic["bytes_per_token"] if dynamic["bytes_per_token"] else None,
                "met": dynamic["bytes_per_token"] * 1.2 <= exact["bytes_per_token"]}},
        }
    return out


def _best(points: list[dict], method: str, delta: float, better):
    """The ``better``-most point of ``method`` whose |delta| is within ``delta`` on every suite, or None."""
    ok = [p for p in points if p["method"] == method
          and all(abs(s["delta"]) <= delta + 1e-9 for s in p["suites"].values())]
    return max(ok, key=better) if ok else None


def study_markdown(study: dict) -> str:
    points = study["points"]
    suites = list(points[0]["suites"]) if points else []
    s = study["settings"]
    first = "" if s["limit"] is None else f", first {s['limit']} items of each"
    lines = ["## Routing study: doing less per token", "",
             f"Recipe `{study['recipe']}`. Accuracy: `moeprep eval` with each plan against the original model "
             f"({', '.join(suites)}{first}); delta in "
             "points (flips right->wrong / wrong->right, McNemar p). Miss rate and KB read per token: the simulator "
             f"on {points[0]['tokens'] if points else 0} tokens of fresh text (seed {s['seed']}), one token per call.", "",
             "| budget | method | knob | miss rate | KB/token | single-expert share | "
             + " | ".join(f"{x} delta" for x in suites) + " |",
             "| --- | --- | --- | ---: | ---: | ---: | " + " | ".join("---" for _ in suites) + " |"]
    for p in points:
        single = (p.get("routing") or {}).get("single_ratio")
        cells = [f"{v['delta'] * 100:+.2f} ({v['flips']['right_to_wrong']}/{v['flips']['wrong_to_right']}, "
                 f"{v['mcnemar_p']:.2g})" for v in p["suites"].values()]
        lines.append(f"| {p['budget']} | {p['method']} | {p['knob_name']} {p['knob']} | {p['miss_rate']:.3f} | "
                     f"{p['bytes_per_token'] / 1e3:.1f} | {'-' if single is None else f'{single:.3f}'} | "
                     + " | ".join(cells) + " |")
    for budget, g in (study.get("goals") or {}).items():
        prior, gate, dyn = g["cache_prior"]["best"], g["gating"]["best"], g["dynamic_precision"]["best"]
        lines += ["", f"Goals at {budget} (the best point within 0.5 point on every suite):",
                  f"- cache prior halves the miss rate: exact {g['cache_prior']['exact_miss_rate']:.3f}, "
                  + (f"lambda {prior['lambda']} {prior['miss_rate']:.3f} ({'met' if prior['met'] else 'missed'})"
                     if prior else "no point within 0.5 point"),
                  "- gating takes >= 25% single-expert decisions: "
                  + (f"target {gate['target']}: {gate['single']:.3f} ({'met' if gate['met'] else 'missed'})"
                     if gate and gate["single"] is not None else "no point within 0.5 point"),
                  "- dynamic precision reads >= 1.2x fewer bytes: "
                  + (f"split {dyn['split']}: {dyn['ratio']:.2f}x ({'met' if dyn['met'] else 'missed'})"
                     if dyn and dyn["ratio"] else "no point within 0.5 point")]
    return "\n".join(lines) + "\n"


def study_plot(study: dict) -> bytes:
    """Worst suite delta against miss rate, one panel per budget, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = study["budgets"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(6 * len(budgets), 4.2), squeeze=False)
    for ax, budget in zip(axes[0], budgets, strict=True):
        pts = [p for p in study["points"] if p["budget"] == budget]
        for method in dict.fromkeys(p["method"] for p in pts):
            mine = [p for p in pts if p["method"] == method]
            xs = [p["miss_rate"] for p in mine]
            ys = [min(s["delta"] for s in p["suites"].values()) * 100 for p in mine]
            ax.plot(xs, ys, marker="o", linestyle="-" if len(mine) > 1 else "none", label=method)
        ax.axhline(-0.5, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xlabel("miss rate (simulator, decode)")
        ax.set_ylabel("worst suite delta (points)")
        ax.set_title(f"per-layer cache at {budget}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return figure_png(fig)


def merge_into(artifact: str | Path, study: dict, png: bytes) -> None:
    """``routing_curves`` into the artifact's report.json (per method, its points), report.md and the plot."""

    curves: dict = {}
    for p in study["points"]:
        curves.setdefault(p["method"], []).append({
            "budget": p["budget"], "knob": p["knob"], "knob_name": p["knob_name"], "miss_rate": p["miss_rate"],
            "bytes_per_token": p["bytes_per_token"], "deltas": {k: v["delta"] for k, v in p["suites"].items()}})
    section = {"routing_curves": curves, "routing_study": {k: study[k] for k in ("recipe", "settings", "budgets", "goals")
                                                           if k in study} | {"markdown": study_markdown(study)}}
    merge_section(artifact, section, REPORT, files={ROUTING_PLOT: png})
