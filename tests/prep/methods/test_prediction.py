"""Prediction and prefetching: path statistics and their backoff, next-gate recall against a brute-force loop,
and greedy outputs that stay the same with every predictor on and off on all seven tiny architectures (the
loader's predictors on hand-made contexts are in ``tests/loader/test_predict.py``)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loader.predict import (
    PathStats,
)
from loader.runtime import LoaderError, load, minimum_budget
from prep.errors import MoeprepError
from prep.methods.routing_stats import fit_path_stats, next_gate_recall, path_stats_recall
from tests.helpers.predict_contexts import E, K, L, deterministic_routing
from tests.helpers.tiny_models import ARCHITECTURES, prepare_tiny_artifact, tiny_recipe


def test_path_stats_put_probability_one_on_a_deterministic_path_and_unseen_keys_back_off():
    routing = deterministic_routing()
    stats = PathStats.from_tensors(fit_path_stats(routing, E), min_count=1)
    token = routing[0][5].tolist()
    for layer in (1, 2, 3):
        probs, table = stats.probs(layer, token[layer - 2] if layer >= 2 else None, token[layer - 1])
        assert table == ("prev2" if layer >= 2 else "prev1")
        assert sorted(torch.nonzero(probs == 1).flatten().tolist()) == sorted(token[layer])
        assert probs.sum().item() == pytest.approx(K)
    # an unseen full key falls back to the previous layer's, and an unseen previous key to the marginal
    seen1 = {tuple(sorted(t[1])) for seq in routing for t in seq.tolist()}
    unseen = next((a, b) for a in range(E) for b in range(a + 1, E) if (a, b) not in seen1)
    probs, table = stats.probs(2, unseen, token[1])
    assert table == "prev1" and sorted(torch.nonzero(probs == 1).flatten().tolist()) == sorted(token[2])
    seen2 = {tuple(sorted(t[2])) for seq in routing for t in seq.tolist()}
    unseen2 = next((a, b) for a in range(E) for b in range(a + 1, E) if (a, b) not in seen2)
    probs, table = stats.probs(3, token[1], unseen2)
    assert table == "marginal" and torch.allclose(probs, stats.marginal[3])
    assert stats.probs(0, None, None)[1] == "marginal"
    # min_count: a key seen fewer times than that backs off too
    strict = PathStats.from_tensors(fit_path_stats(routing, E), min_count=10**6)
    assert strict.probs(3, token[1], token[2])[1] == "marginal"


def test_path_counts_equal_a_brute_force_count():
    gen = torch.Generator().manual_seed(1)
    routing = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(L * 30)]).view(30, L, K)
               for _ in range(2)]
    tensors = fit_path_stats(routing, E)
    tokens = [t for seq in routing for t in seq.tolist()]
    for layer in range(L):
        assert tensors["path.marginal.counts"][layer].tolist() == [sum(e in t[layer] for t in tokens) for e in range(E)]
    for kind, layer, key_of in (("prev1", 1, lambda t: tuple(sorted(t[0]))),
                                ("prev2", 3, lambda t: tuple(sorted(t[1])) + tuple(sorted(t[2])))):
        totals = Counter(key_of(t) for t in tokens)
        keys = [tuple(k) for k in tensors[f"path.{kind}.{layer}.keys"].tolist()]
        assert sorted(keys) == sorted(totals)
        for row, key in enumerate(keys):
            assert tensors[f"path.{kind}.{layer}.totals"][row] == totals[key]
            expected = [sum(e in t[layer] for t in tokens if key_of(t) == key) for e in range(E)]
            assert tensors[f"path.{kind}.{layer}.counts"][row].tolist() == expected


def test_path_recall_is_perfect_on_a_deterministic_path_and_the_marginal_is_not():
    routing = deterministic_routing()
    result = path_stats_recall(fit_path_stats(routing[:2], E), routing[2:], None, routing[:2], E, min_count=1)
    for row in result["layers"][1:]:
        assert row["path"]["top2_recall"] == 1.0
        assert row["marginal"]["top2_recall"] < 1.0


def test_next_gate_recall_equals_a_brute_force_loop():
    gen = torch.Generator().manual_seed(2)
    hidden, n = 6, 50
    routers = [(torch.randn(E, hidden, generator=gen), torch.randn(E, generator=gen) if i % 2 else None) for i in range(L)]
    inputs = [torch.randn(n, hidden, generator=gen) for _ in range(L)]
    ids = torch.stack([torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(L)]) for _ in range(n)])
    weights = torch.rand(n, L, K, generator=gen)
    result = next_gate_recall(inputs, routers, ids, weights, [ids], distances=2)
    rows = {(r["layer"], r["distance"]): r for r in result["layers"]}
    assert set(rows) == {(0, 1), (0, 2), (1, 1), (1, 2), (2, 1)}
    for (layer, d), row in rows.items():
        w, b = routers[layer + d]
        top1 = recall = 0.0
        for t in range(n):
            logits = F.linear(inputs[layer][t], w, b)
            predicted = logits.topk(K).indices.tolist()
            chosen = ids[t, layer + d].tolist()
            top1 += predicted[0] == chosen[int(weights[t, layer + d].argmax())]
            recall += len(set(predicted) & set(chosen)) / K
        assert row["gate"]["top1"] == pytest.approx(top1 / n)
        assert row["gate"]["top2_recall"] == pytest.approx(recall / n)


ALL = ["next_gates", "path_stats", "first_gate"]


def _predicting_recipe(**predict):
    return tiny_recipe("int4", calibration={"num_sequences": 4, "sequence_length": 24},
                       predict={"predictors": ALL, "path_stats": {"min_count": 1}, "first_gate": {"max_epochs": 20}}
                       | predict)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_outputs_are_identical_with_every_predictor_on_and_off(tmp_path, arch):
    model, artifact = prepare_tiny_artifact(tmp_path, arch, recipe=_predicting_recipe())
    plan = json.loads((artifact / "plan.json").read_text())
    assert [p["name"] for p in plan["predictors"]] == ALL
    assert (artifact / "predictors.safetensors").is_file()
    ids = torch.randint(0, model.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(5))
    budget = minimum_budget(artifact)
    outputs, issued = {}, {}
    for chosen in ([], ["next_gates"], ["path_stats"], ["first_gate"], None):
        loaded = load(artifact, memory_budget=budget, predictors=chosen)
        with torch.no_grad():
            outputs[str(chosen)] = loaded.model.generate(ids, max_new_tokens=10, do_sample=False,
                                                         attention_mask=torch.ones_like(ids)).tolist()
        stats = loaded.stats()["prefetch"]
        loaded.close()
        issued[str(chosen)] = stats["issued"]
        assert stats["used"] + stats["wasted"] + stats["cancelled"] <= stats["issued"]
    assert len({json.dumps(o) for o in outputs.values()}) == 1, outputs
    assert issued["[]"] == 0 and issued["None"] > 0


def test_predict_recipe_errors_name_the_fix(tmp_path):
    with pytest.raises(MoeprepError, match="unknown predictor"):
        tiny_recipe(predict={"predictors": ["oracle"]})
    with pytest.raises(MoeprepError, match="floor"):
        tiny_recipe(predict={"predictors": ["path_stats"], "path_stats": {"floor": 2}})
    with pytest.raises(MoeprepError, match="quantize.also"):
        tiny_recipe(predict={"predictors": ["next_gates"], "next_gates": {"precision": "int2"}})
    with pytest.raises(MoeprepError, match="unknown key"):
        tiny_recipe(predict={"predictors": [], "depth": 2})


def test_a_predictor_the_artifact_was_not_prepared_for_is_one_clear_error(tmp_path):
    _, artifact = prepare_tiny_artifact(tmp_path, "mixtral", recipe=_predicting_recipe(predictors=["next_gates"]))
    assert json.loads((artifact / "report.json").read_text())["prediction"]["first_gate"] is None
    with pytest.raises(LoaderError, match="first_gate in predict.predictors"):
        load(artifact, predictors=["first_gate"])
    loaded = load(artifact, predictors=["next_gates"])  # the knobs of the plan
    assert loaded.runtime.predictors[0].depth == 3
    loaded.close()


def test_moeload_generate_reports_prefetches_and_takes_the_predictor_switch(tmp_path):
    from click.testing import CliRunner

    from loader.cli import main as moeload

    _, artifact = prepare_tiny_artifact(tmp_path, "qwen3_moe", recipe=_predicting_recipe())
    runs = {}
    for switch in ([], ["--predictors", "none"], ["--predictors", "next_gates,first_gate"]):
        result = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "ABCDEF", "--max-new-tokens", "6",
                                              "--memory-budget", str(minimum_budget(artifact)), "--json", *switch])
        assert result.exit_code == 0, result.output
        out = json.loads(result.output)
        assert set(out["stats"]["prefetch"]) >= {"issued", "used", "wasted", "cancelled"}
        runs[" ".join(switch)] = out
    assert runs[""]["stats"]["prefetch"]["predictors"] == ALL
    assert runs["--predictors none"]["stats"]["prefetch"]["issued"] == 0
    assert runs["--predictors next_gates,first_gate"]["stats"]["prefetch"]["predictors"] == ["next_gates", "first_gate"]
    assert len({json.dumps(r["token_ids"]) for r in runs.values()}) == 1
    bad = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "AB", "--predictors", "oracle"])
    assert bad.exit_code == 1 and "unknown" in bad.output


def test_the_reference_models_held_out_recall_beats_the_marginal_at_every_layer(reference_lossless_artifact):
    """Next-layer gates at distance 1 for layers 1..L-1 and the first-layer gate for layer 0, on the last
    quarter of the reference calibration sequences (never fitted on; the shared build prepares 8 of them)."""
    [stage] = (reference_lossless_artifact.parent / "stages").glob("predict-*")
    result = json.loads((stage / "result.json").read_text())["result"]
    d1 = [r for r in result["next_gates"]["layers"] if r["distance"] == 1]
    assert [r["target"] for r in d1] == [1, 2, 3]
    for row in d1:
        assert row["gate"]["top2_recall"] > row["marginal"]["top2_recall"], row
        assert row["gate"]["top1"] > row["marginal"]["top1"], row
    first = result["first_gate"]
    assert first["held_out"]["top2_recall"] > first["marginal"]["top2_recall"]
    assert first["held_out"]["kl"] < first["marginal"]["kl"]
    for row in result["path_stats"]["layers"][1:]:
        assert row["path"]["top2_recall"] > row["marginal"]["top2_recall"], row


def test_path_stats_on_the_real_mixtral_traces_fit_on_one_problem_beat_the_marginal_on_the_other():
    """Weak but real: the two GSM8K problems are 166 and 78 decode tokens (the figures are in the note)."""
    from prep.methods.trace import read_mixtral_traces

    traces_dir = Path(__file__).resolve().parents[4] / "shared" / "data" / "traces"
    if not (traces_dir / "mixtral-8x7b").is_dir():
        pytest.skip(f"the real Mixtral traces are not at {traces_dir}")
    fit, test = read_mixtral_traces(traces_dir)
    result = path_stats_recall(fit_path_stats([fit.expert_ids], 8), [test.expert_ids], [test.expert_weights],
                               [fit.expert_ids], 8)
    assert result["mean"]["path"]["top2_recall"] > result["mean"]["marginal"]["top2_recall"]
    assert result["mean"]["path"]["top1"] > result["mean"]["marginal"]["top1"]


def test_the_simulator_replays_the_loaders_predictors_on_a_project_trace(tmp_path):
    from prep.sim.simulate import simulate_trace

    _, artifact = prepare_tiny_artifact(tmp_path, "mixtral", recipe=_predicting_recipe())
    [trace] = (tmp_path / "artifacts/tiny/stages").glob("trace-*/trace")
    # unlimited: nothing is ever evicted, so each used prefetch is a first use that would have missed
    budget = "unlimited"
    _, [off] = simulate_trace(trace, plan=artifact, budget=budget)
    _, [on] = simulate_trace(trace, plan=artifact, budget=budget, predictors="plan")
    off, on = off.to_json(), on.to_json()
    assert off["prefetch"]["issued"] == 0 and on["prefetch"]["predictors"] == ALL
    pf = on["prefetch"]
    assert pf["issued"] > 0 and pf["used"] > 0 and pf["used"] + pf["wasted"] <= pf["issued"]
    assert on["requests"] == off["requests"]  # the same routing; only what is resident when it is asked for differs
    assert on["misses"] <= off["misses"] - pf["used"]
    assert on["bytes_read"] >= off["bytes_read"]  # prefetches read too, wasted ones included
    with pytest.raises(MoeprepError, match="unknown"):
        simulate_trace(trace, plan=artifact, budget=budget, predictors="oracle")


def test_the_prediction_study_replays_fresh_text_and_lands_in_report_md(tmp_path):
    import yaml

    from loader.verify import verify
    from prep.studies.common import fresh_trace
    from prep.studies.prediction import merge_into, run_study

    recipe = _predicting_recipe()
    prepare_tiny_artifact(tmp_path, "olmoe", recipe=recipe)
    recipe_path = tmp_path / "tiny.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe.to_dict()))
    artifact = tmp_path / "artifact"
    with pytest.raises(MoeprepError, match="own calibration seed"):
        fresh_trace(recipe_path, tmp_path, tmp_path / "study", seed=recipe.calibration.seed, sequences=2)
    trace = fresh_trace(recipe_path, tmp_path, tmp_path / "study", seed=7, sequences=2)
    assert fresh_trace(recipe_path, tmp_path, tmp_path / "study", seed=7, sequences=2) == trace  # reused
    study = run_study(artifact, trace, ["unlimited", str(minimum_budget(artifact))])
    assert [(r["budget"], tuple(r["predictors"])) for r in study["rows"][:5]] == [
        ("unlimited", ()), ("unlimited", ("next_gates",)), ("unlimited", ("path_stats",)),
        ("unlimited", ("first_gate",)), ("unlimited", tuple(ALL))]
    none, together = study["rows"][0], study["rows"][4]
    assert none["issued"] == 0 and together["misses"] <= none["misses"] - together["used"]
    merge_into(artifact, study)
    assert verify(artifact) == []
    text = (artifact / "report.md").read_text()
    assert "## Prediction study (simulator)" in text and "## Prediction\n" in text


def test_a_queued_prefetch_the_router_did_not_choose_is_cancelled_and_a_chosen_one_is_promoted(tmp_path):
    """Prefetch reads are held in the queue (never started): when the layer's router decides, the unchosen
    ones are cancelled and their slots freed, the chosen ones are promoted to demand reads and used."""
    from loader.predict import Predictor, PrefetchRequest
    from loader.store import PREFETCH

    class Everything(Predictor):
        name = "everything"

        def after_router(self, layer, router_input, indices):
            return [PrefetchRequest(layer + 1, e) for e in range(self.num_experts)] if layer + 1 < self.num_layers else []

    model, artifact = prepare_tiny_artifact(tmp_path, "mixtral", recipe=_predicting_recipe(predictors=[]))
    ids = torch.randint(0, model.config.vocab_size, (1, 1), generator=torch.Generator().manual_seed(9))  # decode-like
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    loaded = load(artifact, memory_budget="unlimited", predictors=[Everything()])
    reader = loaded.runtime.reader
    submit = reader.submit
    reader.submit = lambda job: job if job.priority == PREFETCH else submit(job)  # held: stays "queued"
    with torch.no_grad():
        got = loaded.model.generate(ids, max_new_tokens=6, do_sample=False, attention_mask=torch.ones_like(ids))
    stats = loaded.stats()["prefetch"]
    held = [e for layer in range(1, loaded.runtime.num_layers) for e in loaded.cache.layer_entries(layer)]
    loaded.close()
    assert torch.equal(got, expected)
    assert stats["cancelled"] > 0 and stats["used"] > 0 and stats["wasted"] == 0
    assert stats["used"] + stats["cancelled"] == stats["issued"]
    assert all(not e.in_flight for e in held)  # nothing left waiting on a read that will never run
