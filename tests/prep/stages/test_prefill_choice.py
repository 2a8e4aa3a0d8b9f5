"""The planner's prefill forms (prep/stages/planning.py ``prefill_choice``) come from the device profile's timings
(prep/sim/device.py ``measure_prefill``): the form that costs less than the held form from a token count on, at
every larger count; the same profile gives the same choice, and the loader takes it as the plan says."""

from __future__ import annotations

import pytest

from loader.device import DeviceProfile
from loader.plan import Plan
from loader.prefill import PrefillForm, PrefillSpec
from prep.stages.planning import prefill_choice, with_prefill


def _profile(timings: dict) -> DeviceProfile:
    return DeviceProfile(1e9, 1e-4, {"int4": 1e-3}, extra={"prefill_seconds_per_expert": timings})


def _form(make: float, per_token: dict) -> dict:
    return {"make_s": make, "tokens": {str(t): s for t, s in per_token.items()}}


HELD = _form(0.0, {1: 1.0, 16: 10.0, 64: 40.0, 256: 160.0})


@pytest.mark.parametrize("other,expected", [
    (_form(5.0, {1: 0.5, 16: 4.0, 64: 10.0, 256: 30.0}), PrefillForm("float32", 16)),  # wins from 16 on
    (_form(25.0, {1: 0.5, 16: 4.0, 64: 10.0, 256: 30.0}), PrefillForm("float32", 64)),  # its making pays from 64
    (_form(500.0, {1: 0.5, 16: 4.0, 64: 10.0, 256: 30.0}), None),  # never pays
    (_form(0.0, {1: 0.5, 16: 20.0, 64: 30.0, 256: 150.0}), PrefillForm("float32", 64)),  # loses at 16: from 64 on
])
def test_the_form_that_wins_from_a_count_on_is_chosen(other, expected):
    spec = prefill_choice(_profile({"int4": {"int4pack": HELD, "float32": other}}), {"int4": "int4pack"})
    assert spec.form_for("int4") == expected
    assert all(prefill_choice(_profile({"int4": {"int4pack": HELD, "float32": other}}), {"int4": "int4pack"}) == spec
               for _ in range(3))


def test_the_earliest_winner_of_several_forms_is_chosen_and_untimed_held_forms_get_none():
    timings = {"int4": {"int4pack": HELD, "float32": _form(30.0, {1: 2, 16: 20, 64: 10, 256: 30}),
                        "bfloat16": _form(5.0, {1: 2, 16: 4, 64: 12, 256: 40})},
               "int8": {"float32": _form(0.0, {1: 0.1, 16: 0.1, 64: 0.1, 256: 0.1})}}
    spec = prefill_choice(_profile(timings), {"int4": "int4pack", "int8": "bfloat16"})
    assert spec.forms == (("int4", PrefillForm("bfloat16", 16)),)  # int8's held form was not timed: no choice
    assert prefill_choice(_profile({}), {"int4": "int4pack"}) == PrefillSpec()  # a profile from before: the default


def test_a_stage_choice_reaches_the_plan_and_a_bad_one_is_refused():
    plan = Plan.default(2, 4, "int4")
    spec = PrefillSpec(forms=(("int4", PrefillForm("float32", 64)),))
    assert with_prefill(plan, spec.to_json()) == spec and with_prefill(plan, None) == plan.prefill
    from prep.errors import MoeprepError

    with pytest.raises(MoeprepError, match="prefill"):
        with_prefill(plan, {"forms": {"int4": {"form": "warp", "from_tokens": 1}}})


def test_a_profile_scaled_to_a_model_scales_its_prefill_timings():
    profile = _profile({"int4": {"int4pack": HELD}})
    profile = DeviceProfile(profile.read_bandwidth, profile.read_latency, profile.compute_seconds,
                            extra=profile.extra | {"expert_shape": {"hidden": 10, "intermediate": 10}})
    scaled = profile.scaled_to(2 * 3 * 10 * 10)
    assert scaled.prefill_seconds["int4"]["int4pack"]["tokens"]["64"] == 80.0
    assert prefill_choice(scaled, {"int4": "int4pack"}) == PrefillSpec()


def test_the_chunk_is_the_smallest_whose_compute_covers_a_read():
    from prep.stages.planning import CHUNK_CHOICES, prefill_chunk

    timed = {"int4": {"int4pack": _form(0.0, {1: 1e-3, 16: 8e-3, 64: 30e-3, 256: 120e-3})}}
    profile = DeviceProfile(1e8, 0.0, {"int4": 1e-3}, extra={"prefill_seconds_per_expert": timed})
    # a 2 MB record reads in 20 ms; with K/E = 1/4 a chunk of 64 gives an expert 16 tokens (8 ms), 128 -> 32 tokens
    # (8 + 22 * 16/48 = 15.3 ms), 256 -> 64 tokens (30 ms): the first to cover the read
    assert prefill_chunk(profile, {"int4": "int4pack"}, {"int4": 2_000_000}, 2, 8) == 256
    assert prefill_chunk(profile, {"int4": "int4pack"}, {"int4": 10_000}, 2, 8) == CHUNK_CHOICES[0]
    assert prefill_chunk(profile, {"int4": "int4pack"}, {"int4": 10**12}, 2, 8) == CHUNK_CHOICES[-1]
