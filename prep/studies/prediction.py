"""The prediction study: an artifact's prefetch predictors replayed through the
simulator (the loader's own cache and predictor code) on fresh text, at several budgets, each predictor
alone and all of the plan's together, against no prediction.

The trace is recorded from the recipe's calibration source with another seed (``seed``), so the path
statistics and the first-layer gate are measured on text they were never fitted on. The simulator models a
prefetch as landing before its layer runs: a used prefetch turns a demand miss into a hit, a wasted one
costs bytes and can evict a record that would have hit. The modelled stall is the demand reads' time on
the device profile (``moeprep profile-device``); the prefetch reads' time is reported beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

from loader.plan import read_plan
from prep.errors import MoeprepError
from prep.methods.routing_stats import cross_fit_path_recall
from prep.methods.trace import MIXTRAL_TRACE_FILE, read_mixtral_traces
from prep.report import merge_section
from prep.sim.simulate import simulate_trace
from prep.stages.table import REPORT

PREDICTOR_ROWS = ("none", "next_gates", "path_stats", "first_gate", "plan")


def mixtral_recall(traces: str | Path | None) -> list[dict] | None:
    """EdgeMoE's path statistics on the real Mixtral-8x7B traces, fitted on one problem and measured on the
    other (None when the traces are not there)."""

    if traces is None or not any(p.is_file() for p in (Path(traces) / MIXTRAL_TRACE_FILE,
                                                         Path(traces) / "mixtral-8x7b" / MIXTRAL_TRACE_FILE)):
        return None
    return cross_fit_path_recall(read_mixtral_traces(traces), 8)


def bench_rows(bench: str | Path | None, subject: str) -> dict | None:
    """The prefetch rows of ``moeprep bench`` (bench.json) for ``subject``: naive, each predictor, the plan."""
    if bench is None:
        return None
    try:
        report = json.loads(Path(bench).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise MoeprepError(f"--bench {bench}: not a bench.json ({e}); run `moeprep bench` first") from None
    keep = ("budget", "system", "decode_tokens_per_s", "misses_per_token", "hit_rate", "stall_fraction", "prefetch")
    rows = [{k: r.get(k) for k in keep} for r in report.get("results", []) if r.get("subject") == subject
            and (r.get("system") in ("naive", "moeprep") or str(r.get("system")).startswith("naive+"))
            and not r.get("error")]
    if not rows:
        raise MoeprepError(f"--bench {bench} has no loader rows for subject {subject!r}; run `moeprep bench "
                           f"--subject {subject}`")
    return {"file": str(bench), "machine": report.get("machine"), "created": report.get("created"), "rows": rows}


def run_study(artifact: str | Path, trace: Path, budgets: list[str], profile=None, mixtral_traces=None,
              bench=None, subject: str | None = None) -> dict:
    """One simulation per (budget, predictor row); rows: no prediction, each planned predictor alone, all.
    With ``mixtral_traces``, also the path statistics' cross-fitted recall there; with ``bench`` (a
    bench.json), that run's prefetch rows for ``subject``."""

    planned = [s.name for s in read_plan(artifact).predictors]
    if not planned:
        raise MoeprepError(f"{artifact}'s plan has no predictors; prepare it with predict.predictors set")
    rows = []
    for budget in budgets:
        for name in PREDICTOR_ROWS:
            if name not in ("none", "plan") and name not in planned:
                continue
            _, [result] = simulate_trace(trace, plan=artifact, budget=budget, predictors=name, profile=profile)
            j = result.to_json()
            seconds = j["seconds"]
            rows.append({"budget": budget, "predictors": planned if name == "plan" else ([] if name == "none" else [name]),
                         "tokens": j["tokens"], "requests": j["requests"], "misses": j["misses"],
                         "miss_rate": j["miss_rate"], "bytes_read_per_token": j["bytes_read_per_token"],
                         "stall_seconds": seconds["read"] if seconds else None,
                         "prefetch_read_seconds": sum(x["prefetch_read_seconds"] for x in j["layers"]) if seconds else None,
                         **{k: j["prefetch"][k] for k in ("issued", "used", "wasted")}})
    return {"artifact": str(artifact), "trace": str(trace), "budgets": budgets, "planned": planned,
            "device": getattr(profile, "device", None), "model": j["prefetch"]["model"], "rows": rows,
            "mixtral_path_recall": mixtral_recall(mixtral_traces), "bench": bench_rows(bench, subject)}


def merge_into(artifact: str | Path, study: dict) -> None:
    """``prediction_study`` into the artifact's report.json, and report.md rendered again."""

    merge_section(artifact, {"prediction_study": study | {"markdown": prediction_study_markdown(study)}}, REPORT)


def prediction_study_markdown(study: dict) -> str:
    """The report.md section of ``moeprep prediction-study`` (report.json ``prediction_study``)."""
    rows = study["rows"]
    lines = ["## Prediction study (simulator)", "",
             f"The plan's predictors replayed by the simulator (the loader's cache and predictor code) on "
             f"{rows[0]['tokens']} tokens of fresh text (`{Path(study['trace']).name}`, never fitted on), one "
             f"call per token and MoE layer; {study['model']}. Stall: the demand reads' modelled time"
             + (f" on `{study['device']}`" if study.get("device") else "") + "; prefetch read s: the prefetch "
             "reads' time.", "",
             "| budget | predictors | demand misses | miss rate | KB read/token | stall s | prefetch read s | "
             "prefetches issued | used | wasted |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        names = ", ".join(r["predictors"]) or "none"
        stall = "-" if r["stall_seconds"] is None else f"{r['stall_seconds']:.3f}"
        pre = "-" if r["prefetch_read_seconds"] is None else f"{r['prefetch_read_seconds']:.3f}"
        lines.append(f"| {r['budget']} | {names} | {r['misses']} | {r['miss_rate']:.3f} | "
                     f"{r['bytes_read_per_token'] / 1e3:.1f} | {stall} | {pre} | {r['issued']} | {r['used']} | "
                     f"{r['wasted']} |")
    if bench := study.get("bench"):
        machine = bench.get("machine") or {}
        lines += ["", f"Measured by `moeprep bench` ({bench['created']}, {machine.get('cpu', '')}, "
                  f"{machine.get('cores', '')} cores): decode steps of the loader, each predictor alone and the whole "
                  "plan against `naive`, in one run.", "",
                  "| budget | system | decode tok/s | vs naive | misses/token | hit rate | stall fraction | prefetches "
                  "issued | used | wasted | cancelled |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                  "| ---: | ---: |"]
        for r in bench["rows"]:
            naive = next((x["decode_tokens_per_s"] for x in bench["rows"] if x["budget"] == r["budget"]
                          and x["system"] == "naive"), None)
            p = r.get("prefetch") or {}
            ratio = f"{r['decode_tokens_per_s'] / naive:.2f}x" if naive else "-"
            lines.append(f"| {r['budget']} | {r['system']} | {r['decode_tokens_per_s']:.3g} | {ratio} | "
                         f"{r['misses_per_token']:.2f} | {r['hit_rate']:.3f} | {r['stall_fraction']:.3f} | "
                         f"{p.get('issued', 0)} | {p.get('used', 0)} | {p.get('wasted', 0)} | {p.get('cancelled', 0)} |")
    if mixtral := study.get("mixtral_path_recall"):
        key = next(k for k in mixtral[0]["path"] if k.endswith("_recall"))
        lines += ["", "Path statistics on the real Mixtral-8x7B GSM8K decode traces, fitted on one problem and "
                  "measured on the other (means over the 32 layers):", "",
                  f"| fit -> test (tokens) | top-1 | {key.replace('_', ' ')} | marginal top-1 | marginal "
                  f"{key.replace('_', ' ')} | answered by full key / previous layer / marginal |",
                  "| --- | ---: | ---: | ---: | ---: | --- |"]
        for r in mixtral:
            t = r["tables"]
            lines.append(f"| {r['fit']} -> {r['test']} ({r['fit_tokens']} -> {r['test_tokens']}) | "
                         f"{r['path']['top1']:.3f} | {r['path'][key]:.3f} | {r['marginal']['top1']:.3f} | "
                         f"{r['marginal'][key]:.3f} | {t['prev2']:.2f} / {t['prev1']:.2f} / {t['marginal']:.2f} |")
    return "\n".join(lines)
