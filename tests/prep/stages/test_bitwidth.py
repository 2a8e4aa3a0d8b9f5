"""Mixed-precision experts end to end: the bit-width methods, the stores per precision, the loader.

The parity reference is built from the artifact's own store files, decoded record by record with the
layout the manifest declares, and written into a fresh transformers model: no pipeline code in between.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from loader.cli import main as moeload
from loader.codec import RecordLayout
from loader.format import expert_key
from loader.runtime import load, minimum_budget
from loader.verify import verify
from prep.errors import MoeprepError
from prep.pipeline import prepare
from prep.stages.bitwidth import edgemoe_search, flat_order
from tests.helpers.tiny_models import (
    ARCHITECTURES,
    planned_reference,
    prepare_tiny_artifact,
    random_sequences,
    save_tiny_model,
    tiny_recipe,
)

MIXED = {"quantize": {"also": ["int2"]}, "bitwidth": {"method": "random", "share": 0.5, "low": "int2"}}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_mixed_artifact_matches_each_expert_at_its_own_precision(arch, tmp_path):
    model, art = prepare_tiny_artifact(tmp_path, arch, recipe=tiny_recipe("int4", **MIXED))
    plan = json.loads((art / "plan.json").read_text())
    used = {p for row in plan["expert_precision"] for p in row}
    assert used == {"int4", "int2"}, used
    manifest = json.loads((art / "manifest.json").read_text())
    for precision, store in manifest["stores"].items():  # each store holds exactly its planned experts
        planned = {expert_key(layer, e) for layer, row in zip(manifest["moe"]["layers"], plan["expert_precision"],
                                                              strict=True) for e, p in enumerate(row) if p == precision}
        assert set(store["xxh3"]) == planned
    assert verify(art) == []
    expected_model = planned_reference(model, art)
    ids = torch.stack([s[:10] for s in random_sequences(2, 10, seed=3)])
    with torch.no_grad():
        expected = expected_model(input_ids=ids).logits
    for budget in (minimum_budget(art), "unlimited"):
        loaded = load(art, memory_budget=budget)
        with torch.no_grad():
            got = loaded.model(input_ids=ids).logits
        stats, b = loaded.stats(), loaded.budget
        loaded.close()
        assert torch.allclose(got, expected, atol=1e-4), (arch, budget, float((got - expected).abs().max()))
        if budget != "unlimited":
            assert stats["peak_expert_bytes"] <= b["limit_bytes"] - b["dense_bytes"]
            assert set(b["record_bytes"]) == {"int4", "int2"}


def test_info_shows_the_precision_mix_and_bytes_per_precision(tmp_path):
    _, art = prepare_tiny_artifact(tmp_path, "mixtral", recipe=tiny_recipe("int4", **MIXED))
    result = CliRunner().invoke(moeload, ["info", str(art), "--json"])
    assert result.exit_code == 0, result.output
    stores = json.loads(result.output)["stores"]
    plan = json.loads((art / "plan.json").read_text())
    flat = [p for row in plan["expert_precision"] for p in row]
    assert {p: s["experts"] for p, s in stores.items()} == {p: flat.count(p) for p in set(flat)}
    for precision, s in stores.items():
        layout = RecordLayout.from_json(json.loads((art / "manifest.json").read_text())["stores"][precision]["layout"])
        weights = sum(m.numel for m in layout.matrices)
        assert s["bits_per_weight"] == pytest.approx(s["record_bytes"] * 8 / weights, abs=1e-3)
    assert stores["int2"]["bits_per_weight"] < stores["int4"]["bits_per_weight"]
    report = json.loads((art / "report.json").read_text())
    assert report["bitwidth"]["method"] == "random" and report["bitwidth"]["share"] == 0.5
    assert report["bitwidth"]["experts"] == {p: flat.count(p) for p in set(flat)}
    assert report["bitwidth"]["loss"] > 0


def _scan(loss, order, hi, lo, n_layers, n_experts, tolerance):
    """Brute force: the largest K whose configuration meets the tolerance."""
    from prep.stages.bitwidth import _moved_down

    return max(k for k in range(len(order) + 1)
               if loss(_moved_down(order, k, n_experts, hi, lo, n_layers)) <= tolerance)


@pytest.mark.parametrize("tolerance", [0.0, 0.05, 0.31, 0.62, 0.99, 2.0])
def test_edgemoe_search_finds_the_largest_k_within_the_tolerance(tolerance):
    torch.manual_seed(0)
    n_layers, n_experts = 3, 8
    damage = {"int8": 0.001, "int4": 0.02, "int3": 0.05, "int2": 0.12}  # per expert, additive and monotone
    weight = torch.rand(n_layers, n_experts).tolist()
    calls = []

    def loss(grid):
        calls.append(1)
        return sum(damage[p] * (0.5 + weight[i][e]) for i, row in enumerate(grid) for e, p in enumerate(row))

    order = flat_order(weight)  # least damaging first
    grid, details = edgemoe_search(lambda grids, desc: {name: loss(g) for name, g in grids.items()}, order,
                                   ["int8", "int4", "int3", "int2"], tolerance, n_layers, n_experts)
    bounds = details["bounds"]
    passing = [p for p in ["int8", "int4", "int3", "int2"] if bounds[p] <= tolerance]
    if not passing:
        assert not details["met"] and {p for row in grid for p in row} == {"int8"}
        return
    hi = passing[-1]
    assert details["b_hi"] == hi
    if hi == "int2":
        assert {p for row in grid for p in row} == {"int2"}
        return
    lo = details["b_lo"]
    assert details["K"] == _scan(loss, order, hi, lo, n_layers, n_experts, tolerance)
    assert sum(p == lo for row in grid for p in row) == details["K"]
    assert loss(grid) <= tolerance and details["loss"] == pytest.approx(loss(grid))
    assert len(details["trail"]) <= 8  # bisection, not a scan of 24 values
    assert all(isinstance(k, int) for k, _ in details["trail"])


def test_flat_order_is_ascending_with_ties_by_index():
    assert flat_order([[0.3, 0.1], [0.1, 0.0]]) == [3, 1, 2, 0]


def test_frequency_puts_the_least_used_share_of_each_layer_low_and_edgemoe_runs_end_to_end(tmp_path):
    save_tiny_model("mixtral", tmp_path / "model")
    recipe = tiny_recipe("int4", quantize={"also": ["int2"]}, bitwidth={"method": "frequency", "share": 0.5})
    prepare(recipe, root=tmp_path, output=tmp_path / "artifact")
    stages = tmp_path / "artifacts" / "tiny" / "stages"
    trace = json.loads(next(stages.glob("trace-*/result.json")).read_text())["result"]
    plan = json.loads((tmp_path / "artifact" / "plan.json").read_text())
    for shares, row in zip(trace["expert_share"], plan["expert_precision"], strict=True):
        low = sorted(range(len(shares)), key=lambda e: (shares[e], e))[: len(shares) // 2]
        assert [p == "int2" for p in row] == [e in low for e in range(len(shares))]

    recipe = tiny_recipe("int4", quantize={"also": ["int8", "int2"]},
                         bitwidth={"method": "edgemoe", "tolerance": 0.02})
    summary = prepare(recipe, root=tmp_path, output=tmp_path / "artifact")
    assert not summary["sensitivity"]["cached"] and not summary["quantize"]["cached"]
    profile = json.loads(next(stages.glob("sensitivity-*/result.json")).read_text())["result"]
    assert profile["method"] == "sweep" and len(profile["sweep"]) == 2 and -1 <= profile["spearman"] <= 1
    assert all(v >= 0 for row in profile["sweep"] for v in row)
    report = json.loads((tmp_path / "artifact" / "report.json").read_text())
    assert report["bitwidth"]["method"] == "edgemoe" and report["bitwidth"]["tolerance"] == 0.02
    assert report["bitwidth"]["met"] is (report["bitwidth"]["loss"] <= 0.02)
    assert report["bitwidth"]["b_hi"] in ("int8", "int4", "int2")
    assert verify(tmp_path / "artifact") == []
    again = prepare(recipe, root=tmp_path, output=tmp_path / "artifact")
    assert all(again[s]["cached"] for s in ("trace", "quantize", "sensitivity", "bitwidth", "package"))


@pytest.mark.parametrize("sections, message", [
    ({"bitwidth": {"method": "greedy"}}, "bitwidth.method 'greedy' unknown"),
    ({"bitwidth": {"method": "frequency"}}, "add it to quantize.also"),
    ({"quantize": {"also": ["int1"]}}, "precision 'int1' unknown"),
    ({"bitwidth": {"method": "random", "share": 1.5}, "quantize": {"also": ["int2"]}}, "share must be in"),
])
def test_bad_bitwidth_recipes_are_refused_with_the_fix(sections, message):
    with pytest.raises(MoeprepError, match=message):
        tiny_recipe("int4", **sections)
