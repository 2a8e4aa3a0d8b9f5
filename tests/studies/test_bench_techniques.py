"""The ``mixtral-shape-techniques`` bench subject: one artifact per technique, each prepared by the real
stages from Mixtral's recorded decisions on the problems not replayed, run by the bench in ``--quick`` form; and
dynamic precision replayed on those decisions, where the loader and the simulator must decide alike.

The real Mixtral traces are used where ``../shared/data`` has them, else synthetic ones in their format
(``tests/helpers/mixtral_traces.py``), so both tests run in CI."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import prep.studies.bench.measure as bench_measure
import prep.studies.bench.run as bench_run
from prep.cli import main
from prep.studies.bench.subjects import TECHNIQUES, mixtral_shape_techniques_subject
from tests.helpers.bench_builds import seed_quick_shape
from tests.helpers.mixtral_traces import traces_root

pytestmark = pytest.mark.xdist_group("bench-techniques")  # one worker builds the module's subject, not each


@pytest.fixture(scope="module")
def techniques(tmp_path_factory):
    """(bench output dir, traces root, the quick subject) built once for the module."""
    tmp = tmp_path_factory.mktemp("techniques")
    traces = traces_root(tmp)
    out = seed_quick_shape(tmp_path_factory, tmp / "bench")
    subject = mixtral_shape_techniques_subject(out, traces, True, 4, 4, echo=lambda m: None)
    return out, traces, subject


def _plan(artifact) -> dict:
    return json.loads((artifact / "plan.json").read_text())


def test_each_technique_artifact_carries_its_technique_and_was_fitted_without_the_replayed_problem(techniques):
    _, traces, subject = techniques
    variants = subject.variants | {"moeprep": subject.artifact}
    assert set(variants) == set(TECHNIQUES)
    plans = {s: _plan(a) for s, a in variants.items()}
    sensitivity = json.loads((traces / "mixtral-8x7b" / "adapmoe_sensitivity.json").read_text())
    gating = plans["int4+gating"]["routing"]
    assert gating["name"] == "adaptive_gating" and gating["params"]["threshold"] == sensitivity["threshold_T"]
    assert gating["params"]["sensitivity"] == sensitivity["S"][:4]  # the quick shape's 4 layers
    miss = plans["int4+dynamic_precision"]["miss"]
    assert miss["name"] == "dynamic_precision" and 0 <= miss["params"]["t1"] <= miss["params"]["t2"] <= 1
    assert [p["precision"] for p in plans["int4+dynamic_precision"]["pools"]] == ["int4"]  # low copies: main slots
    assert miss["params"]["low"] == "int2"
    assert [p["name"] for p in plans["int4+path_stats"]["predictors"]] == ["path_stats"]
    allocated = plans["int4+allocation"]["operating_points"]  # the DP's per-layer allocation at each point
    assert allocated and all("layers" in pool for point in allocated for pool in point["pools"])
    for system in ("int4", "int4+gating", "int4+path_stats", "int4+allocation"):  # one technique each
        others = {k for k in ("routing", "miss") if plans[system][k]["name"] not in ("topk", "plan")}
        assert others <= {"int4+gating": {"routing"}}.get(system, set()), system
    assert plans["moeprep"]["routing"]["name"] == "adaptive_gating"
    assert plans["moeprep"]["miss"]["name"] == "dynamic_precision"
    facts = subject.facts["techniques"]
    assert facts["replayed_problem"] not in facts["fitted_problems"]


def test_the_techniques_subject_runs_in_the_quick_bench(techniques, monkeypatch, forked_workers):
    out, traces, _ = techniques
    monkeypatch.setattr(bench_measure, "RESIDENT_DTYPES", ("float32",))
    monkeypatch.setattr(bench_measure, "EXPERTS_IMPLEMENTATIONS", ("grouped_mm",))
    monkeypatch.setattr(bench_measure, "CUDA_RESIDENT_DTYPES", ())
    result = CliRunner().invoke(main, ["bench", "--quick", "--subject", "mixtral-shape-techniques", "--output",
                                       str(out), "--traces", str(traces)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    rows = {r["system"]: r for r in report["results"] if r["budget"] == "25%"}
    assert set(TECHNIQUES) | {"naive", "resident"} <= set(rows)
    for system in ("naive", *TECHNIQUES):
        r = rows[system]
        assert not r.get("error"), (system, r.get("error"))
        assert r["decode_tokens_per_s"] > 0 and r["bytes_read_per_token"] >= 0 and r["misses_per_token"] >= 0
        assert r["modelled_tokens_per_s"] and r["modelled_tokens_per_s"] > 0, (system, r.get("modelled_error"))
    assert rows["int4+gating"]["decisions"]["routing"]["decisions"] > 0  # the plan's gating ran on the replay
    assert rows["int4"]["decisions"]["routing"] is None
    md = (out / "bench.md").read_text()
    assert "Techniques at Mixtral's shape" in md and "| 25% | int4+dynamic_precision |" in md
    assert "HOBBIT section 5.3" in md and "AdapMoE's own log" in md
    assert "moeprep with the techniques >= 3x llama.cpp Q4" in result.output


def test_dynamic_precision_on_mixtrals_decisions_the_loader_and_the_simulator_decide_alike(techniques):
    """The replayed problem's decisions through the int4+dynamic_precision artifact at a budget that misses: the
    loader (its plan's own miss policy, on the replay) and the simulator (the same plan) read high, read low and
    skip the same misses, and hit, miss and read the same bytes per layer."""
    from loader.budget import minimum_budget
    from loader.routing import DynamicPrecision, ReplayRouting
    from loader.runtime import load
    from prep.methods.trace import RoutingTrace, read_mixtral_traces
    from prep.sim.replay import replay_from_routing
    from prep.sim.simulate import artifact_spec, simulate

    _, _, subject = techniques
    artifact = subject.variants["int4+dynamic_precision"]
    plan = _plan(artifact)
    facts = subject.facts["techniques"]  # every token of the replayed problem, the model's 4 layers
    recorded = read_mixtral_traces(facts["routing_file"])[facts["replayed_problem"]]
    ids, weights = recorded.expert_ids[:, :4].contiguous(), recorded.expert_weights[:, :4].contiguous()
    budget = minimum_budget(artifact) + 6 * 4096
    loaded = load(artifact, memory_budget=budget, replay=ReplayRouting(ids, weights))
    tokens = torch.zeros(1, ids.shape[0], dtype=torch.long) + 5
    with torch.no_grad():
        step = loaded.model(input_ids=tokens[:, :1], use_cache=True)
        for t in range(1, ids.shape[0]):
            step = loaded.model(input_ids=tokens[:, t:t + 1], past_key_values=step.past_key_values, use_cache=True)
    stats = loaded.stats()
    loaded.close()

    miss = DynamicPrecision(**plan["miss"]["params"])
    replay = replay_from_routing([RoutingTrace(ids, weights)], 8, "replayed problem")
    result = simulate(replay, artifact_spec(artifact, budget), miss=miss).to_json()
    decided = {k: v for k, v in stats["miss_policy"].items() if k != "policy"}
    assert decided == {k: v for k, v in miss.stats().items() if k != "policy"}
    assert decided["high"] > 0 and decided["low"] + decided["skip"] > 0  # the three answers are exercised
    for layer, row in enumerate(result["layers"]):
        mine = stats["layers"][str(layer)]
        assert (row["hits"], row["misses"], row["skipped"], row["bytes_read"]) == (
            mine["hits"], mine["misses"], mine["skipped"], mine["bytes_read"]), layer


def test_a_subject_asked_for_by_name_without_its_traces_is_one_clear_error(tmp_path):
    """Named (alone or in a list), a subject the traces are missing for stops the run before anything is built."""
    from prep.errors import MoeprepError

    for subjects in ("mixtral-shape-techniques", "mixtral-shape-techniques,mixtral-shape-own", "mixtral-shape"):
        with pytest.raises(MoeprepError, match="skipped: the real Mixtral traces are not in .*--traces DIR"):
            bench_run.run_bench(subjects, "25%", output=tmp_path / "bench", traces=tmp_path / "none",
                                echo=lambda m: None)
    assert not (tmp_path / "bench" / "mixtral-shape").exists()
