"""The neuron study: bytes read per decoded token and accuracy across theta, with and
without CORM's predictor, against whole-expert loading at the same budget.

One artifact is prepared from the recipe in the neuron layout with neuron loading and the ``neuron_gates``
predictor on (theta as the recipe says, or as its tolerance chooses; the study sets it per point). For each
theta:

- decode: the loader runs fresh text (another calibration seed) one token per call at the budget, with the
  plan's neuron entry at that theta and the rows always read as named (crossover 1), predictor off and on:
  bytes read per token, tokens/s, the active and computed shares, partial and whole reads, and the
  predictor's accuracy at expert level (chosen experts it had named) and neuron level (active neurons it
  had named, and named neurons that were active); then once more at the crossover the neuron stage
  measured on this disk (above it an expert is read whole), predictor off;
- accuracy: ``moeprep eval`` with ``compute: active`` and ``prefill: true``, so every token of every suite
  (the choice suites are prefill only) computes its own active set, as a decode step does; paired against
  the original model (the artifact is lossless for a passthrough recipe, so the delta is theta's alone).
  The predictor does not enter: with predictions fixed on demand it never changes an output
  (``tests/loader/test_neuron.py``); ``trust_prediction`` (CORM's own behaviour) is one more accuracy point.

The baseline is the same artifact with neuron loading off (whole-expert reads), decoded once more beside
every theta so each speed ratio compares runs made under the same load (these 2-core machines vary
several-fold when other work runs). ``study.json`` is written after every point.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

from loader.format import read_json, read_manifest
from loader.io import write_json_atomic
from loader.plan import PolicySpec, read_plan
from loader.runtime import load
from prep.calibration import calibration_sequences
from prep.evals.compare import evaluate_artifact
from prep.evals.data import SUITES
from prep.pipeline import prepare
from prep.recipe import load_recipe
from prep.report import merge_section
from prep.stages.table import REPORT
from prep.studies.common import write_outputs

PREPARE_OVERRIDES = ("neuron.layout=neuron", "neuron.enabled=true", "neuron.predictor=true", "evaluate.enabled=false")
DEFAULT_THETAS = (0.0, 0.05, 0.1, 0.2, 0.3)


def plan_variant(plan, theta: float | None, predictor: bool, **knobs):
    """The artifact's plan with neuron loading at ``theta`` (None: off) and the neuron_gates predictor on or off."""

    predictors = tuple(p for p in plan.predictors if p.name != "neuron_gates")
    if predictor:
        predictors += (PolicySpec("neuron_gates", {}),)
    neuron = PolicySpec("off") if theta is None else PolicySpec("sparse", plan.neuron.params | {"theta": theta} | knobs)
    return dataclasses.replace(plan, neuron=neuron, predictors=predictors)


def measure_decode(artifact, plan, budget: str, sequences) -> dict:
    """The loader on ``sequences`` one token per call: bytes read per token, tokens/s and the neuron stats."""
    import torch


    lm = load(artifact, memory_budget=budget, plan=plan)
    try:
        with torch.no_grad():
            for seq in sequences:
                past = None
                for token in seq.reshape(-1).tolist():
                    past = lm.model(torch.tensor([[token]]), past_key_values=past, use_cache=True).past_key_values
        stats = lm.stats()
    finally:
        lm.close()
    return {"tokens": stats["tokens"], "bytes_per_token": stats["bytes_read"] / stats["tokens"],
            "tokens_per_s": stats["tokens_per_second"], "stall_seconds": stats["stall_seconds"],
            "neuron": stats["neuron"]}


def run_study(recipe_path: str | Path, output: str | Path, root: str | Path = ".", *, thetas=DEFAULT_THETAS,
              budget: str = "25%", suites=SUITES, limit: int | None = None, data=None,
              seed: int = 1, sequences: int = 4, sequence_length: int = 64, trust_theta: float | None = None,
              echo=print) -> dict:
    """Prepare the study's artifact and measure every theta; writes study.json and study.md."""

    output, root = Path(output), Path(root)
    recipe = load_recipe(recipe_path, PREPARE_OVERRIDES)
    artifact = output / "artifact"
    echo("prepare the study's artifact (neuron layout, neuron loading and the neuron_gates predictor on)")
    prepare(recipe, root=root, output=artifact)
    plan = read_plan(artifact)
    from transformers import AutoTokenizer

    fresh = load_recipe(recipe_path, (f"calibration.seed={seed}", f"calibration.num_sequences={sequences}",
                                      f"calibration.sequence_length={sequence_length}"))
    text = calibration_sequences(fresh.calibration, AutoTokenizer.from_pretrained(artifact), root)
    report = json.loads((artifact / "report.json").read_text())["neuron"]
    trust_theta = report["theta"] if trust_theta is None else trust_theta
    settings = {"budget": budget, "suites": list(suites), "limit": limit, "seed": seed, "sequences": sequences,
                "sequence_length": sequence_length, "crossover": report["crossover"]}
    study = {"recipe": str(recipe_path), "settings": settings, "points": []}
    path = output / "study.json"
    started = time.perf_counter()

    def evaluate(variant) -> dict:
        result = evaluate_artifact(artifact, recipe.model_path(root), suites=tuple(suites), data=data, limit=limit,
                                   memory_budget=budget, reuse_original=output / "original", plan=variant)
        return {name: {"delta": s["delta"], "flips": s["flips"], "mcnemar_p": s["mcnemar_p"]}
                for name, s in result["suites"].items()}

    echo(f"whole-expert loading at {budget}: decode")
    study["baseline"] = measure_decode(artifact, plan_variant(plan, None, False), budget, text)
    for i, theta in enumerate(thetas, start=1):
        point = {"theta": theta}
        echo(f"[{i}/{len(thetas)}] whole-expert loading again: decode (the speed ratio's baseline, measured beside)")
        point["whole"] = measure_decode(artifact, plan_variant(plan, None, False), budget, text)
        for predictor in (False, True):  # rows read as named (crossover 1): the bytes neuron loading saves
            echo(f"[{i}/{len(thetas)}] theta {theta} predictor {'on' if predictor else 'off'}: decode")
            point["predictor" if predictor else "no_predictor"] = measure_decode(
                artifact, plan_variant(plan, theta, predictor, crossover=1.0), budget, text)
        echo(f"[{i}/{len(thetas)}] theta {theta} at the measured crossover: decode")
        point["measured_crossover"] = measure_decode(artifact, plan_variant(plan, theta, False), budget, text)
        echo(f"[{i}/{len(thetas)}] theta {theta}: accuracy (compute active, prefill on)")
        point["suites"] = evaluate(plan_variant(plan, theta, False, compute="active", prefill=True))
        study["points"].append(point)
        write_json_atomic(path, study)
    echo(f"theta {trust_theta} with trust_prediction (CORM): decode and accuracy")
    trusted = plan_variant(plan, trust_theta, True, trust_prediction=True, crossover=1.0)
    study["trust"] = {"theta": trust_theta, "decode": measure_decode(artifact, trusted, budget, text),
                      "suites": evaluate(plan_variant(plan, trust_theta, True, trust_prediction=True,
                                                      compute="active", prefill=True))}
    study["seconds"] = time.perf_counter() - started
    write_outputs(output, study, study_markdown(study))
    return study


def _cells(suites: dict) -> str:
    return " | ".join(f"{v['delta'] * 100:+.1f} ({v['flips']['right_to_wrong']}/{v['flips']['wrong_to_right']})"
                      for v in suites.values())


def study_markdown(study: dict) -> str:
    s, base = study["settings"], study["baseline"]
    suites = list(study["points"][0]["suites"]) if study["points"] else []
    first = "" if s["limit"] is None else f", first {s['limit']} items of each"
    lines = ["### Neuron study", "",
             f"Recipe `{study['recipe']}` in the neuron layout at a {s['budget']} budget, crossover "
             f"{s['crossover']:.0%}. Decode: {base['tokens']} tokens of fresh text (seed {s['seed']}) one per call; "
             f"whole-expert loading reads {base['bytes_per_token'] / 1e3:.1f} KB/token. Accuracy: `moeprep eval` with every token computing its own "
             f"active neurons ({', '.join(suites)}{first}), delta in points (flips right->wrong/wrong->right).", "",
             "Rows are read as named (crossover 1) except in the `measured crossover` columns, where an expert "
             f"whose active share would pass {s['crossover']:.0%} is read whole.", "",
             "Speed: tokens/s and, in brackets, the ratio to whole-expert loading decoded just before it.", "",
             "| theta | active share | KB/token | x fewer bytes | tokens/s | KB/token, predictor | tokens/s, predictor | "
             "KB/token, measured crossover | tokens/s, measured crossover | "
             "expert acc. | neuron recall | neuron precision | " + " | ".join(f"{x} delta" for x in suites) + " |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
             + " | ".join("---" for _ in suites) + " |"]

    def share(v):
        return "-" if v is None else f"{v:.3f}"

    for p in study["points"]:
        off, on = p["no_predictor"], p["predictor"]
        n = on["neuron"]
        expert = (n.get("expert_prediction") or {}).get("accuracy")
        measured = p["measured_crossover"]
        whole = p.get("whole", base)["tokens_per_s"]

        def speed(run, whole=whole):
            return f"{run['tokens_per_s']:.1f} ({run['tokens_per_s'] / whole:.2f}x)"

        lines.append(f"| {p['theta']:g} | {share(off['neuron']['active_share'])} | {off['bytes_per_token'] / 1e3:.1f} | "
                     f"{base['bytes_per_token'] / off['bytes_per_token']:.2f} | {speed(off)} | "
                     f"{on['bytes_per_token'] / 1e3:.1f} | {speed(on)} | "
                     f"{measured['bytes_per_token'] / 1e3:.1f} | {speed(measured)} | {share(expert)} | "
                     f"{share(n['neuron_recall'])} | {share(n['neuron_precision'])} | {_cells(p['suites'])} |")
    trust = study.get("trust")
    if trust:
        d = trust["decode"]
        lines += ["", f"CORM's trust_prediction at theta {trust['theta']:g} (each layer after the first computes the "
                      "experts the predictor named, with the neurons prefetched for them, no demand reads for those): "
                      f"{d['bytes_per_token'] / 1e3:.1f} KB/token, "
                      f"{d['tokens_per_s']:.1f} tokens/s; deltas {_cells(trust['suites'])}."]
    return "\n".join(lines) + "\n"


def merge_into(artifact: str | Path, study: dict) -> None:
    """The study into the artifact's report.json ``neuron`` (bytes per token and deltas per theta) and report.md."""

    manifest = read_manifest(artifact)
    neuron = dict(read_json(manifest.path("report.json"), "report.json").get("neuron") or {})
    neuron["study"] = {
        "settings": study["settings"], "baseline_bytes_per_token": study["baseline"]["bytes_per_token"],
        "points": [{"theta": p["theta"], "bytes_per_token": p["no_predictor"]["bytes_per_token"],
                    "bytes_per_token_predictor": p["predictor"]["bytes_per_token"],
                    "bytes_per_token_measured_crossover": p["measured_crossover"]["bytes_per_token"],
                    "deltas": {k: v["delta"] for k, v in p["suites"].items()}} for p in study["points"]],
        "markdown": study_markdown(study)}
    merge_section(manifest.root, {"neuron": neuron}, REPORT)
