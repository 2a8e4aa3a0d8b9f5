"""The engine's accounting (loader/engine.py): decode timing splits a step's seconds into compute, stall and the
overhead left, per layer step, as the bench reports them; with no step yet, the per-step figures are None."""

from __future__ import annotations

import pytest

from loader.engine import DecodeTiming, PrefillTiming


def test_decode_timing_reports_the_overhead_left_after_compute_and_stall_per_layer_step():
    timing = DecodeTiming(layer_steps=4, step_seconds=1.0, compute_seconds=0.5, stall_seconds=0.25,
                          routing_sync_seconds=0.1)
    got = timing.to_json()
    assert got["overhead_seconds"] == pytest.approx(1.0 - 0.5 - 0.25)  # the routing sync is inside the overhead
    assert got["overhead_per_layer_step"] == pytest.approx(0.25 / 4)
    assert got["routing_sync_per_layer_step"] == pytest.approx(0.1 / 4)
    assert {k: got[k] for k in ("layer_steps", "step_seconds", "compute_seconds", "stall_seconds")} == \
        {"layer_steps": 4, "step_seconds": 1.0, "compute_seconds": 0.5, "stall_seconds": 0.25}
    idle = DecodeTiming().to_json()
    assert idle["overhead_per_layer_step"] is None and idle["routing_sync_per_layer_step"] is None


def test_prefill_timing_reports_every_field():
    timing = PrefillTiming(forwards=2, tokens=30, layer_steps=6, reads=9, most_reads_per_layer_step=1)
    assert timing.to_json() == {"forwards": 2, "tokens": 30, "layer_steps": 6, "step_seconds": 0.0,
                                "stall_seconds": 0.0, "reads": 9, "most_reads_per_layer_step": 1,
                                "prefill_form_computes": 0}
