"""The bench's model step: the simulator's prediction beside each loader row.

The device profile is measured once at the start of the run (``loader.device.measure_device``, ``device.json``; on
CUDA its reads are pinned host-to-device copies, as the loader's host store reads), scaled to each subject's experts.
Each loader row is replayed by ``prep.sim.simulate.simulate`` on the same artifact, plan, budget and routing
decisions (``modelled_tokens_per_s``: decode tokens over the modelled seconds of the decode steps), and, where the
loader counts its overhead, again with the profile calibrated against this run (``device-calibrated.json``:
``modelled_calibrated_tokens_per_s``). A row the simulator cannot model has None and ``modelled_error`` saying why.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import torch

from loader.device import measure_device
from loader.io import write_bytes_atomic
from loader.plan import read_plan
from loader.predict import PREDICTORS_FILE, ROUTING_ONLY, make_predictor
from prep.sim.replay import replay_from_routing
from prep.sim.simulate import PredictionFeed, artifact_spec, simulate
from prep.studies.bench.plan import UNLIMITED, BenchPlan, Sizes, simulated_memory
from prep.studies.bench.subjects import Subject
from prep.studies.bench.worker import TUNED, loader_plan, runs_loader

FALLBACK_EXPERT_SHAPE = (4096, 14336)  # Mixtral-8x7B's (hidden, intermediate), when no subject says its own
PROFILE_MULTIPLE = 256  # measure_compute times (H/4, I/4), each a multiple of its quantization group (64)


def expert_shape(subject: Subject) -> tuple[int, int] | None:
    """(hidden, expert intermediate) of the subject's model (its config.json); None where it names neither."""
    try:
        config = json.loads((Path(subject.model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    hidden, inter = config.get("hidden_size"), config.get("moe_intermediate_size") or config.get("intermediate_size")
    return (int(hidden), int(inter)) if hidden and inter else None


def weights_per_expert(subject: Subject) -> float:
    moe = subject.manifest["moe"]
    per_weight = {"float32": 4, "bfloat16": 2, "float16": 2}[moe["dtype"]]
    return int(moe["source_expert_bytes"]) / per_weight / (len(moe["layers"]) * moe["num_experts"])


def profile_shape(subjects: list[Subject]) -> tuple[int, int]:
    """The expert shape the profile's compute is timed on: the largest subject expert's, rounded up to what
    ``measure_compute`` takes (each subject then scales the profile to its own experts)."""
    shapes = [shape for shape in (expert_shape(s) for s in subjects) if shape]
    if not shapes:
        return FALLBACK_EXPERT_SHAPE
    hidden, inter = max(shapes, key=lambda shape: shape[0] * shape[1])
    return tuple(-(-n // PROFILE_MULTIPLE) * PROFILE_MULTIPLE for n in (hidden, inter))


def _host_copies(nbytes: int, block: int = 8 << 20, small: int = 32) -> dict:
    """Pinned host-to-GPU copies (what the loader's host store does on a CUDA miss): the bandwidth of
    ``block``-sized copies over ``nbytes`` and the latency of 4 KiB copies (the median)."""
    import statistics

    block = min(block, nbytes)
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(block, dtype=torch.uint8, device="cuda")
    dst.copy_(src[:block])
    torch.cuda.synchronize()
    start, done = time.perf_counter(), 0
    for offset in range(0, nbytes - block + 1, block):
        dst.copy_(src[offset:offset + block], non_blocking=True)
        done += block
    torch.cuda.synchronize()
    bandwidth = done / (time.perf_counter() - start)
    latencies = []
    for i in range(small):
        start = time.perf_counter()
        dst[:4096].copy_(src[i * 4096:(i + 1) * 4096])
        torch.cuda.synchronize()
        latencies.append(time.perf_counter() - start)
    return {"read_bandwidth_bytes_per_s": bandwidth, "read_latency_s": statistics.median(latencies)}


def device_profile(subjects: list[Subject], sizes: Sizes, device: str, output: Path, store: str = "host"):
    """This machine's ``loader.device`` profile, measured once for the run (reads from a file on the output's
    disk, one expert's compute on ``device``; on CUDA with ``store="host"`` the reads are pinned host-to-GPU
    copies, as the loader's host store reads there), written to ``output/device.json``."""

    profile = measure_device(output, file_bytes=sizes.profile_bytes, expert_shape=profile_shape(subjects),
                             device=device)
    if device == "cuda" and store == "disk":
        copies = _host_copies(sizes.profile_bytes)
        profile = dataclasses.replace(profile, extra=profile.extra | {
            "reads": "disk reads bypassing the page cache (the loader's disk store; a pinned copy follows each)",
            "host_copy_bandwidth_bytes_per_s": copies["read_bandwidth_bytes_per_s"]})
    elif device == "cuda":
        copies = _host_copies(sizes.profile_bytes)
        profile = dataclasses.replace(
            profile, read_bandwidth=copies["read_bandwidth_bytes_per_s"], read_latency=copies["read_latency_s"],
            extra=profile.extra | {"reads": "pinned host-to-GPU copies (the loader's host store on CUDA)",
                                   "disk_read_bandwidth_bytes_per_s": profile.read_bandwidth,
                                   "disk_read_latency_s": profile.read_latency})
    else:
        profile = dataclasses.replace(profile, extra=profile.extra | {"reads": "disk reads bypassing the page cache"})
    write_bytes_atomic(output / "device.json", (json.dumps(profile.to_json(), indent=2) + "\n").encode())
    return profile


def calibrated_profile(profile, results: list[dict]):
    """``profile`` calibrated against the loader as measured in this run (``loader.device.calibrated``: reads
    overlapping hits' compute, and the loader's own time per MoE layer call, the median ``overhead_us_per_layer``
    of the run's loader rows); None where no loader row counted its overhead."""
    import statistics

    try:
        from loader.device import calibrated
    except ImportError:
        return None
    overheads = [r["overhead_us_per_layer"] for r in results
                 if runs_loader(r["system"]) and not r.get("error") and r.get("overhead_us_per_layer") is not None]
    if profile is None or not overheads:
        return None
    return calibrated(profile, statistics.median(overheads) * 1e-6)


def calibrated_for(calibrated, subject: Subject, results: list[dict]):
    """The run's calibrated profile scaled to the subject, with the subject's model's time per decode token
    outside the MoE layers' steps (the median ``outside_us_per_token`` of its loader rows; one model's, as
    the layer overhead is one device's)."""
    import statistics

    outside = [r["outside_us_per_token"] for r in results if r["subject"] == subject.name and runs_loader(r["system"])
               and not r.get("error") and r.get("outside_us_per_token") is not None]
    scaled = subject_profile(calibrated, subject)
    if not outside:
        return scaled
    return dataclasses.replace(scaled, calibration=scaled.calibration | {"token_overhead_s": statistics.median(outside) * 1e-6})


def subject_profile(profile, subject: Subject):
    """``profile`` scaled to the subject's experts; a passthrough record computes in the model's own dtype."""
    scaled = profile.scaled_to(weights_per_expert(subject))
    source = subject.manifest["moe"]["dtype"]
    if source in scaled.compute_seconds:
        scaled = dataclasses.replace(scaled, compute_seconds=scaled.compute_seconds
                                     | {"passthrough": scaled.compute_seconds[source]})
    return scaled


# --------------------------------------------------------------------- routing replayed by the simulator


def subject_routing(subject: Subject) -> dict | None:
    """The routing decisions every loader row of the subject ran, as tensors: the replay file's (``expert_ids``,
    ``weights`` [T, L, K]), or what the resident model's routers did in round 1 (also ``logits``,
    ``router_inputs`` and, when recorded, ``head_inputs``: ``prep/studies/bench/worker.py``); None when neither exists."""
    path = subject.replay or subject.facts.get("routing_file")
    if not path or not Path(path).is_file():
        return None
    from safetensors.torch import load_file

    return load_file(str(path))


def routing_replay(routing: dict, num_experts: int, tokens: int, source: str, warm: int = 0):
    """A ``prep.sim.replay.Replay`` of the first ``tokens`` tokens of ``routing``; with ``warm``, preceded by a
    sequence of its first ``warm`` tokens (replayed with ``cold_start=False``: the untimed pass of an
    ``@unlimited`` row)."""
    from types import SimpleNamespace


    lengths = ([warm] if warm else []) + [tokens]
    traces = [SimpleNamespace(num_layers=routing["expert_ids"].shape[1], top_k=routing["expert_ids"].shape[2],
                              expert_ids=routing["expert_ids"][:n], expert_weights=routing["weights"][:n])
              for n in lengths]
    replay = replay_from_routing(traces, num_experts, source)
    if "logits" in routing:
        replay = dataclasses.replace(replay, logits=tuple(routing["logits"][:n].float() for n in lengths))
    return replay


def cache_spec(artifact: Path, budget, plan, device: str):
    """The simulator's cache for ``load(artifact, memory_budget=budget, plan=plan, store=..., device=device)`` as
    the bench's workers call it (``store="host"`` on CUDA)."""
    import inspect


    store = "host" if device == "cuda" else "disk"
    if device != "cpu" and "device" in inspect.signature(artifact_spec).parameters:
        return artifact_spec(artifact, budget, plan=plan, store=store, device=device)
    if device != "cpu":  # the held forms (and so the slots) depend on the device: size them for it
        try:
            from loader.runtime import cache_layout
            from prep.sim.simulate import capacities_spec

            layout = cache_layout(artifact, budget, store=store, plan=plan, device=device)
            return capacities_spec(layout.plan, layout.capacities, layout.record_bytes, layout.slot_bytes)
        except (ImportError, AttributeError, TypeError):
            pass  # an API that moved: the CPU's sizes below
    return artifact_spec(artifact, budget, plan=plan, store=store)


class NotModelled(Exception):
    """Why the simulator cannot model a row (its message goes into the row's ``modelled_error``)."""


def _prediction_feed(artifact: Path, routing: dict, plan, tokens: int):
    """(the simulator's ``PredictionFeed`` for the first ``tokens`` tokens, a factory of fresh predictors): the
    artifact's routers and predictor tensors, the recorded router and LM-head inputs."""
    names = [s.name for s in plan.predictors]
    reading = [n for n in names if n not in ROUTING_ONLY]
    if "router_inputs" not in routing and reading:
        raise NotModelled(f"the predictors ({', '.join(reading)}) need the router inputs, which a routing replayed "
                          "from a trace does not have")
    if "first_gate" in names and "head_inputs" not in routing:
        raise NotModelled("first_gate needs the LM head's inputs, which the resident run did not record")
    from safetensors import safe_open
    from safetensors.torch import load_file


    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    routers = []
    with safe_open(str(Path(artifact) / "dense.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        for path in manifest["moe"]["router_modules"]:
            bias = f"{path}.bias"
            routers.append((f.get_tensor(f"{path}.weight").float(), f.get_tensor(bias).float() if bias in keys else None))
    tensors = load_file(str(Path(artifact) / PREDICTORS_FILE)) if PREDICTORS_FILE in manifest.get("files", {}) else {}
    head = routing.get("head_inputs")
    feed = PredictionFeed([routing["router_inputs"][:tokens].float()] if "router_inputs" in routing else None,
                          [head[:tokens].float()] if head is not None else None, routers, tensors)
    return feed, lambda: [make_predictor(s.name, dict(s.params)) for s in plan.predictors]


def _sim_plan(subject: Subject, system: str):
    """(artifact, plan) the loader row ``system`` ran, as the simulator replays it."""

    artifact = subject.artifact_for(system)
    return artifact, loader_plan(artifact, system) or read_plan(artifact)  # a replay goes through the plan's routing


def modelled(subject: Subject, system: str, memory_budget, routing: dict | None, profile, device: str) -> dict:
    """The simulator's decode tokens/s for one loader row (``modelled_tokens_per_s``, with what it is made of
    under ``modelled``), or None with ``modelled_error`` saying why it cannot be modelled."""
    if routing is None:
        return {"modelled_tokens_per_s": None,
                "modelled_error": "no routing decisions to replay (the resident run that records them failed)"}
    if profile is None:
        return {"modelled_tokens_per_s": None, "modelled_error": "no device profile"}
    try:
        return _modelled(subject, system, memory_budget, routing, profile, device)
    except NotModelled as e:
        return {"modelled_tokens_per_s": None, "modelled_error": str(e)}
    except Exception as e:  # noqa: BLE001 - the column is a model beside the measurement: say why, never fail the run
        return {"modelled_tokens_per_s": None, "modelled_error": f"{type(e).__name__}: {e}"}


def _modelled(subject: Subject, system: str, memory_budget, routing: dict, profile, device: str) -> dict:

    if system.split("@", 1)[0] == TUNED:
        raise NotModelled("measured with `moeload tune`'s decisions; the simulator's row for the plan is moeprep's")
    artifact, plan = _sim_plan(subject, system)
    if plan.neuron.name != "off":
        raise NotModelled("the simulator models whole-expert reads; neuron-level loading is not modelled")
    prompt = len(subject.prompt_ids)
    tokens = prompt + len(subject.decode_ids)
    if routing["expert_ids"].shape[0] < tokens:
        raise NotModelled(f"the routing holds {routing['expert_ids'].shape[0]} tokens, the row ran {tokens}")
    feed, make = (_prediction_feed(artifact, routing, plan, tokens) if plan.predictors else (None, lambda: []))
    spec = cache_spec(artifact, memory_budget, plan, device)
    num_experts = subject.manifest["moe"]["num_experts"]

    warm = tokens if system.endswith("@" + UNLIMITED) else 0  # the worker's untimed pass, then the timed one
    lengths = ([warm] if warm else [])

    def run(n: int):
        fed = None if feed is None else dataclasses.replace(
            feed, router_inputs=[feed.router_inputs[0][:m] for m in [*lengths, n]]
            if feed.router_inputs is not None else None,
            head_inputs=[feed.head_inputs[0][:m] for m in [*lengths, n]] if feed.head_inputs is not None else None)
        return simulate(routing_replay(routing, num_experts, n, f"{subject.name} {system}", warm), spec, profile=profile,
                        predictors=make() or None, feed=fed, cold_start=not warm)

    full, head = run(tokens), run(prompt)  # the decode steps: prompt + decode, less the prompt alone
    n = tokens - prompt
    seconds = full.seconds - head.seconds
    read = sum(x.read_seconds for x in full.layers) - sum(x.read_seconds for x in head.layers)
    return {"modelled_tokens_per_s": n / seconds if seconds > 0 else None,
            "modelled": {"seconds_per_token": seconds / n, "read_seconds_per_token": read / n,
                         "compute_seconds_per_token": (seconds - read) / n,
                         "bytes_read_per_token": (full.bytes_read - head.bytes_read) / n,
                         "misses_per_token": (full.misses - head.misses) / n, "policy": full.policy,
                         "predictors": [s.name for s in plan.predictors], "device": profile.device}}




# ------------------------------------------------------------------------------------------ the step


def model_rows(plan: BenchPlan, results: list[dict], routings: dict, profile):
    """Give each loader row (in place) the simulator's model of it (``modelled``) and its ratio to the measured
    speed, once per configuration; then, with the profile calibrated against this run (written to
    ``device-calibrated.json``), the calibrated model. Returns the calibrated profile, None where no loader row
    counted its overhead."""
    by_name = {s.name: s for s in plan.subjects}
    profiles = {s.name: subject_profile(profile, s) if profile is not None else None for s in plan.subjects}
    models: dict = {}  # (subject, system, budget) -> the simulator's figures, once per configuration
    for row in results:
        if not runs_loader(row["system"]) or row.get("error"):
            continue
        subj = by_name[row["subject"]]
        memory = simulated_memory(subj, row["system"], row["budget"])
        key = (row["subject"], row["system"], str(memory))
        if key not in models:
            models[key] = modelled(subj, row["system"], memory, routings[subj.name], profiles[subj.name], plan.device)
        row |= models[key]
        model, speed = row.get("modelled_tokens_per_s"), row.get("decode_tokens_per_s")
        row["modelled_over_measured"] = model / speed if model and speed else None
    calibrated = calibrated_profile(profile, results)
    if calibrated is not None:  # the simulator's model of the loader's step, its one parameter from this run
        write_bytes_atomic(plan.output / "device-calibrated.json",
                           (json.dumps(calibrated.to_json(), indent=2) + "\n").encode())
        _model_calibrated(plan, results, routings, calibrated)
    return calibrated


def _model_calibrated(plan: BenchPlan, results: list[dict], routings: dict, calibrated) -> None:
    """``modelled_calibrated_tokens_per_s`` (and over measured) of each modelled loader row, once per configuration."""
    by_name = {s.name: s for s in plan.subjects}
    models: dict = {}
    for row in results:
        if not runs_loader(row["system"]) or row.get("error") or not row.get("modelled_tokens_per_s"):
            continue
        subj = by_name[row["subject"]]
        memory = simulated_memory(subj, row["system"], row["budget"])
        key = (row["subject"], row["system"], str(memory))
        if key not in models:
            models[key] = modelled(subj, row["system"], memory, routings[subj.name],
                                   calibrated_for(calibrated, subj, results), plan.device)
        model, speed = models[key].get("modelled_tokens_per_s"), row.get("decode_tokens_per_s")
        row["modelled_calibrated_tokens_per_s"] = model
        row["modelled_calibrated_over_measured"] = model / speed if model and speed else None
