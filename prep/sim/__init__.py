"""Trace-driven simulation of the loader's expert cache, with the loader's own cache core and policies.

``simulate(replay, spec, policy)`` replays recorded routing (``load_replay``: a project trace directory
or the real Mixtral traces) through ``loader.cache.ExpertCache`` in the runtime's call order, with a
cache built from a plan and a budget (``plan_spec``, ``artifact_spec``) or N experts per layer
(``capacity_spec``). ``belady`` (clairvoyant) exists only here, as the floor. A device profile
(``loader.device``; ``moeprep profile-device``) turns counts into modelled seconds.
"""

from loader.device import DeviceProfile, load_profile, measure_device, write_profile
from prep.sim.belady import BeladyPolicy, FutureUses
from prep.sim.replay import Replay, load_replay, replay_from_routing
from prep.sim.simulate import (
    DEFAULT_RECORD_BYTES,
    POLICY_NAMES,
    CacheSpec,
    SimResult,
    artifact_spec,
    capacities_spec,
    capacity_spec,
    mixtral_record_bytes,
    plan_spec,
    simulate,
    simulate_trace,
    sweep,
)

__all__ = [
    "DEFAULT_RECORD_BYTES", "POLICY_NAMES", "BeladyPolicy", "CacheSpec", "DeviceProfile", "FutureUses", "Replay",
    "SimResult", "artifact_spec", "capacities_spec", "capacity_spec", "load_profile", "load_replay",
    "measure_device", "mixtral_record_bytes", "plan_spec", "replay_from_routing", "simulate", "simulate_trace",
    "sweep", "write_profile",
]
