"""The preparation's side of the modelled prefill: calibrating it against a measured prefill, and ``moeprep simulate
--prefill``. The model itself lives with the loader (``loader.simulate.simulate_prefill``), which predicts time to
first token before a run (``moeload plan``); what it does:

The prompt is the first tokens of the replay's sequences (one after another, cycled where they are shorter). It is
cut into chunks as the loader cuts it (the budget's chunk); each chunk runs every MoE layer through the loader's
own schedule (``loader.schedule.LayerSchedule``) on the cache the budget builds, so hits, misses and evictions
are the loader's. Per layer step:

- an expert given n tokens computes for ``expert_seconds(profile, precision, form, n)``: the profile's prefill
  timings (``loader.device.measure_prefill``) interpolated in n, else n decode tokens' compute;
- a miss reads its record (``profile.read_seconds``) and makes its form on a reader thread; one whose tokens
  reach its precision's prefill form (``plan.prefill.forms``) is made and computed in that form, not cached;
- hits compute while the reads run; each read is computed as it lands: the step takes
  ``max(all compute, all reads + the last read's compute)``, plus the profile's per-layer overhead.

Each prompt token adds the calibration's ``prefill_token_overhead_s`` (attention, dense layers, routers at prompt
batch sizes; fitted by ``calibrate_prefill`` from a measured prefill with every expert held).
"""

from __future__ import annotations

from loader.device import DeviceProfile
from loader.simulate import (  # noqa: F401  (the cost model's; re-exported here)
    PrefillModel,
    expert_seconds,
    held_form_of,
    make_seconds,
    plan_prefill,
    prompt_routing,
    simulate_prefill,
)
from prep.errors import MoeprepError


def calibrate_prefill(profile: DeviceProfile, modelled_all_held: PrefillModel, measured_seconds: float) -> DeviceProfile:
    """``profile`` with ``prefill_token_overhead_s`` fitted: a prefill measured with every expert held, less its
    modelled expert steps, per prompt token (never below 0)."""
    m = modelled_all_held
    per_token = max(0.0, measured_seconds - m.step_seconds - m.layer_overhead_seconds) / m.tokens
    return DeviceProfile(profile.read_bandwidth, profile.read_latency, dict(profile.compute_seconds), profile.device,
                         dict(profile.extra), dict(profile.make_seconds),
                         dict(profile.calibration) | {"prefill_token_overhead_s": per_token})


def artifact_prefill(trace, artifact, budget, profile_path, tokens: int) -> PrefillModel:
    """``moeprep simulate --prefill``: a ``tokens``-token prompt of ``trace`` on the cache and in the chunks that
    ``load(artifact, memory_budget=budget)`` builds (``loader.budget.cache_layout``), with the plan's prefill forms
    and the held forms it chooses, timed with the profile at ``profile_path``."""
    from loader.budget import cache_layout
    from loader.device import load_profile
    from prep.sim.replay import load_replay
    from prep.sim.simulate import capacities_spec

    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1 << 20:
        raise MoeprepError(f"--prefill {tokens!r}: give the prompt's tokens, from 1 to {1 << 20}")
    if artifact is None or profile_path is None:
        raise MoeprepError("--prefill models a prompt on an artifact's cache with a device profile: pass --plan ARTIFACT "
                           "and --profile device.json (moeprep profile-device)")
    layout = cache_layout(artifact, budget)
    spec = capacities_spec(layout.plan, layout.capacities, layout.record_bytes, layout.slot_bytes)
    profile = load_profile(profile_path)
    shape = layout.sizes.activation
    chunk = layout.capacities.prefill_chunk or layout.plan.prefill.chunk
    if shape is not None:
        from loader.prefill import chunk_sizes

        chunks = chunk_sizes(shape, layout.capacities.prefill_bytes, chunk, tokens)
    else:
        chunks = [min(chunk, tokens - start) for start in range(0, tokens, chunk)]
    return simulate_prefill(load_replay(trace), spec, profile, tokens, chunks, layout.plan.prefill, layout.forms)
