"""Calibrating a device profile against the loader itself (``moeload profile-device --artifact``).

The measured profile (``loader/device.py``) times reads and products in isolation; the loader adds its own costs. Three
runs of the artifact here fit them:

- with every expert held, the router's own top-k and no predictors: the loader's overhead per MoE layer call, and the
  time outside the MoE steps beyond the dense weights' products, per decoder layer and per token, for decode and for a
  prompt (model-free: ``DeviceProfile.for_model`` carries them to any model);
- the same with the plan's techniques: what they add per decoder layer (this artifact's, ``calibrated_on``);
- at a small budget, the artifact's routing sample replayed: the time each read costs beyond the disk's transfer and
  the making of its form (threads, the check, the contention of two cores), fitted so that the cost model's MoE steps
  take what the loader's took (``read_overhead_s``).
"""

from __future__ import annotations

import time

from loader.device import (
    RECORD_BYTES,
    DeviceProfile,
    check_output,
    dense_rate,
    dense_weights,
    measure_device,
    model_profile,
    write_profile,
)
from loader.errors import ModelingError

CALIBRATION_PROMPT = 64  # tokens of the prompt the calibration times (after one untimed pass that reads the experts)
CALIBRATION_DECODE = 16  # decode tokens it times after that prompt


class _PhaseTimer:
    """Seconds in the decoder layers and in the experts modules, apart for prompt forwards and decode steps (a decode
    step runs one token): forward hooks, so the timing is of the loader's own forwards."""

    def __init__(self, layers: list, experts: list) -> None:
        self.seconds = {(phase, part): 0.0 for phase in ("prompt", "decode") for part in ("layers", "experts")}
        self.phase = "decode"
        self.layers = set(layers)
        self.handles = []
        for module, part in [(m, "layers") for m in layers] + [(m, "experts") for m in experts]:
            self.handles.append(module.register_forward_pre_hook(self._start, with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._stop(part), with_kwargs=True))
        self._started: dict = {}

    def _start(self, module, args, kwargs):
        if module in self.layers:
            hidden = args[0] if args else kwargs.get("hidden_states")
            self.phase = "decode" if hidden is not None and hidden.shape[-2] == 1 else "prompt"
        self._started[id(module)] = time.perf_counter()

    def _stop(self, part):
        def stop(module, args, kwargs, output):
            self.seconds[(self.phase, part)] += time.perf_counter() - self._started.pop(id(module))
        return stop

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _timed_run(artifact, manifest, device: str, plain: bool) -> dict:
    """One calibration run with every expert held: an untimed prompt (it reads the experts), then a timed prompt and
    decode. ``plain``: the router's own top-k, no predictors, every miss at its planned precision (the model's own
    cost); else the plan's techniques as they run."""
    import torch

    from loader.prefill import decode
    from loader.routing import MissPolicy, RoutingPolicy
    from loader.runtime import load

    options = {"predictors": [], "routing": RoutingPolicy(), "miss_policy": MissPolicy()} if plain else {}
    loaded = load(artifact, device=device, memory_budget="unlimited", **options)
    try:
        model = loaded.model
        vocab = model.config.get_text_config().vocab_size
        layers = list(model.get_submodule(manifest.moe.last_decoder_layer.rsplit(".", 1)[0]))
        experts = [model.get_submodule(path) for path in manifest.moe.experts_modules]
        ids = torch.randint(0, vocab, (1, CALIBRATION_PROMPT), generator=torch.Generator().manual_seed(0)).to(device)
        decode(loaded, ids, 2)
        before = loaded.stats()["decode_timing"]
        timer = _PhaseTimer(layers, experts)
        try:
            new, decode_seconds = decode(loaded, ids, CALIBRATION_DECODE + 1)
        finally:
            timer.close()
        after = loaded.stats()["decode_timing"]
        return {"tokens": len(new) - 1, "decode_seconds": decode_seconds, "prompt_seconds": loaded.last_prefill.seconds,
                "seconds": timer.seconds, "steps": after["layer_steps"] - before["layer_steps"],
                "overhead": after["overhead_seconds"] - before["overhead_seconds"]}
    finally:
        loaded.close()


def calibrate_on(profile: DeviceProfile, artifact, device: str = "cpu") -> DeviceProfile:
    """``profile`` calibrated against the loader running ``artifact`` here with every expert held (``memory_budget=
    "unlimited"``): reads overlap hits' compute, the loader's own time per MoE layer call (``layer_overhead_s``), and,
    in decode and in a prompt, the time outside the MoE steps less the dense weights' products at this device's rate,
    per decoder layer (the decoder layers' time less their experts') and per token (the rest: embedding, LM head, the
    generation loop), measured with the router's own top-k and no predictors: those carry to any model
    (``for_model``). A second run with the plan's techniques gives what they add per decoder layer (predictors,
    routing policy), kept for this artifact only (``calibrated_on``)."""
    import dataclasses

    from loader.format import read_manifest
    from loader.plan import read_plan

    manifest = read_manifest(artifact)
    plain = _timed_run(artifact, manifest, device, plain=True)
    planned = _timed_run(artifact, manifest, device, plain=False)
    if min(plain["tokens"], planned["tokens"], plain["steps"]) <= 0:
        raise ModelingError(f"calibrating on {artifact}: the model stopped before decoding a token (it emitted its end "
                            "token); calibrate on another artifact, or leave --artifact out for an uncalibrated profile")
    in_layers, head, depth = dense_weights(manifest)
    dtype = manifest.moe.dtype
    fitted, added = {}, {}
    for phase, prompt in (("decode", False), ("prompt", True)):
        key = "" if phase == "decode" else "prefill_"
        # the rate the run's dense weights computed at (int8 where the plan holds them so: ``for_model`` adds the same)
        rate = profile.weight_seconds(dtype if prompt else dense_rate(read_plan(artifact), profile, dtype), prompt=prompt)
        per_layer = {}
        for name, run in (("plain", plain), ("planned", planned)):
            count = run["tokens"] if phase == "decode" else CALIBRATION_PROMPT
            wall = run["decode_seconds"] if phase == "decode" else run["prompt_seconds"]
            t = run["seconds"]
            per_layer[name] = (t[(phase, "layers")] - t[(phase, "experts")]) / count / depth
            if name == "plain":
                fitted[f"{key}outside_layer_s"] = max(0.0, per_layer[name] - in_layers / depth * rate)
                fitted[f"{key}outside_token_s"] = max(0.0, (wall - t[(phase, "layers")]) / count - head * rate)
        added[f"{key}technique_layer_s"] = max(0.0, per_layer["planned"] - per_layer["plain"])
    calibration = {"overlap": True, "layer_overhead_s": max(0.0, plain["overhead"] / plain["steps"])} | fitted
    profile = dataclasses.replace(profile, calibration=calibration)
    try:
        reads = _read_fit(profile, artifact, manifest, device)
    except ModelingError as e:  # an artifact without a routing sample: the rest of the calibration stands
        reads = {"read_overhead_s": 0.0, "read_fit": {"skipped": str(e)}}
    return dataclasses.replace(profile, calibration=calibration | {"read_overhead_s": reads["read_overhead_s"]},
                               extra=profile.extra | {"calibrated_on": {
                                   "artifact": str(manifest.root), "package_key": manifest.raw["package_key"],
                                   "decode_tokens": plain["tokens"], "prompt_tokens": CALIBRATION_PROMPT,
                                   "read_fit": reads["read_fit"]} | added})


READ_FIT_TOKENS = 48  # decode steps of the read fit (the routing sample's first tokens)


def _read_fit(profile: DeviceProfile, artifact, manifest, device: str) -> dict:
    """``read_overhead_s``: the time per read beyond latency + bytes / bandwidth + the form's making that makes the cost
    model's MoE steps take as long as the loader's, replaying the artifact's routing sample at a small budget (1.5x the
    minimum: most experts miss) with plain routing and no predictors, every expert read in its own right."""
    import dataclasses

    import torch

    from loader.budget import cache_layout, minimum_budget
    from loader.prefill import decode
    from loader.routing import MissPolicy, ReplayRouting, RoutingPolicy
    from loader.runtime import load, reader_workers
    from loader.simulate import capacities_spec, first_tokens, read_routing_sample, simulate

    replay, _ = read_routing_sample(manifest)
    replay, _ = first_tokens(replay, None, READ_FIT_TOKENS + 1)
    ids = torch.tensor([e for seq in replay.sequences for token in seq for e in token]).view(-1, replay.num_layers,
                                                                                            replay.top_k)
    weights = torch.tensor([w for seq in replay.weights for token in seq for w in token]).view(ids.shape)
    budget = int(1.5 * minimum_budget(artifact, device=device))
    loaded = load(artifact, device=device, memory_budget=budget, predictors=[], routing=RoutingPolicy(),
                  miss_policy=MissPolicy(), replay=ReplayRouting(ids, weights))
    try:
        prompt = torch.zeros((1, 1), dtype=torch.long, device=device)
        decode(loaded, prompt, ids.shape[0])
        timing = loaded.stats()["decode_timing"]
    finally:
        loaded.close()
    layout = cache_layout(artifact, budget, device=device)
    workers = reader_workers("auto", layout.plan)  # what the load above ran
    spec = capacities_spec(layout.plan, layout.capacities, layout.record_bytes, layout.slot_bytes)
    scaled = model_profile(manifest, profile)

    def modelled(overhead: float) -> float:
        trial = dataclasses.replace(scaled, calibration=scaled.calibration | {"read_overhead_s": overhead,
                                                                              "token_overhead_s": 0.0})
        result = simulate(replay, spec, profile=trial, routing=RoutingPolicy(), miss=MissPolicy(), workers=workers)
        return (result.seconds or 0.0) * timing["layer_steps"] / max(1, result.tokens * replay.num_layers)

    measured = timing["step_seconds"]
    low, high = 0.0, 0.1
    if modelled(low) >= measured:
        return {"read_overhead_s": 0.0, "read_fit": {"measured_step_s": measured, "modelled_step_s": modelled(0.0)}}
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if modelled(mid) < measured else (low, mid)
    return {"read_overhead_s": low, "read_fit": {"measured_step_s": measured, "budget_bytes": budget,
                                                 "modelled_step_s": modelled(low)}}


def profile_device(output, directory=None, file_mb: int = 256, device: str = "cpu", artifact=None,
                   echo=print) -> DeviceProfile:
    """What ``moeload profile-device`` (and ``moeprep profile-device``) run: measure this machine (reads at the
    artifact's record size from ``directory``'s disk, default: the artifact's, else the temp directory; compute per
    expert and per prompt size), calibrate against the loader on ``artifact`` where one is given, write ``output``."""
    check_output(output)  # a missing or read-only directory is refused before the measurement, not after it
    record_bytes = RECORD_BYTES
    if artifact is not None:
        from loader.format import read_manifest

        manifest = read_manifest(artifact)
        record_bytes = max(s.stride for s in manifest.stores.values())
        directory = directory if directory is not None else manifest.root.parent
    echo(f"measuring reads ({file_mb} MB test file) and compute on {device} ...")
    profile = measure_device(directory, file_mb << 20, device=device, record_bytes=record_bytes)
    echo(f"read  {profile.read_bandwidth / 1e6:,.0f} MB/s at depth {profile.read_depth} of "
         f"{record_bytes / 1024:,.0f} KiB reads, latency {profile.read_latency * 1e3:.3f} ms "
         f"(direct I/O: {'yes' if profile.extra.get('direct_io') else 'no, fadvise'}); sequential "
         f"{profile.extra['sequential_read_bandwidth_bytes_per_s'] / 1e6:,.0f} MB/s")
    depths = ", ".join(f"{d}: {bw / 1e6:,.0f}" for d, bw in profile.extra["read_depths"].items())
    echo(f"record reads in flight -> MB/s: {depths}")
    compute = ", ".join(f"{p} {s * 1e3:.1f} ms" for p, s in profile.compute_seconds.items())
    echo(f"compute per expert ({profile.device}): {compute}")
    if artifact is not None:
        echo(f"calibrating against the loader on {artifact} (every expert held) ...")
        profile = calibrate_on(profile, artifact, device)
        c = profile.calibration
        own = profile.extra["calibrated_on"]
        echo(f"loader overhead {c['layer_overhead_s'] * 1e6:.0f} us per MoE layer call; beyond the dense weights, "
             f"{c['outside_layer_s'] * 1e6:.0f} us per decoder layer and {c['outside_token_s'] * 1e6:.0f} us per "
             f"decode token; {c['prefill_outside_layer_s'] * 1e6:.1f} us per decoder layer and "
             f"{c['prefill_outside_token_s'] * 1e6:.1f} us per prompt token; this artifact's techniques add "
             f"{own['technique_layer_s'] * 1e6:.0f} us per decoder layer in decode; each read "
             f"{c['read_overhead_s'] * 1e3:.2f} ms beyond the disk and the form")
    write_profile(profile, output)
    echo(f"wrote {output}")
    return profile
