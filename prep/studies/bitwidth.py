"""The bit-width study: one recipe prepared at every bit-width configuration, each
artifact compared with the original model on the suites, and a table and a plot of divergence and accuracy
against bits per weight.

Each row also carries its artifact's divergence from the source on held-out text (the ``divergence`` stage's
entry in its report.json: mean KL with its 95% interval, the same-top-token share, the perplexity ratio), and
the study asks whether that cheap figure orders the rows as the suites do: Spearman's rho between mean KL and
each suite's delta across the rows, with a permutation p-value (``spearman``).

Rows share the recipe's stage cache, so the trace, the quantized stores and the sensitivity sweep are
computed once; the original model's per-item results are computed once too (``reuse_original``).

Each row (its ``prepare``, with the local executor, then its evaluation) is one work unit (``study_row``,
``prep/executor.py``) writing its result to ``rows/<slug>/row.json``, so rows run side by side on a Ray
cluster (``--executor ray``); the random control, whose share depends on the middle ``edgemoe`` row's result,
is a second map after the first. Rows share one recipe name, whose lock admits one ``prepare`` at a time, so
a row waits for its turn to prepare (``rows/.prepare.lock``) and evaluates in parallel with the others. A
rerun keeps a row evaluated before with the same package key and eval settings (its row file is moved
to ``previous.json`` first, since only the row's ``prepare`` knows its package key), so an interrupted
study resumes; ``study.json`` is written after each map.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import math
import re
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from loader.io import write_json_atomic
from loader.vocab import BITS
from prep.errors import MoeprepError
from prep.evals.compare import evaluate_artifact
from prep.evals.data import SUITES
from prep.evals.power import suite_interval
from prep.executor import Unit, UnitPaths, executor_overrides, make_executor
from prep.pipeline import prepare
from prep.recipe import load_recipe, recipe_from_dict
from prep.report import BITWIDTH_PLOT, merge_section
from prep.stages.table import REPORT
from prep.studies.common import figure_png, write_outputs

PRECISIONS = tuple(BITS)  # the quantized precisions, highest first
GOAL_COMPRESSION = 5.0  # expert bytes against bfloat16: 3.2 bits per weight
DEFAULT_TOLERANCES = (0.0015, 0.002, 0.003, 0.004, 0.005)  # on the reference recipe: 3.49 to 3.07 bits per weight
GOAL_DELTA = 0.01  # |accuracy delta| on every suite: one point
SUITE_METRIC = {"gsm8k": "strict_match"}  # the others: acc


def within_one_point(row: dict) -> bool:
    """|delta| <= GOAL_DELTA on every suite (rounded, so 3 items of 300 is one point, not a float's hair more)."""
    return all(round(abs(s["delta"]), 9) <= GOAL_DELTA for s in row["suites"].values())


def delta_interval(suite: dict) -> tuple[float, float]:
    """The 95% interval (shares) of a suite's paired delta (``prep.evals.power.suite_interval``)."""
    return suite_interval(suite)


def resolved_within_one_point(row: dict) -> bool:
    """Every suite's 95% interval on the delta lies inside +-GOAL_DELTA: the difference is resolved to under one
    point, not only estimated there (a delta of 0 on 300 items with 28 flips has an interval of +-3 points)."""
    return all(-GOAL_DELTA - 1e-9 <= low and high <= GOAL_DELTA + 1e-9
               for low, high in map(delta_interval, row["suites"].values()))


def meets_goal(row: dict) -> bool:
    """The goal: >= GOAL_COMPRESSION against bfloat16 with every suite resolved within one point."""
    return row["compression_bfloat16"] >= GOAL_COMPRESSION and resolved_within_one_point(row)


@dataclass(frozen=True)
class Row:
    """One configuration: a label and the ``section.key=value`` overrides that make it from the recipe."""

    label: str
    overrides: tuple[str, ...]

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.label.lower()).strip("-")


def study_rows(tolerances: tuple[float, ...], shares: tuple[float, ...]) -> list[Row]:
    """Uniform precisions, ``edgemoe`` at each tolerance, ``frequency`` at each share (the random control
    is added by ``run_study`` once the middle ``edgemoe`` row says how many experts it moved)."""
    rows = [Row(f"uniform {p}", (f"quantize.precision={p}", "quantize.also=[]", "bitwidth.method=uniform"))
            for p in PRECISIONS]
    mixed = ("quantize.precision=int4", "quantize.also=[int8, int3, int2]")
    rows += [Row(f"edgemoe P={t:g}", (*mixed, "bitwidth.method=edgemoe", f"bitwidth.tolerance={t}"))
             for t in tolerances]
    rows += [Row(f"frequency q={q:.0%}", ("quantize.precision=int4", "quantize.also=[int2]",
                                          "bitwidth.method=frequency", f"bitwidth.share={q}", "bitwidth.low=int2"))
             for q in shares]
    return rows


def random_control(edgemoe: dict, num_experts_total: int) -> Row:
    """The random row: exactly as many experts at each precision as the ``edgemoe`` row, drawn at random."""
    bw = edgemoe["bitwidth"]
    hi, lo, k = bw["b_hi"], bw.get("b_lo"), bw.get("K", 0)
    if lo is None or not k:  # edgemoe moved nobody: the control is the same uniform precision
        lo, k = hi, 0
    also = f"quantize.also=[{lo}]" if lo != hi else "quantize.also=[]"
    return Row(f"random (bytes of {edgemoe['label']})",
               (f"quantize.precision={hi}", also, "bitwidth.method=random", f"bitwidth.share={k / num_experts_total!r}",
                f"bitwidth.low={lo}", "bitwidth.seed=0"))


DIVERGENCE_FIGURES = ("mean_kl", "top_token_agreement", "ppl_ratio")  # each {"value", "low", "high"}


def row_divergence(report: dict) -> dict | None:
    """The row artifact's divergence from its source (report.json's ``divergence``, written by the ``divergence``
    stage): the figures the study tabulates with their intervals and what they rest on; None when the recipe
    switched the stage off."""
    entry = report.get("divergence")
    if not entry:
        return None
    return {"stats": {name: entry["stats"][name] for name in DIVERGENCE_FIGURES},
            **{k: entry.get(k) for k in ("tokens", "sequences", "level", "memory_budget")}}


def _ranks(values: np.ndarray) -> np.ndarray:
    """Ranks from 1, ties sharing the average of the ranks they span."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(len(values))
    ordered = values[order]
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or ordered[end] != ordered[start]:
            ranks[order[start:end]] = (start + end + 1) / 2  # the mean of ranks start+1 .. end
            start = end
    return ranks


def _pearson_rows(x: np.ndarray, ys: np.ndarray) -> np.ndarray:
    """Pearson's r of ``x`` [n] with each row of ``ys`` [m, n]."""
    xc = x - x.mean()
    yc = ys - ys.mean(axis=-1, keepdims=True)
    return (yc @ xc) / (np.sqrt((yc ** 2).sum(axis=-1)) * np.sqrt((xc ** 2).sum()))


EXACT_UP_TO = 8  # rows: up to 8! = 40,320 orderings are enumerated, more are sampled
PERMUTATIONS = 20_000  # Monte Carlo orderings above EXACT_UP_TO


def spearman(x: Sequence[float], y: Sequence[float], *, permutations: int = PERMUTATIONS, seed: int = 0,
             exact_up_to: int = EXACT_UP_TO) -> dict:
    """Spearman's rho of ``x`` and ``y`` (Pearson's r of their average ranks, so ties are handled) and its two-sided
    p-value under the null of no association: the share of orderings of ``y``'s ranks whose |rho| is at least the
    observed one. Every one of the n! orderings for n <= ``exact_up_to`` (``method`` "exact"); above, ``permutations``
    seeded random ones and p = (hits + 1) / (permutations + 1), which never reports 0 (``method`` "monte carlo").
    Returns {"rho", "p", "n", "method"}; rho and p are None with fewer than 2 pairs or a constant side.
    Written here since scipy is not a dependency (scipy.stats.spearmanr with a permutation test gives the same)."""
    xs, ys = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if xs.shape != ys.shape or xs.ndim != 1:
        raise ValueError(f"spearman needs two sequences of one length, got {xs.shape} and {ys.shape}")
    n = len(xs)
    if n < 2 or np.ptp(xs) == 0 or np.ptp(ys) == 0:
        return {"rho": None, "p": None, "n": n, "method": None}
    rx, ry = _ranks(xs), _ranks(ys)
    rho = float(_pearson_rows(rx, ry[None, :])[0])
    rho = max(-1.0, min(1.0, rho))
    if n <= exact_up_to:
        orderings = ry[np.array(list(itertools.permutations(range(n))))]  # [n!, n]
    else:
        orderings = np.random.default_rng(seed).permuted(np.tile(ry, (permutations, 1)), axis=1)
    hits = int((np.abs(_pearson_rows(rx, orderings)) >= abs(rho) - 1e-12).sum())  # float noise must not drop a tie
    if n <= exact_up_to:
        p, method = hits / math.factorial(n), "exact"
    else:
        p, method = (hits + 1) / (permutations + 1), f"monte carlo, {permutations} permutations, seed {seed}"
    return {"rho": round(rho, 6), "p": p, "n": n, "method": method}


def kl_vs_suites(rows: list[dict]) -> dict:
    """Per suite: Spearman's rho between the rows' mean KL and their delta on that suite, over the rows whose
    divergence was measured (``spearman``'s dict)."""
    measured = [r for r in rows if r.get("divergence")]
    suites = list(rows[0]["suites"]) if rows else []
    kl = [r["divergence"]["stats"]["mean_kl"]["value"] for r in measured]
    return {suite: spearman(kl, [r["suites"][suite]["delta"] for r in measured]) for suite in suites}


def _row_result(row: Row, artifact: Path, report: dict, evaluation: dict, settings: dict) -> dict:
    manifest = json.loads((artifact / "manifest.json").read_text())
    suites = {}
    for name, s in evaluation["suites"].items():
        key = SUITE_METRIC.get(name, "acc")
        suites[name] = {"n": s["n"], "original": s["original"][key], "prepared": s["prepared"][key],
                        "delta": s["delta"], "flips": s["flips"], "mcnemar_p": s["mcnemar_p"],
                        **({"delta_interval": s["delta_interval"]} if "delta_interval" in s else {})}
    compression = report["compression"]["bfloat16"]
    row_result = {
        "label": row.label, "overrides": list(row.overrides), "package_key": manifest["package_key"],
        "settings": settings, "bitwidth": report["bitwidth"], "experts": report["bitwidth"]["experts"],
        "expert_bytes": report["sizes"]["expert_bytes"], "compression_bfloat16": compression,
        "bits_per_weight": round(16 / compression, 3), "divergence": row_divergence(report), "suites": suites,
    }
    return row_result | {"meets_goal": meets_goal(row_result)}


STUDY = "bitwidth-study"  # the executor's name for the row units (their seeds derive from it)
ROW = "row.json"  # a row's result, written by its unit
PREVIOUS = "previous.json"  # a row's result from the run before, kept when its package key and settings still match


@contextmanager
def _prepare_turn(output: Path) -> Iterator[None]:
    """Hold the study's prepare lock: rows share the recipe's stage cache, whose own lock refuses a second
    ``prepare`` at once, so rows running side by side wait here for their turn (a blocking ``flock``)."""
    path = Path(output) / "rows" / ".prepare.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def study_row(context, out: Path, *, label: str, overrides: list, base: dict, root: str, output: str,
              settings: dict, data: str | None) -> None:
    """One unit: prepare the row's artifact (``rows/<slug>/artifact``, local executor; its divergence measured at the
    study's ``memory_budget`` when one is given) and write its result to
    ``out``: the previous result (``rows/<slug>/previous.json``) when its package key and eval settings match,
    else a new evaluation against the original model."""
    row = Row(label, tuple(overrides))
    # the row's divergence at the budget its suites run at: with cache-conditional routing both depend on it
    budget = (f"divergence.memory_budget={settings['memory_budget']}",) if settings["memory_budget"] else ()
    recipe = recipe_from_dict(base, ("evaluate.enabled=false", *budget, *row.overrides))
    directory = Path(output) / "rows" / row.slug
    artifact = directory / "artifact"
    with _prepare_turn(output):
        prepare(recipe, root=root, output=artifact)
    report = json.loads((artifact / "report.json").read_text())
    key = json.loads((artifact / "manifest.json").read_text())["package_key"]
    done = json.loads((directory / PREVIOUS).read_text()) if (directory / PREVIOUS).is_file() else None
    if done is not None and done["package_key"] == key and done["settings"] == settings:
        # the divergence is read again: its stage runs after package, so a kept row may predate or outlive it
        result = done | {"divergence": row_divergence(report), "meets_goal": meets_goal(done)}
    else:
        evaluation = evaluate_artifact(artifact, recipe.model_path(Path(root)), suites=tuple(settings["suites"]),
                                       data=data, limit=settings["limit"], memory_budget=settings["memory_budget"],
                                       reuse_original=Path(output) / "original", output=directory / "eval.json")
        result = _row_result(row, artifact, report, evaluation, settings)
    write_json_atomic(out, result)


def _set_aside(output: Path, rows: list[Row], study_rows: dict) -> None:
    """Before a map: each row's result from the run before becomes its ``previous.json`` (its ``row.json``, or for a
    study made before rows were units, its entry of ``study.json``), so its unit runs and decides whether to keep it."""
    for row in rows:
        directory = output / "rows" / row.slug
        if (directory / ROW).is_file():
            (directory / ROW).replace(directory / PREVIOUS)
        elif row.label in study_rows and not (directory / PREVIOUS).is_file():
            directory.mkdir(parents=True, exist_ok=True)
            write_json_atomic(directory / PREVIOUS, study_rows[row.label])


def run_study(recipe_path: str | Path, output: str | Path, root: str | Path = ".", *,
              tolerances: tuple[float, ...] = DEFAULT_TOLERANCES, shares: tuple[float, ...] = (0.25, 0.5), middle: int | None = None,
              suites: tuple[str, ...] = SUITES, limit: int | None = None,
              data: str | Path | None = None, memory_budget: str | None = None, executor: str | None = None,
              ray_address: str | None = None, echo=print) -> dict:
    """Prepare and evaluate every row, one unit each; writes ``study.json``, ``study.md`` and ``study.png`` under
    ``output``. ``executor``/``ray_address``: where the rows run (``local``, one after another in this process,
    or ``ray``), over the recipe's ``executor`` section like ``moeprep prepare --executor``."""

    if not tolerances:
        raise MoeprepError("the study needs at least one edgemoe tolerance (--tolerances 0.01,0.03,0.1)")
    output, root = Path(output).resolve(), Path(root).resolve()
    chosen = executor_overrides(executor, ray_address)
    loaded = load_recipe(recipe_path, chosen)
    base = loaded.to_dict()
    base.pop("bitwidth")  # each row sets its method; the recipe's own choice (and knobs) must not leak in
    base.pop("executor")  # a row's own prepare runs in its unit, with the local executor
    path = output / "study.json"
    previous = {r["label"]: r for r in json.loads(path.read_text())["rows"]} if path.is_file() else {}
    settings = {"suites": list(suites), "limit": limit, "data": str(data) if data else None,
                "memory_budget": memory_budget}
    rows = study_rows(tuple(tolerances), tuple(shares))
    middle_label = f"edgemoe P={sorted(tolerances)[len(tolerances) // 2 if middle is None else middle]:g}"
    study = {"recipe": str(recipe_path), "settings": settings, "goal": {"compression_bfloat16": GOAL_COMPRESSION,
                                                                         "abs_delta": GOAL_DELTA}, "rows": []}
    shared = {"base": base, "root": str(root), "output": str(output), "settings": settings,
              "data": str(Path(data).resolve()) if data else None}
    paths = UnitPaths(model_dir=str(Path(loaded.model_path(root)).resolve()))
    runner = make_executor(loaded.executor)
    started = time.perf_counter()

    def run_rows(batch: list[Row]) -> list[dict]:
        """One map: every row of ``batch`` as a unit; their results, in order."""
        _set_aside(output, batch, previous)
        echo(f"{len(batch)} row(s) on the {runner.kind} executor: " + ", ".join(r.label for r in batch))
        units = [Unit(name=row.slug, output=f"rows/{row.slug}/{ROW}", fn=study_row,
                      args={"label": row.label, "overrides": list(row.overrides), **shared}) for row in batch]
        runner.map(STUDY, units, output, paths, desc="bitwidth study")
        results = []
        for row in batch:
            directory = output / "rows" / row.slug
            result = json.loads((directory / ROW).read_text())
            kept = (directory / PREVIOUS).is_file() and json.loads((directory / PREVIOUS).read_text()) == result
            echo(f"{row.label}: {'evaluated before, kept' if kept else 'prepared and evaluated'}")
            (directory / PREVIOUS).unlink(missing_ok=True)
            results.append(result)
        return results

    try:
        study["rows"] = run_rows(rows)
        write_json_atomic(path, study)
        at = next(i for i, r in enumerate(study["rows"]) if r["label"] == middle_label)
        middle_row = study["rows"][at]
        control = random_control(middle_row, sum(middle_row["experts"].values()))
        study["rows"].insert(at + 1, run_rows([control])[0])
    finally:
        runner.close()
    results = study["rows"]
    study["best"] = best_row(results)
    study["best_resolved"] = best_row(results, resolved_within_one_point)
    study["kl_vs_suites"] = kl_vs_suites(results)
    study["sensitivity"] = next((r["bitwidth"]["sensitivity"] for r in results
                                 if r["bitwidth"].get("sensitivity")), None)
    study["seconds"] = round(time.perf_counter() - started, 1)
    write_outputs(output, study, study_markdown(study), study_plot(study))
    return study


def best_row(rows: list[dict], within_goal=within_one_point) -> dict | None:
    """The fewest expert bytes among the rows ``within_goal`` (by default: every delta within one point; with
    ``resolved_within_one_point``, every 95% interval), and how it stands against uniform int4 (the default before
    this study). The random row is a control, never a candidate: its luck on one draw of the suites says nothing
    about the next model."""
    within = [r for r in rows if r["bitwidth"]["method"] != "random" and within_goal(r)]
    if not within:
        return None
    best = min(within, key=lambda r: (r["expert_bytes"], r["label"]))
    int4 = next((r for r in rows if r["label"] == "uniform int4"), None)
    return {"label": best["label"], "expert_bytes": best["expert_bytes"],
            "compression_bfloat16": best["compression_bfloat16"], "meets_goal": best["meets_goal"],
            "fewer_bytes_than_uniform_int4": int4 is not None and best["expert_bytes"] < int4["expert_bytes"]}


def _kl_cell(divergence: dict | None) -> str:
    if not divergence:
        return "-"
    kl = divergence["stats"]["mean_kl"]
    return f"{kl['value']:.3g} [{kl['low']:.3g}, {kl['high']:.3g}]"


def _agreement_cell(divergence: dict | None) -> str:
    return "-" if not divergence else f"{divergence['stats']['top_token_agreement']['value']:.2%}"


def kl_vs_suites_sentence(correlations: dict) -> str | None:
    """study.md's sentence on whether mean KL orders the rows as each suite's delta does."""
    measured = {suite: c for suite, c in correlations.items() if c["rho"] is not None}
    if not measured:
        return None
    n = next(iter(measured.values()))["n"]
    method = next(iter(measured.values()))["method"]
    test = (f"an exact permutation test over all {math.factorial(n):,} orderings" if method == "exact"
            else f"a Monte Carlo permutation test ({method}; p = (hits + 1) / (permutations + 1))")
    pairs = "; ".join(f"{suite} rho {c['rho']:+.2f} (p {c['p']:.2g})" for suite, c in measured.items())
    still = [suite for suite in correlations if suite not in measured]
    return (f"- Does mean KL order the rows as the suites do? Spearman's rho between mean KL and each suite's delta "
            f"across the {n} rows with a divergence: {pairs}; two-sided, {test}. A negative rho: the further a row "
            "is from the source, the more accuracy it loses."
            + (f" No rho for {', '.join(still)}: its delta is the same on every row." if still else ""))


def study_markdown(study: dict) -> str:
    rows = study["rows"]
    suites = list(rows[0]["suites"]) if rows else []
    limit = study["settings"]["limit"]
    n = {name: rows[0]["suites"][name]["n"] for name in suites} if rows else {}
    measured = next((r["divergence"] for r in rows if r.get("divergence")), None)
    held_out = (f"on {measured['sequences']} held-out sequences ({measured['tokens']:,} tokens) after the calibration "
                "text" if measured else "on held-out text")
    lines = ["## Bit-width study", "",
             f"Recipe `{study['recipe']}`; every row compared with the original model on the same items "
             f"({', '.join(f'{k} n={v}' for k, v in n.items())}{'' if limit is None else f', first {limit} of each'}). "
             f"Goal: expert compression >= {GOAL_COMPRESSION}x against bfloat16 ({16 / GOAL_COMPRESSION:g} bits per "
             f"weight) with every suite's 95% interval on the delta inside +-{GOAL_DELTA * 100:g} point (Agresti-Min, from "
             "the flips: resolved, not only estimated). Delta in points [95% interval]; flips right->wrong / "
             "wrong->right. Mean KL [95% interval] and same top token: the artifact's next-token "
             f"divergence from the source {held_out} (its report.json's `divergence`; - where the recipe switched "
             "it off). Search KL: the bitwidth stage's mean next-token KL on the last calibration sequences, the "
             "figure its tolerance bounds (not measured for uniform rows, whose stage is off).", "",
             "| row | experts per precision | expert MiB | x bf16 | bits/w | mean KL [95%] | same top token | search KL | "
             + " | ".join(f"{s} delta [95%] (flips, p)" for s in suites) + " | goal |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in suites) + " | --- |"]
    for r in rows:
        mix = ", ".join(f"{p} {c}" for p, c in sorted(r["experts"].items(), key=lambda kv: PRECISIONS.index(kv[0])
                                                       if kv[0] in PRECISIONS else -1))
        cells = [f"{r['suites'][s]['delta'] * 100:+.2f} [{delta_interval(r['suites'][s])[0] * 100:+.1f}, "
                 f"{delta_interval(r['suites'][s])[1] * 100:+.1f}] ({r['suites'][s]['flips']['right_to_wrong']}/"
                 f"{r['suites'][s]['flips']['wrong_to_right']}, {r['suites'][s]['mcnemar_p']:.2g})" for s in suites]
        kl = r["bitwidth"].get("loss")
        divergence = r.get("divergence")
        lines.append(f"| {r['label']} | {mix} | {r['expert_bytes'] / 2**20:.2f} | {r['compression_bfloat16']:.2f} | "
                     f"{r['bits_per_weight']:.2f} | {_kl_cell(divergence)} | {_agreement_cell(divergence)} | "
                     f"{'-' if kl is None else f'{kl:.4f}'} | " + " | ".join(cells)
                     + f" | {'yes' if r['meets_goal'] else 'no'} |")
    lines.append("")
    for r in rows:
        bw = r["bitwidth"]
        if bw["method"] == "edgemoe":
            lines.append(f"- {r['label']}: b_hi {bw['b_hi']}, b_lo {bw['b_lo']}, K {bw['K']}, search KL "
                         f"{bw['loss']:.4g} (met: {bw['met']}); bounds "
                         + ", ".join(f"{p} {v:.4g}" for p, v in bw.get("bounds", {}).items()))
    if sentence := kl_vs_suites_sentence(study.get("kl_vs_suites") or {}):
        lines.append(sentence)
    if s := study.get("sensitivity"):
        # seconds: recorded by artifacts before issue 57, which keeps timings out of the artifact
        sec = s.get("seconds") or {}
        # one_forward: recorded by sweeps before the executor's units (issue 35), which no longer time it
        against = (f" against {sec['one_forward']:.2f} s for one calibration forward = "
                   f"{sec['sweep'] / sec['one_forward']:.0f}x one forward") if sec.get("one_forward") else ""
        timing = (f"{sec.get('sweep', 0):.1f} s{against}; the trace pre-rank took {sec['prerank']:.2f} s and its"
                  if "prerank" in sec else "its")
        lines.append(f"- Sensitivity sweep ({s['method']}, {s['sequences']} sequences, to {s['precision']}): "
                     f"{timing} Spearman correlation with the sweep is {s['spearman']}.")
    if best := study.get("best"):
        lines.append(f"- Best within one point (the random control excluded): **{best['label']}** ({best['compression_bfloat16']:.2f}x bfloat16; "
                     f"{'fewer' if best['fewer_bytes_than_uniform_int4'] else 'not fewer'} bytes than uniform int4).")
    elif "best" in study:
        lines.append("- No row stays within one point on every suite.")
    if best := study.get("best_resolved"):
        lines.append(f"- Best resolved within one point (every 95% interval inside +-1 point): **{best['label']}** "
                     f"({best['compression_bfloat16']:.2f}x bfloat16, {16 / best['compression_bfloat16']:.2f} bits per "
                     "weight).")
    elif "best_resolved" in study:
        lines.append("- No row is resolved within one point on every suite (each interval inside +-1 point): the "
                     "suites are too small or the rows too far from the source.")
    return "\n".join(lines) + "\n"


def study_plot(study: dict) -> bytes:
    """PNG, two panels against bits per weight: the mean KL from the source (log scale, 95% interval as error bars;
    rows without a divergence left out) and each suite's accuracy delta (points, one marker per suite); rows
    labelled, the goal's bits per weight dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = study["rows"]
    fig, (kl_ax, delta_ax) = plt.subplots(1, 2, figsize=(13, 5.5))
    goal_bits = 16 / GOAL_COMPRESSION
    measured = [r for r in rows if r.get("divergence") and r["divergence"]["stats"]["mean_kl"]["value"] > 0]
    if measured:
        kl = [r["divergence"]["stats"]["mean_kl"] for r in measured]
        kl_ax.errorbar([r["bits_per_weight"] for r in measured], [k["value"] for k in kl],
                       yerr=[[k["value"] - k["low"] for k in kl], [k["high"] - k["value"] for k in kl]],
                       fmt="o", capsize=3)
        for r, k in zip(measured, kl, strict=True):
            kl_ax.annotate(r["label"], (r["bits_per_weight"], k["value"]), fontsize=7, rotation=20,
                           textcoords="offset points", xytext=(4, 4))
        kl_ax.set_yscale("log")
    else:
        kl_ax.text(0.5, 0.5, "no divergence measured", ha="center", va="center", transform=kl_ax.transAxes)
    kl_ax.set_ylabel("mean next-token KL from the source (nats, 95% interval)")
    kl_ax.set_title("Divergence from the source on held-out text")

    suites = list(rows[0]["suites"]) if rows else []
    for marker, suite in zip("os^vDP", suites, strict=False):
        delta_ax.scatter([r["bits_per_weight"] for r in rows], [r["suites"][suite]["delta"] * 100 for r in rows],
                         marker=marker, label=suite, alpha=0.8)
    for r in rows:
        worst = min(r["suites"].values(), key=lambda s: s["delta"])["delta"] * 100
        delta_ax.annotate(r["label"], (r["bits_per_weight"], worst), fontsize=7, rotation=20,
                          textcoords="offset points", xytext=(3, -10))
    delta_ax.axhspan(-GOAL_DELTA * 100, GOAL_DELTA * 100, color="green", alpha=0.08, label="|delta| <= 1 point")
    delta_ax.axhline(0, color="black", linewidth=0.5)
    delta_ax.set_ylabel("accuracy delta against the original (points)")
    delta_ax.set_title("Accuracy on the suites")
    for ax in (kl_ax, delta_ax):
        ax.axvline(goal_bits, color="grey", linestyle="--", label=f"{GOAL_COMPRESSION:g}x bfloat16")
        ax.set_xlabel("expert bits per weight")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return figure_png(fig)


def merge_study_into(artifact: str | Path, study: dict) -> None:
    """The study into ``artifact``: report.json's ``bitwidth_study`` (with its markdown, the table) and its plot
    under ``reports/``, through the report (``prep.report.merge_section``)."""

    keep = ("label", "experts", "expert_bytes", "compression_bfloat16", "bits_per_weight", "suites", "meets_goal")
    summary = {k: study.get(k) for k in ("recipe", "settings", "goal", "best", "best_resolved", "sensitivity",
                                         "kl_vs_suites")}
    summary["rows"] = [{k: r[k] for k in keep} | {"divergence": r.get("divergence"),
                                                  "bitwidth": {k: v for k, v in r["bitwidth"].items()
                                                               if k not in ("trail", "sensitivity")}}
                       for r in study["rows"]]
    summary["markdown"] = study_markdown(study)
    merge_section(artifact, {"bitwidth_study": summary}, REPORT, files={BITWIDTH_PLOT: study_plot(study)})
