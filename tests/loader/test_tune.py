"""``moeload tune`` and the device file (``loader/tune.py``, ``loader/tuning.py``).

The decisions are driven by a fake engine clock (no real timing in a test): a made-up technique that adds a fixed
delay per token is switched off, one that removes a fixed delay is kept. On a copy of the shared reference-lossless
artifact (its plan runs three predictors): the device file is sealed, a damaged one is refused by ``load``, ``verify``
and ``plan`` naming it, and a load with it runs exactly the predictors it keeps (counted). One real run of a variant
replays the routing sample through the loader in this process.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from loader.errors import ArtifactError
from loader.plan import OperatingPoint, Plan, PolicySpec, Pool
from loader.tune import RunFailed, paired_ratio, tune, tune_decisions
from loader.tuning import TUNING_FILE, read_tuning, techniques, without

TOKENS = 24
BASE = 0.010  # seconds per token with no technique


class FakeClock:
    """The engine clock of the fake runs: time passes only as a run's tokens are 'computed'."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_run(clock: FakeClock, delays: dict[str, float], noise: float = 0.0004):
    """A runner whose tokens take BASE plus the delay of every technique left on, with seeded noise per token."""

    def run(variant, round_):
        from loader.tune import Run

        on = [n for n in delays if n not in variant.off]
        rng = random.Random(f"{variant.name}/{round_}")
        seconds = []
        for _ in range(TOKENS):
            t = BASE + sum(delays[n] for n in on) + rng.gauss(0, noise)
            clock.now += t
            seconds.append(t)
        return Run(variant.name, round_, seconds)

    return run


def quiet(*_args) -> None:
    pass


def test_a_technique_that_adds_a_delay_is_switched_off_and_one_that_removes_a_delay_is_kept():
    clock = FakeClock()
    delays = {"adds_delay": 0.002, "removes_delay": -0.003, "does_nothing": 0.0}
    kept, off, decisions, measured, runs = tune_decisions(list(delays), fake_run(clock, delays), 600.0, clock, quiet)
    assert kept == ["removes_delay"]
    assert sorted(off) == ["adds_delay", "does_nothing"]
    assert decisions["adds_delay"]["verdict"] == "loses" and decisions["adds_delay"]["high"] < 1
    assert decisions["removes_delay"]["verdict"] == "pays" and decisions["removes_delay"]["low"] > 1
    # no effect: off (within noise, or a chance loss), its ratio near 1
    assert decisions["does_nothing"]["verdict"] in ("within noise", "loses")
    assert decisions["does_nothing"]["ratio"] == pytest.approx(1, abs=0.05)
    # without the delay of 3 ms a token takes 10 (+2 with adds_delay): the ratio is (12 - 3 + 3) / (12 - 3)
    assert decisions["removes_delay"]["ratio"] == pytest.approx((BASE + 0.002) / (BASE - 0.001), rel=0.02)
    # the kept set (removes_delay alone) was measured against plain, and pays
    assert measured["check"]["verdict"] == "pays" and measured["check"]["ratio"] > 1
    assert measured["rounds"] >= 3
    assert {r.variant for r in runs} >= {"all", "plain", "-adds_delay", "-removes_delay", "-does_nothing", "tuned"}


def test_the_decisions_are_the_same_in_a_second_run_and_the_time_limit_is_respected():
    delays = {"adds_delay": 0.002, "removes_delay": -0.003}
    first = tune_decisions(list(delays), fake_run(FakeClock(), delays), 600.0, FakeClock(), quiet)
    clock = FakeClock()
    again = tune_decisions(list(delays), fake_run(clock, delays), 600.0, clock, quiet)
    assert first[:2] == again[:2]
    # a limit of 2.5 rounds: a third round is not started, and the check is left out where no time is left
    clock = FakeClock()
    one_round = 4 * TOKENS * BASE
    kept, off, _, measured, runs = tune_decisions(list(delays), fake_run(clock, delays), 2.5 * one_round, clock, quiet)
    assert measured["rounds"] == 2
    assert clock.now < 2.5 * one_round + 2 * TOKENS * 0.02  # at most the run under way when the limit passed
    assert kept == ["removes_delay"] and off == ["adds_delay"]


def test_a_technique_the_budget_needs_is_kept_and_a_failed_plan_run_is_an_error():
    clock = FakeClock()
    delays = {"low_copies": 0.001, "other": 0.0}
    plain_run = fake_run(clock, delays)

    def run(variant, round_):
        if "low_copies" in variant.off:
            raise RunFailed("the budget holds no slot for the int4 records", budget=True)
        return plain_run(variant, round_)

    kept, off, decisions, _, _ = tune_decisions(list(delays), run, 600.0, clock, quiet)
    assert kept == ["low_copies"] and decisions["low_copies"]["verdict"] == "needed by the budget"

    def broken(variant, round_):
        raise RunFailed("the model does not load")

    from loader.tune import TuneError

    with pytest.raises(TuneError, match="the all run failed: the model does not load"):
        tune_decisions(list(delays), broken, 600.0, FakeClock(), quiet)


def test_the_paired_ratio_is_the_ratio_of_the_sums_within_its_bootstrap_interval():
    off = [[2.0, 2.2, 1.8, 2.1] * 4, [2.1, 1.9, 2.0, 2.0] * 4]
    on = [[1.0, 1.0, 1.0, 1.0] * 4, [1.0, 1.0, 1.0, 1.0] * 4]
    ratio, low, high = paired_ratio(off, on)
    assert ratio == pytest.approx(sum(map(sum, off)) / sum(map(sum, on)))
    assert low <= ratio <= high and 1 < low and high < 2.2
    same = paired_ratio([[3.0] * 16], [[1.5] * 16])
    assert same == pytest.approx((2.0, 2.0, 2.0))


def test_each_technique_is_switched_off_to_what_a_plain_plan_does():
    base = Plan.default(2, 4, "int4")
    full = dataclasses.replace(
        base, routing=PolicySpec("adaptive_gating", {"threshold": 0.1}), miss=PolicySpec("dynamic_precision"),
        predictors=(PolicySpec("next_gates", {"depth": 2}), PolicySpec("path_stats")), eviction=PolicySpec("lfu"),
        neuron=PolicySpec("sparse", {"theta": 0.1}), layer_capacity=(1.0, 2.0),
        operating_points=(OperatingPoint(100, (Pool("main", "int4", 1.0, "layer", (1.0, 3.0)),)),))
    assert techniques(full) == ["adaptive_gating", "dynamic_precision", "next_gates", "path_stats", "neuron",
                                "eviction", "allocation"]
    assert techniques(base) == []
    plain = without(full, techniques(full))
    assert dataclasses.replace(plain, expert_precision=base.expert_precision) == base
    one = without(full, ["next_gates"])
    assert [s.name for s in one.predictors] == ["path_stats"] and one.routing == full.routing
    with pytest.raises(ArtifactError, match=r"switches off \['first_gate'\], which this artifact's plan does not run"):
        without(full, ["first_gate"])


# ------------------------------------------------------------------------------------- on a real artifact


@pytest.fixture
def artifact(reference_lossless_artifact, tmp_path):
    """A writable copy of the shared reference-lossless artifact (predictors next_gates, path_stats, first_gate)."""
    from tests.helpers.shared import writable_copy

    root = writable_copy(reference_lossless_artifact.parents[2], tmp_path / "root")
    return root / "artifacts" / "reference-lossless" / "artifact"


def fake_runner(clock: FakeClock, delays: dict[str, float]):
    """``tune``'s runner with the fake engine clock: the spec's ``off`` techniques are left out of each token's time."""

    def runner(spec):
        on = [n for n in delays if n not in spec["off"]]
        rng = random.Random(f"{spec['variant']}/{spec['round']}")
        seconds = [BASE + sum(delays[n] for n in on) + rng.gauss(0, 0.0004) for _ in range(TOKENS)]
        clock.now += sum(seconds)
        return {"seconds": seconds, "bytes_read_per_token": 1000.0 * len(on)}

    return runner


def tuned(artifact, delays) -> object:
    clock = FakeClock()
    return tune(artifact, "25%", 10, runner=fake_runner(clock, delays), clock=clock, echo=quiet)


def test_tune_writes_a_sealed_device_file_and_a_load_runs_exactly_the_techniques_it_keeps(artifact):
    import torch

    from loader.format import read_manifest
    from loader.hashing import sha256_file
    from loader.prefill import decode
    from loader.runtime import load

    point = tuned(artifact, {"next_gates": 0.003, "path_stats": -0.002, "first_gate": 0.0})
    assert point.kept == ("path_stats",) and set(point.off) == {"next_gates", "first_gate"}
    manifest = read_manifest(artifact)
    entry = manifest.files[TUNING_FILE]  # sealed: listed with its size and sha256
    assert entry["sha256"] == sha256_file(manifest.path(TUNING_FILE))
    assert read_tuning(manifest).points[0].kept == ("path_stats",)

    calls: dict[str, int] = {}
    loaded = load(artifact, memory_budget="25%")
    try:
        for p in loaded.runtime.predictors:
            original = p.after_router

            def counted(*args, _original=original, _name=p.name, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _original(*args, **kwargs)

            p.after_router = counted
        decode(loaded, torch.tensor([[1, 2, 3, 4]]), 4)
        assert loaded.stats()["tuning"]["applied"] and loaded.stats()["tuning"]["off"] == list(point.off)
    finally:
        loaded.close()
    layers = len(manifest.moe.layers)
    # the kept predictor ran at every MoE layer of every forward (the prompt's, then each decode step's); no other did
    assert set(calls) == {"path_stats"} and calls["path_stats"] >= 2 * layers and calls["path_stats"] % layers == 0

    ignored = load(artifact, memory_budget="25%", ignore_device_file=True)
    try:
        assert [p.name for p in ignored.runtime.predictors] == ["next_gates", "path_stats", "first_gate"]
        assert not ignored.stats()["tuning"]["applied"]
    finally:
        ignored.close()


def test_a_damaged_device_file_is_refused_by_load_verify_and_plan_naming_it(artifact):
    from loader.fit import preview
    from loader.runtime import load
    from loader.verify import verify

    tuned(artifact, {"next_gates": 0.003, "path_stats": -0.002, "first_gate": 0.0})
    path = artifact / TUNING_FILE
    text = json.loads(path.read_text())
    text["points"][0]["off"] = []  # a hand edit keeping every technique: the sha256 no longer matches
    text["points"][0]["kept"] = ["next_gates", "path_stats", "first_gate"]
    path.write_text(json.dumps(text, indent=1))
    with pytest.raises(ArtifactError, match=f"{TUNING_FILE}: .*moeload tune") as refused:
        load(artifact, memory_budget="25%")
    assert refused.value.file == TUNING_FILE
    assert [line for line in verify(artifact) if line.startswith(f"{TUNING_FILE}: ")]
    with pytest.raises(ArtifactError, match=f"{TUNING_FILE}: is [0-9]+ bytes, the manifest says"):
        preview(artifact, "25%")
    # a device file the manifest does not list (a tune stopped between its two writes) is refused too
    from loader.format import read_manifest, write_manifest

    raw = dict(read_manifest(artifact).raw)
    raw["files"] = {k: v for k, v in raw["files"].items() if k != TUNING_FILE}
    write_manifest(artifact, raw)
    with pytest.raises(ArtifactError, match="its manifest does not list it"):
        load(artifact, memory_budget="25%")
    assert [line for line in verify(artifact) if line.startswith(f"{TUNING_FILE}: ")]
    # tune replaces it and says so
    lines = []
    clock = FakeClock()
    tune(artifact, "25%", 10, runner=fake_runner(clock, {"next_gates": 0.0, "path_stats": 0.0, "first_gate": 0.0}),
         clock=clock, echo=lines.append)
    assert any("replacing the damaged device file" in line for line in lines)
    assert verify(artifact) == []


def test_plan_says_the_techniques_are_untested_until_tune_has_run(artifact):
    from loader.fit import describe, preview

    view = preview(artifact, "25%")
    assert not view["tuning"]["applied"] and "run `moeload tune`" in view["tuning"]["why"]
    assert any("untested on any device" in line for line in describe(view))
    tuned(artifact, {"next_gates": 0.003, "path_stats": -0.002, "first_gate": 0.0})
    view = preview(artifact, "25%")
    assert view["tuning"]["kept"] == ["path_stats"]
    assert any("techniques kept path_stats" in line for line in describe(view))


def test_one_run_replays_the_routing_sample_through_the_loader(artifact, one_thread):
    from loader.tune import measure_variant

    out = measure_variant({"artifact": str(artifact), "memory_budget": "25%", "device": "cpu", "store": "disk",
                           "off": ["first_gate"], "tokens": 12, "routing": None})
    assert len(out["seconds"]) == 12 and all(s > 0 for s in out["seconds"])
    assert out["bytes_read_per_token"] > 0 and out["misses_per_token"] > 0
    assert out["next_gates_us_per_token"] > 0 and out["path_stats_us_per_token"] > 0
    assert "first_gate_us_per_token" not in out


def test_a_device_profile_carries_the_decisions_into_the_plan_a_preparation_ships(tmp_path):
    from loader.device import DeviceProfile, load_profile, write_profile
    from loader.tune import add_to_profile
    from loader.tuning import TunedPoint, profile_choice

    plan = dataclasses.replace(Plan.default(2, 4, "int4"), routing=PolicySpec("adaptive_gating", {"threshold": 0.1}),
                               predictors=(PolicySpec("next_gates"), PolicySpec("path_stats")))
    shipped, choice = profile_choice(plan, None)
    assert shipped == plan and not choice["tested"] and "untested on any device" in choice["why"]

    path = write_profile(DeviceProfile(1e9, 1e-4, {"int4": 1e-3}, "cpu"), tmp_path / "device.json")
    point = TunedPoint("cpu", 1 << 30, "25%", ("path_stats",), ("adaptive_gating", "next_gates"),
                       {"next_gates": {"verdict": "loses"}}, {"cpu": "test"}, {"rounds": 3})
    add_to_profile(path, point)
    profile = load_profile(path)  # still a valid profile, the decisions riding along
    shipped, choice = profile_choice(plan, profile.to_json())
    assert techniques(shipped) == ["path_stats"] and shipped.routing == PolicySpec("topk")
    assert choice["tested"] and choice["off"] == ["adaptive_gating", "next_gates"] and choice["budget"] == "25%"


def test_a_run_cut_short_at_the_time_limit_ends_the_check_and_the_decisions_stand():
    from loader.tune import RunCutShort

    clock = FakeClock()
    delays = {"adds_delay": 0.002, "removes_delay": -0.003}
    inner = fake_run(clock, delays)

    def run(variant, round_):
        if variant.name == "tuned":
            raise RunCutShort("tuned")
        return inner(variant, round_)

    kept, off, _, measured, _ = tune_decisions(list(delays), run, 600.0, clock, quiet)
    assert kept == ["removes_delay"] and off == ["adds_delay"]
    assert measured["check"]["verdict"].startswith("not run")


def test_auto_tokens_fit_three_rounds_and_the_check_in_the_limit():
    """A fake process: 5 s to start and load, 0.5 s a token. The tokens chosen from one probe let three rounds of
    every variant (four techniques: six variants) and the check finish before the limit."""
    from loader.tune import WARMUP_TOKENS, Run, auto_tokens

    clock = FakeClock()

    def process(spec):
        n = spec["tokens"]
        clock.now += 5 + 0.5 * (n + WARMUP_TOKENS)
        return {"seconds": [0.5] * n}

    deadline = 15 * 60
    tokens = auto_tokens(lambda spec: process(spec | {"tokens": spec.get("tokens", 0)}), 4, deadline, clock, 3)
    assert 8 <= tokens <= 64

    def run(variant, round_):
        return Run(variant.name, round_, process({"tokens": tokens})["seconds"])

    *_, measured, runs = tune_decisions(["a", "b", "c", "d"], run, deadline, clock, quiet)
    assert measured["rounds"] >= 3 and clock.now <= deadline


def test_one_round_decides_nothing_every_technique_is_within_noise_and_off():
    clock = FakeClock()
    delays = {"adds_delay": 0.002, "removes_delay": -0.003}
    kept, off, decisions, _, _ = tune_decisions(list(delays), fake_run(clock, delays), 600.0, clock, quiet,
                                                min_rounds=1, max_rounds=1)
    assert kept == [] and sorted(off) == ["adds_delay", "removes_delay"]
    assert all(d["verdict"] == "within noise" and "one round" in d["why"] for d in decisions.values())


def test_the_command_refuses_a_bad_token_count_in_one_line(tmp_path):
    from click.testing import CliRunner

    from loader.cli import main

    for tokens, said in (("3", "--tokens 3: time at least 8 tokens"), ("many", "--tokens 'many': use auto or a number")):
        result = CliRunner().invoke(main, ["tune", str(tmp_path), "--tokens", tokens])
        assert result.exit_code == 1 and said in result.output, result.output
