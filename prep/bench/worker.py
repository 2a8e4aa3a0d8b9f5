"""One bench measurement in its own process: one system, one subject, one budget; JSON on stdout.

``python -m prep.bench.worker SPEC.json`` loads the subject with the system the spec names, installs the
subject's routing (a replay of recorded decisions, or the model's own), runs one prefill of the prompt
and then decodes the given continuation one token at a time (teacher forcing, so every system
processes exactly the same tokens), and prints one JSON object as the last line of stdout.

A process per measurement because peak RSS is per process and only ever grows: a fresh process gives
each system its own peak and hands all its memory back when it ends.

Systems: ``resident`` (transformers, every weight in memory), ``accelerate`` (transformers with
``device_map="auto"`` and ``max_memory`` at the budget, the overflow offloaded to disk), ``naive`` and
``moeprep`` (``loader.runtime.load`` at the budget; see ``prep/bench/run.py`` for how they differ).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from loader.routing import ReplayRouting, RoutingPolicy, install_routing


class RecordingRouting(RoutingPolicy):
    """The model's own routing, writing down each MoE layer's chosen experts (the bench's Belady bound)."""

    def __init__(self) -> None:
        self.calls: list[list] = []  # per layer, the indices [T, K] of each call

    def bind(self, num_layers: int) -> None:
        self.calls = [[] for _ in range(num_layers)]

    def route(self, layer, logits, weights, indices, view=None):
        self.calls[layer].append(indices.detach().cpu())
        return weights, indices

    def decisions(self) -> list:
        """[T][L][K] over every call so far."""
        import torch as _torch

        per_layer = [_torch.cat(calls) for calls in self.calls]
        return _torch.stack(per_layer, 1).tolist()


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def disk_read_bytes() -> int | None:
    """Bytes this process made the kernel fetch from storage (/proc/self/io read_bytes); None if unknown."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def drop_page_cache(files: list[Path]) -> None:
    """Evict ``files`` from the page cache, so the next read of them comes from the disk.

    posix_fadvise(DONTNEED) drops only clean, unmapped pages; callers sync freshly written files first.
    """
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _replay(spec: dict) -> ReplayRouting | None:
    if not spec.get("replay"):
        return None
    from safetensors.torch import load_file

    tensors = load_file(spec["replay"])
    return ReplayRouting(tensors["expert_ids"], tensors["weights"])


def _accelerate_probe(model) -> dict:
    """Time accelerate's weight loading (the pre-forward of every offloaded module) and list what is offloaded."""
    probe = {"seconds": 0.0, "offloaded": []}
    for name, module in model.named_modules():
        hook = getattr(module, "_hf_hook", None)
        if hook is None or not getattr(hook, "offload", False):
            continue
        probe["offloaded"].append(name)
        original = hook.pre_forward

        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                probe["seconds"] += time.perf_counter() - start

        hook.pre_forward = timed  # the hook is looked up on the instance at each call
    return probe


def _load(spec: dict, routing):
    """(model, loaded-or-None, accelerate probe-or-None, files whose page cache to drop before each step)."""
    system, device = spec["system"], spec["device"]
    model_dir = Path(spec["model_dir"])
    if system == "moeprep" or system.startswith("naive"):
        import dataclasses

        from loader.plan import Plan, read_plan
        from loader.runtime import load

        plan = None  # moeprep: the artifact's own plan, scaled to the budget
        if system.startswith("naive"):  # per-layer LRU at each expert's shipped precision (no other records)
            own = read_plan(spec["artifact"])
            stores = json.loads((Path(spec["artifact"]) / "manifest.json").read_text())["stores"]
            plan = Plan.mixed(own.expert_precision, {p: s["record_bytes"] for p, s in stores.items()})
            if system == "naive+neuron":  # the plan's neuron-level loading, nothing else
                plan = dataclasses.replace(plan, neuron=own.neuron)
            elif "+" in system:  # naive+<predictor>: that one predictor with the artifact's knobs, nothing else
                name = system.split("+", 1)[1]
                plan = dataclasses.replace(plan, predictors=tuple(s for s in own.predictors if s.name == name))
        loaded = load(spec["artifact"], device=device, memory_budget=spec.get("memory_budget", spec["budget"]),
                      store="host" if device == "cuda" else "disk", plan=plan, routing=routing)
        return loaded.model, loaded, None, []

    from transformers import AutoModelForCausalLM

    if system == "resident":
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
        if routing is None and spec.get("record_routing"):
            routing = RecordingRouting()
        install_routing(model, spec["experts_modules"], routing)
        model._bench_routing = routing
        return model, None, None, []

    offload = Path(spec["offload_dir"])
    if device == "cuda":  # the budget is GPU memory; the overflow goes to (pinned) host RAM
        max_memory = {0: int(spec["budget_bytes"]), "cpu": int(spec["host_bytes"])}
    else:  # the budget is RAM; the overflow goes to disk
        max_memory = {"cpu": int(spec["budget_bytes"])}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto", device_map="auto",
                                                 max_memory=max_memory, offload_folder=str(offload)).eval()
    install_routing(model, spec["experts_modules"], routing)
    probe = _accelerate_probe(model)
    probe["device_map"] = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    # Offloaded weights are read from the offload folder and from the checkpoint itself.
    files = [p for p in offload.rglob("*") if p.is_file()] + sorted(model_dir.glob("*.safetensors"))
    os.sync()  # the offload folder was just written: make its pages clean so they can be dropped
    return model, None, probe, files


def measure_llama(spec: dict) -> dict:
    """llama.cpp (``prep/bench/llama.py``) in the spec's memory cgroup: the same prefill and teacher-forced
    decode steps, the model's own routing."""
    from prep.bench.llama import cgroup_peak, join_cgroup, open_model

    cgroup = Path(spec["cgroup"])
    join_cgroup(cgroup)  # before the model is mapped: its pages count against the budget from the start
    gguf = Path(spec["gguf"])
    drop_page_cache([gguf])
    started = time.perf_counter()
    llm = open_model(gguf)
    load_seconds = time.perf_counter() - started
    io_start = disk_read_bytes()
    start = time.perf_counter()
    llm.eval(spec["prompt_ids"])
    prefill = time.perf_counter() - start
    io_before = disk_read_bytes()
    decode_seconds = 0.0
    for token in tqdm(spec["decode_ids"], desc=f"{spec['subject']} llama.cpp {spec['budget']}", unit="tok",
                      leave=False, file=sys.stderr):
        start = time.perf_counter()
        llm.eval([token])
        decode_seconds += time.perf_counter() - start
    io_after = disk_read_bytes()
    llm.close()
    n = len(spec["decode_ids"])
    io_bytes = (io_after - io_before) / n if io_after is not None and io_before is not None else None
    return {"prefill_s": prefill, "decode_s": decode_seconds, "decode_tokens": n,
            "decode_tokens_per_s": n / decode_seconds, "load_s": load_seconds,
            "disk_read_bytes_per_token": io_bytes, "bytes_read_per_token": io_bytes,
            "prefill_disk_read_bytes": (io_before - io_start) if io_start is not None else None,
            "hit_rate": None, "stall_fraction": None, "budget_bytes": spec["budget_bytes"],
            "cgroup_limit_bytes": int((cgroup / "memory.limit_in_bytes").read_text()),
            "cgroup_peak_bytes": cgroup_peak(cgroup), "peak_rss_mb": peak_rss_mb()}


def measure(spec: dict) -> dict:
    if spec["system"] == "llama.cpp":
        return measure_llama(spec)
    routing = _replay(spec)
    started = time.perf_counter()
    model, loaded, probe, cached_files = _load(spec, routing)
    load_seconds = time.perf_counter() - started
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    prompt = torch.tensor([spec["prompt_ids"]], device=device)
    decode = spec["decode_ids"]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        drop_page_cache(cached_files)
        io_start = disk_read_bytes()
        start = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True)
        sync()
        prefill = time.perf_counter() - start
        before = loaded.stats() if loaded else None
        probe_before = probe["seconds"] if probe else 0.0
        io_before = disk_read_bytes()
        decode_seconds = 0.0
        for token in tqdm(decode, desc=f"{spec['subject']} {spec['system']} {spec['budget']}", unit="tok",
                          leave=False, file=sys.stderr):
            # Dropping the page cache before each step keeps accelerate on the budget it was given: without
            # it, the offloaded weights stay in RAM after the first token and the disk is never read again.
            drop_page_cache(cached_files)
            step = torch.tensor([[token]], device=device)
            start = time.perf_counter()
            out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
            sync()
            decode_seconds += time.perf_counter() - start
        io_after = disk_read_bytes()

    n = len(decode)
    io_bytes = (io_after - io_before) / n if io_after is not None and io_before is not None else None
    result = {"prefill_s": prefill, "decode_s": decode_seconds, "decode_tokens": n,
              "decode_tokens_per_s": n / decode_seconds, "load_s": load_seconds,
              "disk_read_bytes_per_token": io_bytes,
              "prefill_disk_read_bytes": (io_before - io_start) if io_start is not None else None}
    if loaded is not None:
        after = loaded.stats()
        hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
        result |= {"bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / n,
                   "hit_rate": hits / (hits + misses) if hits + misses else None,
                   "stall_fraction": (after["stall_seconds"] - before["stall_seconds"]) / decode_seconds,
                   "direct_io": after["direct_io"], "cache_slots": loaded.budget["cache_slots"],
                   "budget_bytes": loaded.budget["limit_bytes"], "misses_per_token": misses / n,
                   "prefetch": {k: after["prefetch"][k] - before["prefetch"][k]  # decode steps only
                                for k in ("issued", "used", "wasted", "cancelled", "saved_seconds")}}
        if after["neuron"] is not None:  # neuron-level loading (decode only): the whole run's shares
            result["neuron"] = {k: after["neuron"][k] for k in ("theta", "crossover", "active_share", "computed_share",
                                                                "partial_reads", "whole_reads", "neuron_recall")}
        loaded.close()
    elif probe is not None:
        moe_modules = spec["experts_modules"]
        offloaded = set(probe["offloaded"])
        resident_layers = sum(1 for path in moe_modules if path not in offloaded)
        result |= {"bytes_read_per_token": io_bytes,
                   "hit_rate": resident_layers / len(moe_modules),
                   "stall_fraction": (probe["seconds"] - probe_before) / decode_seconds,
                   "offloaded_modules": len(offloaded), "budget_bytes": spec["budget_bytes"],
                   "device_map": probe["device_map"]}
    else:
        result |= {"bytes_read_per_token": 0.0, "hit_rate": 1.0, "stall_fraction": 0.0}
    recorder = getattr(model, "_bench_routing", None)
    if isinstance(recorder, RecordingRouting):
        result["routing"] = recorder.decisions()
    experts_impl = getattr(model.config, "_experts_implementation", None)
    result["experts_implementation"] = experts_impl
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m prep.bench.worker SPEC.json")
    spec = json.loads(Path(argv[0]).read_text())
    result = measure(spec)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
