"""The bit-width stage's candidate losses and the bit-width study's rows as work units.

A unit's loss is checked against the plain computation (a fresh transformers model, its experts written from the
decoded records, at one torch thread); a driver killed mid-search or mid-study resumes with what its units
wrote; the search with ``fanout`` 1 is the bisection it replaced, and a wider one finds the same K."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import prep.stages.bitwidth as bitwidth_stage
import prep.studies.bitwidth as bitwidth_study
from prep.cli import main as moeprep
from prep.errors import MoeprepError
from prep.methods.decoded import DecodedExperts, mean_kl, next_token_logprobs, original_experts
from prep.pipeline import _Sources, prepare
from prep.stages.bitwidth import _moved_down, _uniform, edgemoe_search, flat_order, held_out
from prep.stages.quantize import PackedExperts
from tests.helpers.interrupt import interrupted, uninterrupted
from tests.helpers.tiny_models import save_tiny_model, tiny_recipe, write_tiny_suites

REPO = Path(__file__).resolve().parents[3]


def edgemoe_recipe(**sections):
    return tiny_recipe("int4", quantize={"also": ["int8", "int2"]},
                       bitwidth={"method": "edgemoe", "tolerance": 0.02}, **sections)


def stage_dir(root: Path, stage: str) -> Path:
    (found,) = (root / "artifacts/tiny/stages").glob(f"{stage}-*")
    return found


def result_of(root: Path, stage: str = "bitwidth") -> dict:
    return json.loads((stage_dir(root, stage) / "result.json").read_text())["result"]


# --- the stage ---------------------------------------------------------------------------------------------


def test_unit_losses_equal_the_direct_computation_at_one_thread(root):
    """Every loss the units wrote (edgemoe's bounds and search, frequency's one loss) equals the loss computed
    directly: source log-probs, the decoded experts written into a plain transformers model, the mean KL."""
    from transformers import AutoModelForCausalLM

    from prep.adapters import get_adapter

    recipe = edgemoe_recipe()
    summary = prepare(recipe, root=root, until="bitwidth")
    edgemoe = result_of(root)
    assert summary["bitwidth"]["units"]["ran"] == 3 + len(edgemoe["details"]["trail"])
    assert edgemoe["details"]["trail"] and edgemoe["details"]["b_lo"] == "int2"  # the search ran
    assert not (stage_dir(root, "bitwidth") / bitwidth_stage.SEQUENCES).exists()
    frequency = tiny_recipe("int4", quantize={"also": ["int8", "int2"]}, bitwidth={"method": "frequency",
                                                                                    "share": 0.5})
    prepare(frequency, root=root, until="bitwidth")
    (chosen_file,) = (root / "artifacts/tiny/stages").glob("bitwidth-*/chosen.json")  # frequency's one unit
    chosen = json.loads(chosen_file.read_text())
    stored = json.loads((chosen_file.parent / "result.json").read_text())["result"]

    packed = PackedExperts.load(stage_dir(root, "quantize"))
    decoded = DecodedExperts(stage_dir(root, "quantize"), packed)
    held = held_out(_Sources(recipe, root, root / "model").sequences, recipe.bitwidth.num_sequences)
    model = AutoModelForCausalLM.from_pretrained(root / "model").eval()
    adapter = get_adapter(model)
    order = flat_order(result_of(root, "sensitivity")["ranking"])
    details = edgemoe["details"]
    layers, experts = len(packed.layers), packed.num_experts
    grids = {f"bound {p}": (_uniform(layers, experts, p), v) for p, v in details["bounds"].items()}
    grids |= {f"K {k}": (_moved_down(order, k, experts, details["b_hi"], details["b_lo"], layers), v)
              for k, v in details["trail"]}
    grids["frequency"] = (stored["expert_precision"], chosen["loss"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with original_experts(model, adapter):
            reference = next_token_logprobs(model, held)
            for name, (grid, loss) in grids.items():
                decoded.apply(model, adapter, lambda pos, e, grid=grid: grid[pos][e])
                assert mean_kl(reference, model, held) == loss, name
    finally:
        torch.set_num_threads(threads)
    assert stored["details"]["loss"] == chosen["loss"]
    assert len({loss for _, loss in grids.values()}) > 3  # the configurations really differ


def test_an_interrupted_search_resumes_with_its_finished_evaluations(root, tmp_path_factory, monkeypatch):
    clean, _ = uninterrupted(tmp_path_factory, edgemoe_recipe(), until="bitwidth")
    # the 3 bounds and the first search round are written; Ctrl-C in the second round
    with interrupted(monkeypatch, bitwidth_stage, "evaluate_candidate", on_call=5):
        prepare(edgemoe_recipe(), root=root, until="bitwidth")
    (work,) = (root / "artifacts/tiny/stages").glob(".work-bitwidth-*")
    written = sorted(p.name for p in work.glob("*.json"))
    assert len(written) == 4 and sum(name.startswith("bound-") for name in written) == 3

    resumed = prepare(edgemoe_recipe(), root=root, until="bitwidth")
    units = len(result_of(clean)["details"]["trail"]) + 3
    assert resumed["bitwidth"]["units"] | {"seconds": 0} == {"ran": units - 4, "reused": 4, "retried": 0,
                                                             "seconds": 0}

    assert result_of(root) == result_of(clean)  # no timing in it: the same result
    files = {p.name: p.read_bytes() for p in stage_dir(clean, "bitwidth").glob("*.json")
             if p.name not in ("result.json", ".seal.json")}
    assert len(files) == units
    assert files == {p.name: p.read_bytes() for p in stage_dir(root, "bitwidth").glob("*.json")
                     if p.name not in ("result.json", ".seal.json")}


def bisection(loss, order, hi, lo, n_layers, n_experts, tolerance, bounds):
    """The search before it was split into units (bitwidth VERSION 1), as the reference for fanout 1."""
    n = len(order)
    good, bad, trail = (0, bounds[hi]), (n, bounds[lo]), []
    k = round(n * (tolerance - bounds[hi]) / (bounds[lo] - bounds[hi])) if bounds[lo] > bounds[hi] else 0
    k = min(max(k, 1), n - 1)
    while bad[0] - good[0] > 1:
        value = loss(_moved_down(order, k, n_experts, hi, lo, n_layers))
        trail.append([k, value])
        good, bad = ((k, value), bad) if value <= tolerance else (good, (k, value))
        k = (good[0] + bad[0]) // 2
    return good[0], trail


@pytest.mark.parametrize("tolerance", [0.05, 0.31, 0.62, 0.99])
def test_fanout_one_is_the_bisection_and_a_wider_search_finds_the_same_k_in_fewer_rounds(tolerance):
    torch.manual_seed(0)
    n_layers, n_experts = 4, 8
    damage = {"int8": 0.001, "int4": 0.02, "int3": 0.05, "int2": 0.12}
    weight = torch.rand(n_layers, n_experts).tolist()

    def loss(grid):
        return sum(damage[p] * (0.5 + weight[i][e]) for i, row in enumerate(grid) for e, p in enumerate(row))

    order = flat_order(weight)
    precisions = ["int8", "int4", "int3", "int2"]
    found = {}
    for fanout in (1, 2, 3, 5):
        rounds = []

        def evaluate(grids, desc, rounds=rounds):
            rounds.append(sorted(grids))
            assert len(set(map(str, grids.values()))) == len(grids)  # no candidate twice in a round
            return {name: loss(grid) for name, grid in grids.items()}

        grid, details = edgemoe_search(evaluate, order, precisions, tolerance, n_layers, n_experts, fanout)
        search = rounds[1:]  # the first call is the bounds, one unit per precision
        assert rounds[0] == sorted(f"bound-{p}" for p in precisions)
        assert all(1 <= len(r) <= fanout for r in search)
        assert sum(map(len, search)) == len(details["trail"]) == len({k for k, _ in details["trail"]})
        found[fanout] = (details["K"], len(search), details["trail"])
        if fanout == 1:
            k, trail = bisection(loss, order, details["b_hi"], details["b_lo"], n_layers, n_experts, tolerance,
                                 details["bounds"])
            assert (details["K"], details["trail"]) == (k, trail)
    assert details["b_lo"] is not None  # each tolerance here searches
    assert len({k for k, _, _ in found.values()}) == 1  # a monotone loss: every fanout finds the same K
    assert found[5][1] <= found[2][1] <= found[1][1]
    assert found[1][1] == 1 or found[5][1] < found[1][1]  # (0.62: the first guess is the answer)


def test_fanout_is_checked_and_dry_run_counts_the_bound_units():
    with pytest.raises(MoeprepError, match="bitwidth.fanout must be a whole number >= 1"):
        tiny_recipe("int4", quantize={"also": ["int2"]}, bitwidth={"method": "edgemoe", "fanout": 0})
    assert bitwidth_stage.STAGE.units(edgemoe_recipe(), 2) == 3
    assert bitwidth_stage.STAGE.units(tiny_recipe("int4", quantize={"also": ["int2"]},
                                                  bitwidth={"method": "random"}), 2) == 1
    result = CliRunner().invoke(moeprep, ["prepare", "--recipe", str(REPO / "recipes/reference.yaml"), "--dry-run",
                                          "--set", f"model.path={REPO / 'recipes/reference/model'}"])
    assert "work units: trace 16, quantize 16, sensitivity 4, bitwidth 4 + one map per search round " in result.output, result.output


# --- the study -----------------------------------------------------------------------------------------------

RECIPE = """name: tiny
model: {path: model}
calibration: {num_sequences: 4, sequence_length: 16}
quantize: {group_size: 16}
bitwidth: {num_sequences: 2}
sensitivity: {num_sequences: 2}
"""


def study_root(root: Path) -> dict:
    save_tiny_model("mixtral", root / "model")
    write_tiny_suites(root / "suites")
    (root / "tiny.yaml").write_text(RECIPE)
    return {"root": root, "tolerances": (0.02,), "shares": (), "suites": ("mmlu",), "data": root / "suites",
            "memory_budget": "1GiB", "echo": lambda m: None}


def test_a_killed_study_resumes_with_its_finished_rows(tmp_path, monkeypatch):
    """Rows are units: a driver killed in the third row keeps the two before it, and a later run evaluates only the
    rows not finished; each row's file is its entry of study.json."""
    kwargs = study_root(tmp_path)
    with interrupted(monkeypatch, bitwidth_study, "study_row", on_call=3):
        bitwidth_study.run_study(tmp_path / "tiny.yaml", tmp_path / "out", **kwargs)
    finished = {p.parent.name: p.read_bytes() for p in (tmp_path / "out/rows").glob("*/row.json")}
    assert sorted(finished) == ["uniform-int4", "uniform-int8"]

    evaluated, real = [], bitwidth_study.evaluate_artifact

    def counted(artifact, *args, **kw):
        evaluated.append(Path(kw["output"]).parent.name)
        return real(artifact, *args, **kw)

    monkeypatch.setattr(bitwidth_study, "evaluate_artifact", counted)
    study = bitwidth_study.run_study(tmp_path / "tiny.yaml", tmp_path / "out", **kwargs)
    labels = [r["label"] for r in study["rows"]]
    assert labels == ["uniform int8", "uniform int4", "uniform int3", "uniform int2", "edgemoe P=0.02",
                      "random (bytes of edgemoe P=0.02)"]
    assert evaluated == ["uniform-int3", "uniform-int2", "edgemoe-p-0-02", "random-bytes-of-edgemoe-p-0-02"]
    rows = {r.parent.name: json.loads(r.read_text()) for r in (tmp_path / "out/rows").glob("*/row.json")}
    assert [rows[bitwidth_study.Row(label, ()).slug] for label in labels] == study["rows"]
    assert json.loads((tmp_path / "out/study.json").read_text())["rows"] == study["rows"]
    assert all(json.loads(finished[slug]) == rows[slug] for slug in finished)  # kept as they were
    assert not list((tmp_path / "out/rows").glob("*/previous.json"))

    evaluated.clear()
    again = bitwidth_study.run_study(tmp_path / "tiny.yaml", tmp_path / "out", **kwargs)
    assert evaluated == [] and again["rows"] == study["rows"]
    for row in (tmp_path / "out/rows").glob("*/row.json"):  # a study made before rows were units: study.json only
        row.unlink()
    again = bitwidth_study.run_study(tmp_path / "tiny.yaml", tmp_path / "out", **kwargs)
    assert evaluated == [] and again["rows"] == study["rows"]
    changed = bitwidth_study.run_study(tmp_path / "tiny.yaml", tmp_path / "out", **kwargs | {"limit": 2})
    assert len(evaluated) == 6 and all(r["settings"]["limit"] == 2 for r in changed["rows"])  # new settings: new rows


def test_study_on_ray_without_ray_is_one_clear_error_before_any_work(tmp_path, monkeypatch):
    study_root(tmp_path)
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, as on a machine without the extra
    result = CliRunner().invoke(moeprep, ["bitwidth-study", "--recipe", str(tmp_path / "tiny.yaml"), "--output",
                                          str(tmp_path / "out"), "--executor", "ray", "--tolerances", "0.02"])
    assert result.exit_code == 1 and "needs Ray, which is not installed" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()


# --- Ray -----------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray instance at a time on the machine
def test_on_ray_the_losses_and_the_study_rows_are_the_bytes_of_a_local_run(tmp_path, tmp_path_factory):
    """A 2-CPU Ray instance on this machine (``executor.address: local``): the bit-width units' files and the study's
    rows are the same bytes as in-process; two rows prepare in turn (one recipe name) and evaluate side by side. The
    in-process run is the shared clean one (``uninterrupted``), read only."""
    pytest.importorskip("ray")
    local, summary = uninterrupted(tmp_path_factory, edgemoe_recipe(), until="bitwidth")
    on_ray = tmp_path / "ray"
    save_tiny_model("qwen3_moe", on_ray / "model")
    ray_summary = prepare(edgemoe_recipe(executor={"kind": "ray", "address": "local"}), root=on_ray, until="bitwidth")
    for where, ran in ((local, summary), (on_ray, ray_summary)):
        assert ran["bitwidth"]["units"]["ran"] == 3 + len(result_of(where)["details"]["trail"])
    units = [{p.name: p.read_bytes() for p in stage_dir(where, "bitwidth").glob("*.json")
              if p.name not in ("result.json", ".seal.json")}  # the seal holds result.json's hash
             for where in (local, on_ray)]
    assert units[0] == units[1] and len(units[0]) > 3
    results = [result_of(where) for where in (local, on_ray)]
    assert results[0] == results[1]  # no timing in it

    studies = {}
    for where, executor in ((tmp_path / "local-study", {}), (on_ray / "study", {"executor": "ray",
                                                                            "ray_address": "local"})):
        kwargs = study_root(where) | executor
        studies[where] = bitwidth_study.run_study(where / "tiny.yaml", where / "out", **kwargs)
    for study in studies.values():
        for row in study["rows"]:  # where the suites lie; the sensitivity stage's own timings
            row["settings"].pop("data"), row["bitwidth"].pop("sensitivity", None)
    assert [r["label"] for r in studies[tmp_path / "local-study"]["rows"]][-1].startswith("random")
    assert studies[tmp_path / "local-study"]["rows"] == studies[on_ray / "study"]["rows"]
