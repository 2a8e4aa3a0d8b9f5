"""End to end on the reference model: prepare a lossless artifact, verify it, generate under 30%."""

from __future__ import annotations

from pathlib import Path

import torch

from loader.runtime import load
from loader.verify import verify
from prep.pipeline import prepare
from prep.recipe import load_recipe
from prep.reference.metrics import load_model

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "recipes" / "reference" / "model"


def test_lossless_artifact_generates_exactly_what_transformers_does(reference_lossless_artifact):
    artifact = reference_lossless_artifact
    assert verify(artifact) == []
    model, tokenizer = load_model(MODEL)
    prompt = "Question: Anna has 12 apples. Anna buys 5 more apples. How many apples does Anna have now?\nAnswer:"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, **kwargs)
    # the plan's predictors (all three), none, and each alone: prefetching never changes an output
    for predictors in (None, [], ["next_gates"], ["path_stats"], ["first_gate"]):
        loaded = load(artifact, memory_budget="30%", predictors=predictors)
        with torch.no_grad():
            got = loaded.model.generate(input_ids=ids, **kwargs)
        stats = loaded.stats()
        loaded.close()
        assert torch.equal(got, expected), predictors
        assert loaded.budget["cache_slots"]["main"] < 4 * 8  # 30% really offloads (4 MoE layers of 8 experts)
        assert stats["misses"] > 0 and stats["hits"] > 0
        assert (stats["prefetch"]["issued"] > 0) == (predictors != []), (predictors, stats["prefetch"])


def test_reference_recipe_end_to_end(tmp_path):
    """The `make prepare` recipe (mixed-precision experts from EdgeMoE's search, accuracy check on)."""
    import json

    from click.testing import CliRunner

    from loader.cli import main as moeload

    recipe = load_recipe(REPO / "recipes/reference.yaml", (f"model.path={MODEL}", "evaluate.limit=8",
                                                           "plan.tune.trials=3", "plan.num_sequences=2",
                                                           "divergence.num_sequences=16",
                                                           f"plan.device={REPO / 'recipes/reference/device.json'}"))
    summary = prepare(recipe, root=tmp_path)
    artifact = Path(summary["artifact"])
    assert verify(artifact) == []
    report = json.loads((artifact / "report.json").read_text())
    assert report["compression"]["source"] > 5  # float32 source -> at most 8-bit codes with quantized scale/zero
    kl = report["divergence"]["stats"]["mean_kl"]  # the quantized experts move the next-token distribution a little
    assert report["divergence"]["sequences"] == 16 and 0 < kl["low"] <= kl["value"] <= kl["high"] < 0.05
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert len(manifest["stores"]) > 1 and report["bitwidth"]["method"] == "edgemoe"  # `make prepare` is mixed
    assert report["bitwidth"]["met"] and report["bitwidth"]["loss"] <= recipe.bitwidth.tolerance
    assert report["prediction"]["predictors"] == ["next_gates", "path_stats", "first_gate"]
    assert "## Prediction" in (artifact / "report.md").read_text()
    # the joint plan: every planning field computed for this device, and the operating points reported
    plan = json.loads((artifact / "plan.json").read_text())
    assert plan["eviction"] == report["planning"]["tune_policy"]["eviction"]
    assert all("layers" in p or p["group"] == "global" for p in plan["pools"])
    points = report["operating_points"]
    assert [p["share"] for p in points] == list(recipe.plan.points)
    assert {p["budget_bytes"] for p in points} <= {p["budget_bytes"] for p in plan["operating_points"]}
    assert all(p["modeled_tokens_per_s"] > 0 and set(p["accuracy_delta"]) == {"gsm8k", "mmlu", "truthfulqa_mc1",
                                                                               "truthfulqa_mc2"} for p in points)
    assert "## Operating points" in (artifact / "report.md").read_text() and (artifact / "reports" / "report-plan.png").is_file()
    checked = report["eval"]["suites"]
    assert set(checked) == {"gsm8k", "mmlu", "truthfulqa_mc1", "truthfulqa_mc2"}
    assert all(0 <= s["mcnemar_p"] <= 1 for s in checked.values())
    # the tolerance as a paired test per suite and operating point, and the resolution of each suite in report.md
    for point in points:
        assert set(point["accuracy_test"]) == set(checked)
        for suite, test in point["accuracy_test"].items():
            assert test["mcnemar_p"] == checked[suite]["mcnemar_p"] and test["resolution_points"] == 100 / 8
            assert test["within_tolerance"] == (abs(test["delta_points"]) <= recipe.plan.tolerance + 1e-9)
        assert point["within_tolerance"] == all(t["within_tolerance"] for t in point["accuracy_test"].values())
    md = (artifact / "report.md").read_text()
    assert "## Accuracy check" in md and "| gsm8k | 8 | 12.50 |" in md
    result = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "Q: What is the capital of France?\nA:",
                                          "--max-new-tokens", "8", "--memory-budget", "9%", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.output)
    # 9% of the float32 experts' bytes holds about three quarters of the 3- and 4-bit records (one pool per
    # precision and layer: 8 eviction groups, each needing room for one record, set the minimum near 8%)
    assert out["stats"]["misses"] > 0 and sum(out["stats"]["budget"]["cache_slots"].values()) < 4 * 8


def _mmlu_by_hand(model, tokenizer, item: dict, shots: list[dict]) -> int:
    """The harness's MMLU scoring written out plainly: one forward per letter, no batching, no padding."""
    def block(q: dict) -> str:
        lines = [q["question"].strip()] + [f"{letter}. {c}" for letter, c in zip("ABCD", q["choices"], strict=True)]
        return "\n".join(lines) + "\nAnswer:"

    subject = item["subject"].replace("_", " ")
    prompt = f"The following are multiple choice questions (with answers) about {subject}.\n\n"
    prompt += "".join(f"{block(s)} {'ABCD'[s['answer']]}\n\n" for s in shots) + block(item)
    context = tokenizer(prompt)["input_ids"]
    scores = []
    for letter in "ABCD":
        whole = tokenizer(prompt + " " + letter)["input_ids"]
        assert whole[: len(context)] == context
        with torch.no_grad():
            logprobs = model(input_ids=torch.tensor([whole])).logits[0].log_softmax(-1)
        scores.append(sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context), len(whole))))
    return max(range(4), key=scores.__getitem__)


def test_eval_mmlu_agrees_with_an_independent_scorer(tmp_path, reference_lossless_artifact):
    """`moeprep eval`'s original-model MMLU accuracy equals a hand-written per-letter scorer's, item by item."""
    import json

    from prep.evals.compare import evaluate_artifact
    from tests.helpers.shared import writable_copy

    artifact = writable_copy(reference_lossless_artifact.resolve(), tmp_path / "artifact")  # eval writes its report
    n = 24
    report = evaluate_artifact(artifact, suites=("mmlu",), limit=n, output=tmp_path / "eval.json")
    suites = MODEL.parent / "suites"
    items = [json.loads(line) for line in (suites / "mmlu.jsonl").read_text().splitlines()[:n]]
    dev = [json.loads(line) for line in (suites / "mmlu_dev.jsonl").read_text().splitlines()]
    model, tokenizer = load_model(MODEL)
    right = [_mmlu_by_hand(model, tokenizer, item, [d for d in dev if d["subject"] == item["subject"]][:5])
             == item["answer"] for item in items]
    mmlu = report["suites"]["mmlu"]
    assert mmlu["num_fewshot"] == 5
    assert mmlu["original"]["acc"] == sum(right) / n
    assert mmlu["prepared"]["acc"] == mmlu["original"]["acc"]  # lossless
