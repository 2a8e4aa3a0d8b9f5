"""The shipped artifact's accuracy resolved to one point (``moeprep accuracy``, ``make accuracy``).

The accuracy check of ``prepare`` scores a few hundred items per suite: enough to see a large loss, too few to say
that a delta of a point is a point. This sizes each suite from the flips that check measured (``power.
items_to_resolve``: the items McNemar's test needs to find a one-point difference), makes that many held-out items
with the reference model's own generator (``write_extended_suites``; GSM8K, which generates text and is the slow
suite, capped at what the run can afford), scores the artifact against its source on them (``evaluate_artifact``)
and states per suite the delta with its 95% interval: the interval within one point of none is what "resolved"
means here. The figures go to accuracy.json and accuracy.md in the work directory and, as ``resolved_accuracy``,
into the artifact's report.json and report.md (beside the check, which keeps its own figures).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from loader.format import read_manifest
from loader.io import write_json_atomic, write_text_atomic
from prep.errors import MoeprepError
from prep.evals.compare import evaluate_artifact, interval_text, writable
from prep.evals.data import SUITES
from prep.evals.power import ALPHA, POWER, detectable_difference, items_to_resolve, paired_verdict
from prep.report import ReportLayout, current_report, merge_section

GSM8K_ITEMS = 200  # GSM8K's cap by default: with MMLU and TruthfulQA sized from the shipped check, ~30 min on 2 cores
SEED = 2026  # the held-out generator's seed (``moeprep reference-suites``' default), not the training seed
DIFFERENCE = 0.01  # one point
SIZED_BY = {"gsm8k": "gsm8k", "mmlu": "mmlu", "truthfulqa": "truthfulqa_mc1"}  # the row whose flips size a suite
EXTENSION = "extension.json"  # what write_extended_suites writes last into the suites it makes


def items_needed(eval_suites: dict, difference: float = DIFFERENCE) -> dict[str, int | None]:
    """Per suite (gsm8k, mmlu, truthfulqa) the items that resolve ``difference`` (power 0.8, alpha 0.05) at the flip
    rate report.json's ``eval`` measured on it; None for a suite not checked or with no flips (noise unknown)."""
    needed = {}
    for suite, row in SIZED_BY.items():
        s = eval_suites.get(row)
        flipped = s and s["flips"]["right_to_wrong"] + s["flips"]["wrong_to_right"]
        needed[suite] = items_to_resolve(flipped / s["n"], difference) if flipped else None
    return needed


def suite_sizes(eval_suites: dict, gsm8k_cap: int, overrides: dict[str, int | None] | None = None) -> dict[str, int]:
    """Items to score per suite: an override where given, else the items needed, else (no flips seen, nothing to
    size from) as many as the check scored; GSM8K at most ``gsm8k_cap``. Suites the check left out and no override
    names are left out."""
    needed, overrides = items_needed(eval_suites), overrides or {}
    sizes = {}
    for suite, row in SIZED_BY.items():
        if row in eval_suites or overrides.get(suite):
            n = overrides.get(suite) or needed[suite] or eval_suites[row]["n"]
            sizes[suite] = min(n, gsm8k_cap) if suite == "gsm8k" else n
    return sizes


def _counts(directory: Path) -> dict[str, int]:
    return {name: sum(1 for line in (directory / f"{name}.jsonl").read_text().splitlines() if line.strip())
            for name in SUITES if (directory / f"{name}.jsonl").is_file()}


def extended_suites(ref_dir: Path, out: Path, sizes: dict[str, int], seed: int = SEED) -> tuple[dict[str, int], bool]:
    """``out`` holding at least ``sizes`` items per suite: the shipped suites of ``ref_dir`` with held-out items of
    its generator appended (``write_extended_suites``, written whole or not at all). A directory already holding
    enough items from ``seed`` is kept. Returns the items per suite there and whether they were made now."""
    from prep.reference.train import write_extended_suites

    if (out / EXTENSION).is_file():
        try:
            made = json.loads((out / EXTENSION).read_text())
            made_with = (made["seed"], made["training_seed"])
            trained_with = json.loads((ref_dir / "training.json").read_text())["spec"]["seed"]
        except (OSError, ValueError, KeyError, TypeError):
            made_with = trained_with = None
        have = _counts(out)
        if made_with == (seed, trained_with) and all(have.get(name, 0) >= n for name, n in sizes.items()):
            return have, False
    shipped = _counts(ref_dir / "suites")
    write_extended_suites(ref_dir, out, seed, {name: max(0, n - shipped.get(name, 0)) for name, n in sizes.items()})
    have = _counts(out)
    if short := {name: (have.get(name, 0), n) for name, n in sizes.items() if have.get(name, 0) < n}:
        raise MoeprepError(f"the reference generator made too few held-out items (have, asked): {short}; ask for "
                           "fewer with --gsm8k/--mmlu/--truthfulqa")
    return have, True


def _row(suite: str, s: dict, needed: int | None) -> dict:
    """One suite's resolved figures from its eval row: the paired verdict and what its n resolves."""
    t = paired_verdict(s["delta"], s["flips"], s["n"], s["mcnemar_p"], None, interval=s.get("delta_interval"))
    detectable = detectable_difference(t["flip_rate"], s["n"])
    return {"n": s["n"], "delta_points": t["delta_points"], "interval_points": t["interval_points"],
            "mcnemar_p": s["mcnemar_p"], "flips": s["flips"], "resolution_points": t["resolution_points"],
            "resolved_to_one_point": t["resolved_to_one_point"], "items_for_one_point": t["items_for_one_point"],
            "sized_for_one_point": needed, "resolves_points": None if detectable is None else 100 * detectable}


def resolve_accuracy(artifact: str | Path, work: str | Path | None = None, data: str | Path | None = None,
                     original: str | Path | None = None, gsm8k: int = GSM8K_ITEMS,
                     overrides: dict[str, int | None] | None = None, memory_budget: str | None = None,
                     seed: int = SEED, layout: ReportLayout | None = None,
                     say: Callable[[str], None] = print, device: str = "cpu",
                     suites: tuple[str, ...] | None = None) -> dict:
    """Resolve ``artifact``'s accuracy to one point and return the ``resolved_accuracy`` entry merged into its
    report.json (report.md rendered again with ``layout``, the stage table's sections).

    ``work``: where the generated suites (``suites/``), the original's per-item results (``original/``, so it is
    scored once), eval.json, accuracy.json and accuracy.md go (default: ``accuracy/`` beside the artifact).
    ``data``: suites to score instead of generating (an artifact not prepared from the reference model needs it).
    ``gsm8k``: GSM8K's cap; ``overrides``: items per suite instead of the sizing (a smaller run, a test).
    ``memory_budget``: the loader's for the prepared model (default: the one the check ran at); ``device``: where both
    models run; ``suites``: only these (default: every suite the check scored)."""
    manifest = read_manifest(artifact)
    report = current_report(manifest)  # an altered report.json is refused now, not after the evaluation
    check = report.get("eval") or {}
    given = {k for k, v in (overrides or {}).items() if v}
    if not check.get("suites") and not (suites is not None and set(suites) <= given):
        raise MoeprepError(f"{manifest.root} has no accuracy check in its report.json (no eval entry) to size the "
                           "suites from; run `make prepare` (with evaluate enabled) or `moeprep eval --artifact "
                           f"{artifact}` first (or name each suite's items: --suites with --mmlu/--truthfulqa)")
    if gsm8k < 1:
        raise MoeprepError(f"--gsm8k must be at least 1 item, got {gsm8k}")
    work = Path(work) if work is not None else manifest.root.parent / "accuracy"
    original = Path(original or manifest.raw["source_model"]["path"])
    sizes = suite_sizes(check.get("suites") or {}, gsm8k, overrides)
    if suites is not None:
        if unknown := sorted(set(suites) - set(SIZED_BY)):
            raise MoeprepError(f"unknown suite(s) {unknown}; use {', '.join(SIZED_BY)}")
        sizes = {name: n for name, n in sizes.items() if name in suites}
    writable(work, manifest.root)
    if data is None:
        ref_dir = original.parent
        if not ((ref_dir / "training.json").is_file() and (ref_dir / "suites").is_dir()):
            raise MoeprepError(f"{original} is not the reference model (no training.json and suites/ beside it), "
                               "whose generator makes more held-out items; pass --data with suites holding enough "
                               f"items ({', '.join(f'{k} {v}' for k, v in sizes.items())})")
        data = work / "suites"
        say(f"held-out suites: {', '.join(f'{k} {v}' for k, v in sizes.items())} items into {data}")
        have, made = extended_suites(ref_dir, data, sizes, seed)
        say(("made" if made else "reusing") + f" {data} ({', '.join(f'{k} {v}' for k, v in have.items())} items)")
    budget = memory_budget if memory_budget is not None else check.get("memory_budget")
    say(f"scoring the artifact against {original} (budget {budget or 'the plan default'}); the original's rows are "
        f"kept in {work / 'original'}")
    scored = evaluate_artifact(manifest.root, original, tuple(sizes), data, limit=sizes, memory_budget=budget,
                               output=work / "eval.json", reuse_original=work / "original", merge=False,
                               device=device)
    needed = items_needed(check.get("suites") or {})
    entry = {"suites": {name: _row(name, s, needed.get(name.split("_")[0]))
                        for name, s in scored["suites"].items()},
             "data": scored["data"], "memory_budget": budget, "difference_points": 100 * DIFFERENCE,
             "alpha": ALPHA, "power": POWER, "gsm8k_cap": gsm8k, "interval": "95%, Agresti-Min adjusted Wald",
             "items_for_one_point": needed, "overridden": sorted(k for k, v in (overrides or {}).items() if v),
             "sized_from": {name: {"n": s["n"], "flips": s["flips"]} for name, s in (check.get("suites") or {}).items()}}
    write_json_atomic(work / "accuracy.json", entry)
    write_text_atomic(work / "accuracy.md", resolved_markdown({"resolved_accuracy": entry}) + "\n")
    merge_section(manifest.root, {"resolved_accuracy": entry}, layout, package_key=manifest.raw["package_key"])
    return entry


def resolved_markdown(report: dict) -> str:
    """report.json's ``resolved_accuracy`` as a table: per suite n, the delta and its 95% interval, McNemar's p,
    points per item, whether the interval lies within one point, and what n resolves (power 0.8)."""
    r = report["resolved_accuracy"]
    sized = ", ".join(f"{k} {v if v is not None else 'unknown (no flips)'}"
                      for k, v in (r.get("items_for_one_point") or {}).items())
    lines = ["## Accuracy resolved to one point", "",
             "The accuracy check again on more held-out items (`moeprep accuracy`): each suite sized from the flips "
             f"the check measured to resolve a one-point difference (alpha 0.05, power 0.8: {sized} items), GSM8K "
             f"capped at {r['gsm8k_cap']} items (it generates text)"
             + (f", {' and '.join(r['overridden'])} set by hand" if r.get("overridden") else "") + ". "
             "The interval is the delta's 95% interval from the flips (Agresti-Min; for truthfulqa_mc2, a mean of "
             "true-answer masses, that of the mean per-item difference, while its p counts the items whose mass "
             "crosses one half); within +-1 point means the whole interval "
             "lies within one point of none. The last column is the smallest difference n items find at the flip "
             "rate measured here.", "",
             "| suite | n | delta (points) | 95% interval (points) | McNemar p | points per item | within +-1 point | "
             "resolves (power 0.8) |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for name, s in r["suites"].items():
        if s["resolves_points"] is not None:
            resolves = f"{s['resolves_points']:.2f} points at {s['n']} items"
        else:
            resolves = "no flips seen" if not sum(s["flips"].values()) else f"no difference at {s['n']} items"
        lines.append(f"| {name} | {s['n']} | {s['delta_points']:+.2f} | {interval_text(s['interval_points'])} | "
                     f"{s['mcnemar_p']:.3g} | {s['resolution_points']:.3f} | "
                     f"{'yes' if s['resolved_to_one_point'] else '**no**'} | {resolves} |")
    return "\n".join(lines)
