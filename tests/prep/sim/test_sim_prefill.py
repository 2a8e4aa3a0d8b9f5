"""The modelled prefill (prep/sim/prefill.py): the loader's own schedule on the loader's cache, so on the same
routing it reads what the loader reads; its compute interpolates the profile's prefill timings; its calibration
makes an all-held prefill take the measured time."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loader.device import DeviceProfile
from loader.plan import read_plan
from loader.prefill import PrefillForm, PrefillSpec
from loader.runtime import load, minimum_budget
from prep.sim.prefill import calibrate_prefill, expert_seconds, prompt_routing, simulate_prefill
from prep.sim.replay import Replay
from prep.sim.simulate import artifact_spec
from tests.helpers.tiny_models import tiny_artifact

TIMED = {"int4": {"int4pack": {"make_s": 0.0, "tokens": {"1": 1.0, "16": 4.0, "64": 10.0}},
                  "float32": {"make_s": 3.0, "tokens": {"1": 2.0, "16": 3.0, "64": 5.0}}}}


def _profile(**calibration) -> DeviceProfile:
    return DeviceProfile(1e6, 0.0, {"int4": 0.5, "passthrough": 0.25}, extra={"prefill_seconds_per_expert": TIMED},
                         calibration=calibration)


def test_expert_seconds_interpolate_the_profiles_timings_and_fall_back_to_decode_steps():
    p = _profile()
    assert expert_seconds(p, "int4", "int4pack", 16) == 4.0
    assert expert_seconds(p, "int4", "int4pack", 40) == pytest.approx(4.0 + 6.0 * 24 / 48)
    assert expert_seconds(p, "int4", "int4pack", 128) == pytest.approx(20.0)  # past the last count: its rate
    assert expert_seconds(p, "int4", "int4pack", 1) == 1.0
    assert expert_seconds(p, "passthrough", "record", 8) == pytest.approx(8 * 0.25)  # untimed: decode steps


def test_the_prompt_is_the_sequences_one_after_another_cycled():
    replay = Replay(((((0, 1),), ((2, 3),)), (((4, 5),),)), 1, 8, 2)
    assert prompt_routing(replay, 5) == [((0, 1),), ((2, 3),), ((4, 5),), ((0, 1),), ((2, 3),)]


def _measured(artifact, budget, chunk, ids, plan=None, expert_dtype="auto"):
    """(stats, chunks, replay of the routing the loader saw) of one prefill."""
    loaded = load(artifact, memory_budget=budget, plan=plan, expert_dtype=expert_dtype)
    engine, steps = loaded.runtime, []
    run_layer = engine.run_layer

    def recording(layer, module, hidden, index, weights):
        steps.append(index.tolist())
        return run_layer(layer, module, hidden, index, weights)

    engine.run_layer = recording
    result = loaded.prefill(ids, chunk=min(chunk, engine.prefill_chunk))
    stats = loaded.stats()
    loaded.close()
    layers, tokens = engine.num_layers, []
    for c, size in enumerate(result.chunks):
        for i in range(size):
            tokens.append(tuple(tuple(steps[c * layers + layer][i]) for layer in range(layers)))
    return stats, result.chunks, Replay((tuple(tokens),), layers, engine.num_experts, engine.top_k)


@pytest.mark.parametrize("chunk", [1, 7])
def test_on_the_loaders_routing_the_model_reads_what_the_loader_read(tmp_path_factory, chunk):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    budget = minimum_budget(artifact) + 3 * 4096
    ids = torch.randint(4, 60, (1, 33), generator=torch.Generator().manual_seed(chunk))
    stats, chunks, replay = _measured(artifact, budget, chunk, ids)
    model = simulate_prefill(replay, artifact_spec(artifact, budget), _profile(), 33, chunks)
    assert model.reads == stats["prefill_timing"]["reads"] > 0
    assert model.read_bytes == stats["bytes_read"]
    assert model.chunks == len(chunks)


def test_the_model_uses_the_plans_prefill_forms_as_the_loader_does(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "qwen3_moe", "int4")
    plan = dataclasses.replace(read_plan(artifact), prefill=PrefillSpec(forms=(("int4", PrefillForm("float32", 2)),)))
    budget = minimum_budget(artifact, plan=plan, expert_dtype="bfloat16") + 40 * 4096
    ids = torch.randint(4, 60, (1, 30), generator=torch.Generator().manual_seed(3))
    stats, chunks, replay = _measured(artifact, budget, 10, ids, plan, "bfloat16")
    spec = artifact_spec(artifact, budget, plan=plan)
    profile = DeviceProfile(1e6, 0.0, {"int4": 0.5}, extra={"prefill_seconds_per_expert": {
        "int4": {"bfloat16": TIMED["int4"]["int4pack"], "float32": TIMED["int4"]["float32"]}}})
    model = simulate_prefill(replay, spec, profile, 30, chunks, plan.prefill, {"int4": "bfloat16"})
    assert model.prefill_form_computes == stats["prefill_timing"]["prefill_form_computes"] > 0
    assert model.reads == stats["prefill_timing"]["reads"]


def test_a_calibrated_profile_models_the_all_held_prefill_it_was_fitted_on():
    replay = Replay(tuple((tuple((e % 8, (e + 3) % 8) for e in range(t, t + 2)),) for t in range(4)), 2, 8, 2)
    from prep.sim.simulate import capacity_spec

    spec = capacity_spec(2, 8, 8, "layer", 100, "int4")  # every expert fits
    profile = _profile(overlap=True)
    warm = simulate_prefill(replay, spec, profile, 40, [16, 16, 8])
    calibrated = calibrate_prefill(profile, warm, measured_seconds=warm.seconds + 2.0)
    again = simulate_prefill(replay, spec, calibrated, 40, [16, 16, 8])
    assert calibrated.calibration["prefill_token_overhead_s"] == pytest.approx(2.0 / 40)
    assert again.seconds == pytest.approx(warm.seconds + 2.0)
    with pytest.raises(Exception, match="add up"):
        simulate_prefill(replay, spec, profile, 40, [16, 16])


def test_simulate_prefill_on_the_command_line_needs_an_artifact_and_a_profile(tmp_path_factory, tmp_path):
    import json

    from click.testing import CliRunner

    from loader.device import write_profile
    from prep.cli import main

    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    traces = sorted(p.parent for p in artifact.parent.glob("**/trace-*/trace/index.json"))
    assert traces, f"the tiny preparation under {artifact.parent} kept no trace stage"
    write_profile(_profile(), tmp_path / "device.json")
    runner = CliRunner()
    refused = runner.invoke(main, ["simulate", "--trace", str(traces[0]), "--prefill", "64"])
    assert refused.exit_code == 1 and "--plan ARTIFACT and --profile" in refused.output
    out = runner.invoke(main, ["simulate", "--trace", str(traces[0]), "--plan", str(artifact), "--profile",
                               str(tmp_path / "device.json"), "--budget", str(minimum_budget(artifact) + 3 * 4096),
                               "--prefill", "64", "--json"])
    assert out.exit_code == 0, out.output
    model = json.loads(out.output)
    assert model["tokens"] == 64 and model["reads"] > 0 and model["tokens_per_second"] > 0
