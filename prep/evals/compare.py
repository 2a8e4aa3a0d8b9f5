"""The accuracy check: the prepared model (through the loader) against the original, item by item.

Both models get the same prompts and the same scoring (``templates.py``, ``scoring.py``); the output
pairs them: accuracies, delta, flips (right->wrong, wrong->right), an exact McNemar test on the flips,
and for choice tasks how often the two argmaxes agree and the mean KL divergence between the two
models' distributions over the choices.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from pathlib import Path

import torch

from loader.errors import disk_error
from loader.format import read_manifest
from loader.io import write_json_atomic, write_text_atomic
from loader.runtime import load
from prep.errors import MoeprepError
from prep.evals import suites as S
from prep.evals import templates as tpl
from prep.evals.data import SUITES, BenchmarkData, load_benchmarks
from prep.evals.power import mean_difference_interval, paired_verdict
from prep.fingerprint import model_fingerprint
from prep.report import PENDING, ReportLayout, current_report, merge_section  # noqa: F401 (PENDING: where eval's marker lives)
from prep.streaming import load_streamed

DEFAULT_SHOTS = {"gsm8k": 8, "mmlu": 5, "truthfulqa": 0}  # gsm8k_cot uses 8, the 5-shot format 5


def mcnemar_p(right_to_wrong: int, wrong_to_right: int) -> float:
    """Exact two-sided McNemar test: binomial(b + c, 1/2) on the discordant pairs."""
    n = right_to_wrong + wrong_to_right
    if n == 0:
        return 1.0
    k = min(right_to_wrong, wrong_to_right)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def _paired(original: list[bool], prepared: list[bool]) -> dict:
    r2w = sum(o and not p for o, p in zip(original, prepared, strict=True))
    w2r = sum(p and not o for o, p in zip(original, prepared, strict=True))
    return {"flips": {"right_to_wrong": r2w, "wrong_to_right": w2r}, "mcnemar_p": mcnemar_p(r2w, w2r)}


def _choice_stats(orig_scores: list[list[float]], prep_scores: list[list[float]]) -> dict:
    agree, kls = 0, []
    for o, p in zip(orig_scores, prep_scores, strict=True):
        lo = torch.log_softmax(torch.tensor(o, dtype=torch.float64), 0)
        lp = torch.log_softmax(torch.tensor(p, dtype=torch.float64), 0)
        agree += int(lo.argmax() == lp.argmax())
        kls.append(float((lo.exp() * (lo - lp)).sum()))
    return {"argmax_agreement": agree / len(orig_scores), "mean_kl": sum(kls) / len(kls)}


_mean = S.mean


# --------------------------------------------------------------------------------------------- suites


class _Models(dict):
    """{"original": model, "prepared": model}; ``run`` scores both, reusing the original's stored rows."""

    def __init__(self, original, prepared, original_dir: Path, reuse_dir: str | Path | None) -> None:
        super().__init__(original=original, prepared=prepared)
        self.original_dir, self.reuse_dir = Path(original_dir), reuse_dir

    def run(self, settings: tuple, score) -> dict[str, list]:
        return {name: self._original(settings, score) if name == "original" and self.reuse_dir else score(m, name)
                for name, m in self.items()}

    def _original(self, settings: tuple, score) -> list:
        import transformers


        key = hashlib.sha256(json.dumps([model_fingerprint(self.original_dir), settings, torch.__version__,
                                         transformers.__version__], sort_keys=True, default=str).encode())
        path = Path(self.reuse_dir) / f"original-{settings[0]}-{key.hexdigest()[:24]}.json"
        if path.is_file():
            return json.loads(path.read_text())
        rows = score(self["original"], "original")
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, rows)
        return rows



def _mmlu(models, tokenizer, data: BenchmarkData, items, shots, batch_rows) -> dict:
    runs = models.run(("mmlu", items, shots, batch_rows),
                      lambda m, name: S.score_mmlu(m, tokenizer, items, data.mmlu_dev, shots, batch_rows,
                                                   desc=f"mmlu {name}"))
    result = {"n": len(items), "num_fewshot": shots}
    for name, rows in runs.items():
        by_subject: dict[str, list[bool]] = {}
        by_category: dict[str, list[bool]] = {}
        for row, item in zip(rows, items, strict=True):
            by_subject.setdefault(item["subject"], []).append(row["correct"])
            by_category.setdefault(tpl.mmlu_category(item["subject"]), []).append(row["correct"])
        result[name] = {"acc": _mean(r["correct"] for r in rows),
                        "acc_by_subject": {s: _mean(v) for s, v in sorted(by_subject.items())},
                        "acc_by_category": {c: _mean(v) for c, v in sorted(by_category.items())}}
    result["delta"] = result["prepared"]["acc"] - result["original"]["acc"]
    o, p = runs["original"], runs["prepared"]
    return (result | _paired([r["correct"] for r in o], [r["correct"] for r in p])
            | _choice_stats([r["scores"] for r in o], [r["scores"] for r in p]))


def _truthfulqa(models, tokenizer, items, batch_rows) -> tuple[dict, dict]:
    runs = models.run(("truthfulqa", items, batch_rows),
                      lambda m, name: S.score_truthfulqa(m, tokenizer, items, batch_rows, desc=f"truthfulqa {name}"))
    mc1 = {"n": len(items), "num_fewshot": 0}
    mc2 = {"n": len(items), "num_fewshot": 0}
    for name, rows in runs.items():
        mc1[name] = {"acc": _mean(r["correct"] for r in rows)}
        mc2[name] = {"acc": _mean(r["mc2"] for r in rows)}
    mc1["delta"] = mc1["prepared"]["acc"] - mc1["original"]["acc"]
    mc2["delta"] = mc2["prepared"]["acc"] - mc2["original"]["acc"]
    o, p = runs["original"], runs["prepared"]
    mc1 |= (_paired([r["correct"] for r in o], [r["correct"] for r in p])
            | _choice_stats([r["mc1_scores"] for r in o], [r["mc1_scores"] for r in p]))
    # MC2 is continuous: a flip is an item whose true-answer mass crosses one half
    mc2 |= _paired([r["mc2"] >= 0.5 for r in o], [r["mc2"] >= 0.5 for r in p])
    mc2["delta_interval"] = list(mean_difference_interval([b["mc2"] - a["mc2"] for a, b in zip(o, p, strict=True)]))
    return mc1, mc2


def _gsm8k(models, tokenizer, data: BenchmarkData, items, shots, fmt, max_new_tokens) -> dict:
    if fmt == "cot":
        pool = ([(s["question"], s["cot"]) for s in data.gsm8k_cot_shots] if data.gsm8k_cot_shots is not None
                else list(tpl.GSM8K_COT_EXEMPLARS))
        task = S.gsm8k_cot(pool[:shots])
    else:
        pool = data.gsm8k_shots
        task = S.gsm8k_plain(pool[:shots])
    if len(pool) < shots:
        raise MoeprepError(f"gsm8k {shots}-shot needs {shots} solved examples, {len(pool)} available; "
                           "use --num-fewshot with fewer or provide them")
    runs = models.run(("gsm8k", items, shots, fmt, pool[:shots], max_new_tokens),
                      lambda m, name: S.score_gsm8k(m, tokenizer, items, *task, max_new_tokens=max_new_tokens,
                                                    desc=f"gsm8k {name}"))
    result = {"n": len(items), "num_fewshot": shots, "format": "gsm8k_cot" if fmt == "cot" else "gsm8k"}
    for name, rows in runs.items():
        result[name] = {"strict_match": _mean(r["correct"] for r in rows),
                        "flexible_extract": _mean(r["flexible_correct"] for r in rows)}
    result["delta"] = result["prepared"]["strict_match"] - result["original"]["strict_match"]
    return result | _paired([r["correct"] for r in runs["original"]], [r["correct"] for r in runs["prepared"]])


# ------------------------------------------------------------------------------------------ the check


def evaluate_artifact(artifact: str | Path, original: str | Path | None = None, suites: tuple[str, ...] = SUITES,
                      data: str | Path | None = None, limit: int | None = None, num_fewshot: int | None = None,
                      memory_budget=None, gsm8k_format: str = "cot", batch_rows: int = 16,
                      max_new_tokens: int = 256, output: str | Path | None = None,
                      reuse_original: str | Path | None = None, plan=None,
                      expert_memory: int | str | None = "auto", layout: ReportLayout | None = None,
                      merge: bool = True, device: str = "cpu") -> dict:
    """Compare ``artifact`` (through the loader) with its original model; returns and writes the report.

    ``expert_memory``: the original's routed-expert bytes kept in memory between forwards (``load_streamed``:
    "auto", None for all, 0 for one layer at a time, which rereads the checkpoint every forward).

    ``device``: where both models run ("cuda": the loader's GPU path and the original's dense weights on the GPU).

    ``reuse_original``: a directory keeping the original model's per-item results (keyed by the model's
    content, the items and every scoring setting), so comparing many artifacts of one model runs it once.

    The summary is merged into the artifact's report.json (``merge_into_artifact``), and report.md rendered again
    with ``layout`` (the stage table's sections, ``prep.stages.table.REPORT``, which this module cannot import),
    unless ``plan`` (a ``loader.plan.Plan`` the loader runs instead of the artifact's) made it a variant's figures
    or ``merge`` is False (``moeprep accuracy``: figures on other items than the check's, kept beside it).
    """
    import transformers


    per_suite = check_settings(limit, num_fewshot, gsm8k_format)
    manifest = read_manifest(artifact)  # the directory is resolved once: load and merge use this version
    artifact = manifest.root
    original = Path(original or manifest.raw["source_model"]["path"])
    if not original.is_dir():
        raise MoeprepError(f"original model {original} not found; pass --model with its directory")
    if data is None:
        data = original.parent / "suites"
        if not data.is_dir():
            raise MoeprepError("no --data given and the model has no suites/ beside it; pass --data")
    # what eval writes (its report, and the artifact's report.json unless a variant runs) must be writable
    # before minutes of evaluation, not after
    merge = merge and plan is None
    writable(Path(output).parent if output else None, artifact if merge else None)
    if merge:
        current_report(manifest)  # an altered report.json is refused now, not after the evaluation
    bench = load_benchmarks(data, tuple(suites))
    for name in bench.items:
        bench.items[name] = bench.items[name][:per_suite.get(name)]
    prepared = load(artifact, device=device, memory_budget=memory_budget, plan=plan)
    # the original with its experts read from the shards as its layers run (prep/streaming.py): a real model
    # is scored without holding it whole when expert_memory says so
    reference = load_streamed(original, device=device, resident_bytes=expert_memory)
    if reference.dtype != getattr(torch, manifest.moe.dtype):
        raise MoeprepError(f"original model {original} is {reference.dtype}, the artifact was prepared from a "
                           f"{manifest.moe.dtype} model; pass --model with the directory it was prepared from")
    models = _Models(reference, prepared.model, original, reuse_original)
    tokenizer = prepared.tokenizer
    shots = dict(DEFAULT_SHOTS) if num_fewshot is None else dict.fromkeys(DEFAULT_SHOTS, num_fewshot)
    if num_fewshot is None and gsm8k_format == "plain":
        shots["gsm8k"] = 5
    report: dict = {"suites": {}}
    with torch.no_grad():
        if "gsm8k" in bench.items:
            report["suites"]["gsm8k"] = _gsm8k(models, tokenizer, bench, bench.items["gsm8k"], shots["gsm8k"],
                                               gsm8k_format, max_new_tokens)
        if "mmlu" in bench.items:
            report["suites"]["mmlu"] = _mmlu(models, tokenizer, bench, bench.items["mmlu"], shots["mmlu"], batch_rows)
        if "truthfulqa" in bench.items:
            mc1, mc2 = _truthfulqa(models, tokenizer, bench.items["truthfulqa"], batch_rows)
            report["suites"]["truthfulqa_mc1"], report["suites"]["truthfulqa_mc2"] = mc1, mc2
    report |= {"artifact": str(artifact), "original_model": str(original), "data": bench.source,
               "data_layout": bench.layout, "memory_budget": memory_budget, "loader_stats": prepared.stats(),
               "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                            "python": platform.python_version()}}
    prepared.close()
    if output:
        write_report(report, Path(output))
    if merge:
        merge_into_artifact(artifact, report, package_key=manifest.raw["package_key"], layout=layout)
    return report


def check_settings(limit, num_fewshot, gsm8k_format: str) -> dict:
    """The scoring settings checked before any work (``moeprep eval`` checks them before its divergence too): the
    items per suite they ask for."""
    per_suite = limit if isinstance(limit, dict) else dict.fromkeys(SUITES, limit)
    for n in per_suite.values():
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise MoeprepError(f"limit must be a whole number >= 1 (the first N items of each suite, or N per suite), "
                               f"got {limit!r}; leave it out to use every item")
    if num_fewshot is not None and (not isinstance(num_fewshot, int) or num_fewshot < 0):
        raise MoeprepError(f"num_fewshot must be a whole number >= 0, got {num_fewshot!r}")
    if gsm8k_format not in ("cot", "plain"):
        raise MoeprepError("--gsm8k-format must be cot or plain")
    return per_suite


def eval_summary(report: dict) -> dict:
    """Per suite the headline figures of a report (what report.json and the evaluate stage keep)."""
    return {name: {k: s[k] for k in ("n", "num_fewshot", "original", "prepared", "delta", "flips", "mcnemar_p",
                                     "delta_interval") if k in s}
            for name, s in report["suites"].items()}


def writable(*directories) -> None:
    """Each directory (None: skipped) can take a new file: one is created and removed there, else a DiskError (or
    MoeprepError) naming it, before any evaluation runs."""
    for directory in directories:
        if directory is None:
            continue
        directory = Path(directory)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".moeprep-write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise (disk_error(e, directory) or MoeprepError(f"cannot write in {directory} ({e.strerror or e}); "
                                                            "choose another place")) from None


def merge_into_artifact(artifact: str | Path, report: dict, package_key: str | None = None,
                        layout: ReportLayout | None = None) -> None:
    """Put the eval summary into the artifact's report.json and render report.md with ``layout`` (``merge_section``:
    the artifact verifies before and after; without a layout report.md is left as it is)."""
    merge_section(artifact, {"eval": {"suites": eval_summary(report), "data": report["data"],
                                      "memory_budget": report["memory_budget"]}}, layout, package_key=package_key)


def summary_markdown(report: dict) -> str:
    """The eval report's table: per suite the paired figures, the delta's 95% interval and what the suite can resolve
    (``prep.evals.power``)."""
    lines = ["| suite | n | shots | points per item | original | prepared | delta | 95% interval (points) | "
             "right->wrong | wrong->right | McNemar p | items to resolve 1 point |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in report["suites"].items():
        key = "strict_match" if name == "gsm8k" else "acc"
        test = paired_verdict(s["delta"], s["flips"], s["n"], s["mcnemar_p"], None, interval=s.get("delta_interval"))
        need = test["items_for_one_point"]
        lines.append(f"| {name} | {s['n']} | {s['num_fewshot']} | {test['resolution_points']:.2f} | "
                     f"{s['original'][key]:.4f} | {s['prepared'][key]:.4f} | {s['delta']:+.4f} | "
                     f"{interval_text(test['interval_points'])} | {s['flips']['right_to_wrong']} | {s['flips']['wrong_to_right']} | {s['mcnemar_p']:.3g} | "
                     f"{need if need is not None else 'no flips seen'} |")
    return "\n".join(lines) + "\n"


def interval_text(points: list[float]) -> str:
    """An interval in points as the tables print it: ``[-3.19, +0.70]``."""
    return f"[{points[0]:+.2f}, {points[1]:+.2f}]"


def write_report(report: dict, output: Path) -> None:
    """``output`` (JSON) and a markdown summary beside it (same name, ``.md``), both atomically."""

    output.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(output, report)
    write_text_atomic(output.with_suffix(".md"), summary_markdown(report))
