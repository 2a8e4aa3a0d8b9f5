"""The bench's bound step: how fast each loader row could be at its budget, and the share of that it reached.

The bound of each budget (``physical_bounds``): 1 / max(the compute floor per token, Belady's I/O floor per token),
where the compute floor is the ``@unlimited`` row of the same artifact and plan and Belady's I/O floor the demand
bytes per decode token a clairvoyant cache reads at that budget over the profile's read bandwidth;
``fraction_of_bound`` of each loader row is its speed over that bound (None for neuron-level loading, which reads
and computes parts of experts, with ``fraction_of_bound_error`` saying so).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from loader.errors import MoeError
from loader.plan import PolicySpec, read_plan
from prep.errors import MoeprepError
from prep.sim.simulate import simulate
from prep.studies.bench.model import cache_spec, routing_replay
from prep.studies.bench.plan import BenchPlan, subject_budget_bytes
from prep.studies.bench.subjects import LLAMA, Subject
from prep.studies.bench.worker import loader_plan, runs_loader


def _belady_demand_bytes(routing: dict, num_experts: int, tokens: int, spec) -> int:
    """Demand bytes Belady's policy reads replaying the first ``tokens`` tokens of ``routing`` through ``spec``."""

    replay = routing_replay(routing, num_experts, tokens, "bench")
    return sum(layer.demand_bytes for layer in simulate(replay, spec, "belady").layers)


def _io_floor(subject: Subject, routing: dict, artifact: Path, limit: int, plan, read_bandwidth: float,
              compute: float | None, device: str) -> dict:
    """Belady's demand bytes per decode token in the cache ``load(artifact, limit, plan=plan)`` builds, that over
    the read bandwidth (bytes/s), and the bound it makes with the compute floor (tokens/s; None: not measured)."""

    prompt = len(subject.prompt_ids)
    tokens = prompt + len(subject.decode_ids)
    num_experts = subject.manifest["moe"]["num_experts"]
    try:
        spec = cache_spec(artifact, limit, plan, device)
        # Belady over prompt + decode, less the prompt alone: what the decode steps must read
        decode_bytes = (_belady_demand_bytes(routing, num_experts, tokens, spec)
                        - _belady_demand_bytes(routing, num_experts, prompt, spec))
    except (MoeprepError, MoeError) as e:
        return {"error": str(e)}
    per_token = decode_bytes / max(1, tokens - prompt)
    io_seconds = per_token / read_bandwidth
    out = {"belady_bytes_per_token": per_token, "io_floor_s_per_token": io_seconds}
    if not compute:
        return out | {"bound_tokens_per_s": None, "bound_error": "the compute floor (@unlimited) was not measured"}
    slowest = max(1 / compute, io_seconds)
    return out | {"bound_tokens_per_s": 1 / slowest}


def physical_bounds(subject: Subject, budgets: list[str], results: list[dict], routing: dict | None, profile,
                    device: str = "cpu") -> dict:
    """Per budget: the compute floor (the loader system at budget ``unlimited``, every expert cached in its held
    form), the I/O floor (Belady's demand bytes per decode token at that budget over the profile's read
    bandwidth) and the speed bound they make together (reads hidden perfectly behind compute: 1 / max(compute,
    I/O) per token), for ``naive`` (its artifact, plan and ``naive@unlimited``; the entry's top level) and, under
    ``moeprep``, for the recipe's artifact with its plan's pools and precisions (exact routing) and
    ``moeprep@unlimited``."""

    speeds = {r["system"]: r.get("decode_tokens_per_s") for r in results if r["subject"] == subject.name}
    moe = subject.manifest["moe"]
    naive = subject.naive_artifact
    plan = loader_plan(naive, "naive")
    exact = dataclasses.replace(read_plan(subject.artifact), routing=PolicySpec("topk"), miss=PolicySpec("plan"))
    out = {}
    for budget in budgets:
        limit = subject_budget_bytes(subject, budget)
        dense = subject_budget_bytes(subject, "100%") - int(moe["source_expert_bytes"])
        entry = {"resident_tokens_per_s": speeds.get("resident"), "compute_system": "naive@unlimited",
                 "compute_tokens_per_s": speeds.get("naive@unlimited"), "budget_bytes": limit,
                 "budget_share": 100 * (limit - dense) / int(moe["source_expert_bytes"])}
        out[budget] = entry
        entry["moeprep"] = {"compute_system": "moeprep@unlimited", "compute_tokens_per_s": speeds.get("moeprep@unlimited")}
        if routing is None or profile is None:
            continue
        entry |= _io_floor(subject, routing, naive, limit, plan, profile.read_bandwidth,
                           speeds.get("naive@unlimited"), device)
        entry["moeprep"] |= _io_floor(subject, routing, subject.artifact, limit, exact, profile.read_bandwidth,
                                      speeds.get("moeprep@unlimited"), device)
    return out


def _neuron_loading(subject: Subject, system: str) -> bool:
    """Whether the loader row ``system`` reads and computes parts of experts (neuron-level loading)."""

    artifact = subject.artifact_for(system)
    plan = loader_plan(artifact, system) or read_plan(artifact)
    return plan.neuron.name != "off"


def bound_rows(plan: BenchPlan, results: list[dict], routings: dict, profile) -> dict:
    """The physical bounds of each subject (none without decode rows), and (in place) each budgeted loader and
    llama.cpp row's ``fraction_of_bound``: against moeprep's bound for moeprep and llama.cpp (the same 4-bit class),
    naive's for the rest; None with ``fraction_of_bound_error`` for neuron-level loading."""
    bounds = ({s.name: physical_bounds(s, plan.budgets, results, routings[s.name], profile, plan.device)
               for s in plan.subjects} if plan.decode else {})
    by_name = {s.name: s for s in plan.subjects}
    for row in results:
        if row.get("measured_once") or not (runs_loader(row["system"]) or row["system"] == LLAMA):
            continue
        if row["system"] != LLAMA and _neuron_loading(by_name[row["subject"]], row["system"]):
            row["fraction_of_bound"] = None
            row["fraction_of_bound_error"] = ("neuron-level loading reads and computes parts of experts: the "
                                              "whole-expert bound does not bind it")
            continue
        entry = bounds[row["subject"]].get(row["budget"], {})
        if row["system"] in ("moeprep", LLAMA):  # the recipe's artifact and plan (llama.cpp: the same 4-bit class)
            entry = entry.get("moeprep", {})
        bound, speed = entry.get("bound_tokens_per_s"), row.get("decode_tokens_per_s")
        row["fraction_of_bound"] = speed / bound if bound and speed else None
    return bounds
