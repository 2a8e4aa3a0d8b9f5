"""Recorded routing fed to the real stages (``trace.recorded``): the decisions Mixtral-8x7B made on GSM8K, imported
into a model of its shape, drive gating (AdapMoE's own sensitivity), dynamic precision and path statistics exactly
as a traced model's routing would."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

from prep.errors import MoeprepError
from prep.methods.trace import open_trace, read_mixtral_traces
from prep.pipeline import prepare
from prep.recipe import recipe_from_dict
from prep.stages import StageResult
from prep.stages.gating import GatingChoice
from prep.stages.predict import PredictionStats
from tests.helpers.mixtral_traces import REAL_FILE, REAL_SENSITIVITY, real_traces, synthetic_traces
from tests.helpers.tiny_models import COMMON, tiny_tokenizer


def _mixtral_shaped(root, layers: int, experts: int = 8):
    """A tiny Mixtral of ``layers`` layers and ``experts`` experts, top-2, under ``root/model``."""
    config = MixtralConfig(num_hidden_layers=layers, intermediate_size=16, num_local_experts=experts,
                           num_experts_per_tok=2, **COMMON)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(root / "model")
    tiny_tokenizer(config.vocab_size).save_pretrained(root / "model")


def _recipe(traces_file, **sections):
    trace = {"recorded": str(traces_file)} | sections.pop("trace", {})
    return recipe_from_dict({"name": "recorded", "model": {"path": "model"},
                             "calibration": {"num_sequences": 1, "sequence_length": 8},
                             "quantize": {"precision": "int4", "group_size": 16}, "trace": trace, **sections})


def _stage(root, name, cls):
    [directory] = (root / "artifacts/recorded/stages").glob(f"{name}-*")
    return cls.load(directory), directory


def test_the_trace_stage_imports_the_recorded_problems_asked_for(tmp_path):
    traces = synthetic_traces(tmp_path / "traces", tokens=(12, 9, 7))
    file = traces / "mixtral-8x7b" / "gsm8k_routing.jsonl"
    _mixtral_shaped(tmp_path, layers=4)
    prepare(_recipe(file, trace={"problems": [2, 0]}), root=tmp_path, until="trace")
    [directory] = (tmp_path / "artifacts/recorded/stages").glob("trace-*")
    trace = open_trace(directory / "trace")
    assert trace.sequence_tokens == [7, 12] and trace.index["recorded"]["problems"] == [2, 0]
    recorded = read_mixtral_traces(file)
    got = trace.routing()
    for mine, problem in zip(got, [2, 0], strict=True):  # the first 4 of 32 layers, each row heaviest first
        want = recorded[problem]
        assert torch.equal(mine.expert_ids, want.expert_ids[:, :4])
        assert torch.equal(mine.expert_weights, want.expert_weights[:, :4])
    with pytest.raises(MoeprepError, match="router_input"):  # routing only: a reader of hidden states is told
        trace.router_inputs(trace.layers[0])


def test_recorded_routing_that_does_not_fit_the_model_or_the_recipe_is_one_clear_error(tmp_path):
    traces = synthetic_traces(tmp_path / "traces", tokens=(6, 5))
    file = traces / "mixtral-8x7b" / "gsm8k_routing.jsonl"
    _mixtral_shaped(tmp_path, layers=2, experts=4)
    with pytest.raises(MoeprepError, match="names expert .* the model has 4"):
        prepare(_recipe(file), root=tmp_path, until="trace")
    with pytest.raises(MoeprepError, match=r"trace.problems \[5\]: .* holds 2 problems"):
        prepare(_recipe(file, trace={"problems": [5]}), root=tmp_path, until="trace")
    with pytest.raises(MoeprepError, match="trace.problems picks recorded problems; it needs trace.recorded"):
        recipe_from_dict({"name": "x", "model": {"path": "model"}, "trace": {"problems": [0]}})
    with pytest.raises(MoeprepError, match="is not there; write or fetch it first"):
        prepare(_recipe(tmp_path / "nowhere.jsonl"), root=tmp_path, until="trace")


def test_gating_from_a_sensitivity_file_is_adapmoes_rule_counted_by_hand(tmp_path):
    traces = synthetic_traces(tmp_path / "traces", tokens=(30, 20))
    home = traces / "mixtral-8x7b"
    _mixtral_shaped(tmp_path, layers=4)
    recipe = _recipe(home / "gsm8k_routing.jsonl",
                     gating={"enabled": True, "sensitivity_file": str(home / "adapmoe_sensitivity.json"),
                             "threshold": 0.005})
    prepare(recipe, root=tmp_path, until="gating")
    choice, _ = _stage(tmp_path, "gating", GatingChoice)
    s = json.loads((home / "adapmoe_sensitivity.json").read_text())["S"][:4]
    assert choice.sensitivity == s and choice.details["sensitivity_file"]["layers_used"] == 4
    single = decisions = 0
    for trace in read_mixtral_traces(home):  # brute force: (1 - w1)^2 * S_l <= T per (token, layer)
        for row in trace.expert_weights[:, :4].tolist():
            for layer, (w1, _w2) in enumerate(row):
                single += (1 - w1) ** 2 * s[layer] <= 0.005
                decisions += 1
    assert choice.single == pytest.approx(single / decisions, abs=1e-9) and 0 < choice.single < 1
    (home / "adapmoe_sensitivity.json").write_text('{"S": [1.0]}')  # too few layers: one clear error
    with pytest.raises(MoeprepError, match="needs 4 finite values"):
        prepare(recipe, root=tmp_path, until="gating")


def test_path_statistics_fit_on_one_imported_problem_hold_out_its_last_tokens(tmp_path):
    traces = synthetic_traces(tmp_path / "traces", tokens=(40, 24))
    _mixtral_shaped(tmp_path, layers=4)
    file = traces / "mixtral-8x7b" / "gsm8k_routing.jsonl"
    prepare(_recipe(file, trace={"problems": [1]}, predict={"predictors": ["path_stats"], "held_out": 0.25}),
            root=tmp_path, until="predict")
    stats, directory = _stage(tmp_path, "predict", PredictionStats)
    assert stats.sequences == {"fitted": 1, "held_out": 1, "tokens_held_out": 6}
    assert stats.path_stats["layers"] and stats.next_gates["layers"] == [] and "skipped" in stats.next_gates
    assert any(name.startswith("path.") for name in StageResult.load_tensors(directory))
    with pytest.raises(MoeprepError, match="next_gates and first_gate read hidden states"):
        prepare(_recipe(file, trace={"problems": [1]}, predict={"predictors": ["next_gates"]}), root=tmp_path,
                until="predict")


@pytest.mark.skipif(real_traces() is None, reason=f"the real Mixtral traces are not at {REAL_FILE}")
def test_the_gating_stage_fed_adapmoes_sensitivity_reproduces_its_single_expert_share_on_gsm8k(tmp_path):
    """AdapMoE's S_l for Mixtral-8x7B at its T = 0.005 on the real GSM8K decisions of all 32 layers: 25.2% of the
    (token, layer) decisions keep the top-1 expert alone (the paper reports 25.8% on its own data)."""
    _mixtral_shaped(tmp_path, layers=32)
    prepare(_recipe(REAL_FILE, gating={"enabled": True, "sensitivity_file": str(REAL_SENSITIVITY),
                                       "threshold": 0.005}), root=tmp_path, until="gating")
    choice, _ = _stage(tmp_path, "gating", GatingChoice)
    assert choice.single == pytest.approx(0.252, abs=0.005)
    assert choice.runs_saved == pytest.approx(choice.single / 2)  # top-2: one run saved per single decision
    assert "AdapMoE" in choice.details["sensitivity_file"]["source"]
