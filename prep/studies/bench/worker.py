"""One bench measurement in its own process: one system, one subject, one budget; JSON on stdout.

``python -m prep.studies.bench.worker SPEC.json`` loads the subject with the system the spec names, installs the
subject's routing (a replay of recorded decisions, or the model's own), runs one prefill of the prompt
and then decodes the given continuation one token at a time (teacher forcing, so every system
processes exactly the same tokens), and prints one JSON object as the last line of stdout.

A process per measurement because peak RSS is per process and only ever grows: a fresh process gives
each system its own peak and hands all its memory back when it ends.

Systems: ``resident`` (transformers, every weight in memory, in the spec's ``dtype`` and transformers'
``experts_implementation``: the bench times each candidate pair this way and runs the fastest),
``accelerate`` (transformers with ``device_map="auto"`` and ``max_memory`` at the budget, the overflow
offloaded to disk), ``naive``, ``naive+<technique>`` and ``moeprep`` (``loader.runtime.load`` at the budget;
see ``prep/studies/bench/run.py`` for how they differ), and ``<system>@unlimited`` (that loader system at the budget
``unlimited``: every expert cached in its held form, the compute floor of the bench's bound; the prompt and
the continuation run once untimed first, so that every expert they use is cached when the timed run starts).

A spec with ``"mode": "prefill"`` (``prep/studies/bench/prefill.py``) measures a prompt instead, nothing decoded:
time to the first token's logits and prompt tokens/s, the loader's reads, and the process's memory during the
prompt (``measure_prefill``).

A loader system also reports ``overhead_us_per_layer``: from the loader's cumulative ``decode_timing``
counters (``LoadedModel.stats()``), differenced over the decode steps, the wall time of a MoE layer step
that is neither expert compute nor waiting for reads, per layer step, in microseconds (None where the
loader does not count it). A ``resident`` run with ``record_routing`` (a path) writes what the model's own
routers did, token by token, to that safetensors file: ``expert_ids`` and ``weights`` [T, L, K], ``logits``
[T, L, E], ``router_inputs`` [T, L, H] and, when the LM head saw every token, ``head_inputs`` [T, H]
(what the simulator needs to replay the same decisions and the plan's predictors).
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from loader.plan import Plan, read_plan
from loader.routing import ReplayRouting, RoutingPolicy, install_routing
from prep.studies.bench.llama import cgroup_peak, join_cgroup, open_model, reset_cgroup_peak


class RecordingRouting(RoutingPolicy):
    """The model's own routing, writing down each MoE layer's chosen experts, their weights, the router logits
    and the router inputs (the bench's simulator replays them: the modelled column and Belady's bound)."""

    def __init__(self) -> None:
        self.calls: list[list] = []  # per layer, the indices [T, K] of each call
        self.weights: list[list] = []  # per layer, the weights [T, K]
        self.logits: list[list] = []  # per layer, the router logits [T, E]
        self.inputs: list[list] = []  # per layer, the router inputs [T, H]
        self.head: list = []  # the LM head's inputs [T, H] of each forward

    def bind(self, num_layers: int) -> None:
        self.calls = [[] for _ in range(num_layers)]
        self.weights = [[] for _ in range(num_layers)]
        self.logits = [[] for _ in range(num_layers)]
        self.inputs = [[] for _ in range(num_layers)]

    def route(self, layer, logits, weights, indices, view=None):
        self.calls[layer].append(indices.detach().reshape(-1, indices.shape[-1]).cpu())
        self.weights[layer].append(weights.detach().reshape(-1, weights.shape[-1]).float().cpu())
        if logits is not None:
            self.logits[layer].append(logits.detach().reshape(-1, logits.shape[-1]).float().cpu())
        return weights, indices

    def after_router(self, layer, x, indices) -> None:
        if x is not None:
            self.inputs[layer].append(x.detach().reshape(-1, x.shape[-1]).float().cpu())

    def head_hook(self, _module, args) -> None:
        if args:
            self.head.append(args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())

    def save(self, path: str | Path) -> None:
        """Write what was recorded (see the module docstring) to ``path``, a safetensors file."""
        from safetensors.torch import save_file

        def stacked(per_layer):
            return torch.stack([torch.cat(calls) for calls in per_layer], 1).contiguous()

        tokens = sum(len(c) for c in self.calls[0])
        out = {"expert_ids": stacked(self.calls), "weights": stacked(self.weights)}
        if all(self.logits) and all(sum(len(c) for c in calls) == tokens for calls in self.logits):
            out["logits"] = stacked(self.logits)
        if all(self.inputs) and all(sum(len(c) for c in calls) == tokens for calls in self.inputs):
            out["router_inputs"] = stacked(self.inputs)
        if self.head and sum(len(h) for h in self.head) == tokens:  # the head saw every token (no logits_to_keep)
            out["head_inputs"] = torch.cat(self.head).contiguous()
        tmp = Path(path).with_name(f".{Path(path).name}.tmp-{os.getpid()}")
        save_file(out, str(tmp))
        os.replace(tmp, path)


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6


def rss_mb() -> float | None:
    """This process's resident set now (VmRSS), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    return None


def reset_peak_rss() -> bool:
    """Start VmHWM over from the current RSS (Linux >= 4.0: ``5`` into /proc/self/clear_refs), so that the next
    ``peak_rss_mb`` is the peak of what runs after; False where the kernel refuses (the peak then includes loading)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


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


def loader_plan(artifact: str | Path, system: str):
    """The plan a loader system runs on ``artifact``: None for ``moeprep`` (the artifact's own plan, scaled to the
    budget); for ``naive``, per-layer LRU at each expert's shipped precision (no other records); ``naive+neuron``
    adds the plan's neuron-level loading, ``naive+<predictor>`` that one predictor with the artifact's knobs.
    ``<system>@unlimited`` is ``<system>``'s plan (the budget differs). The bench's simulator takes the same."""
    import dataclasses


    system = system.split("@", 1)[0]
    if not system.startswith("naive"):
        return None
    own = read_plan(artifact)
    stores = json.loads((Path(artifact) / "manifest.json").read_text())["stores"]
    plan = Plan.mixed(own.expert_precision, {p: s["record_bytes"] for p, s in stores.items()})
    if system == "naive+neuron":  # the plan's neuron-level loading, nothing else
        plan = dataclasses.replace(plan, neuron=own.neuron)
    elif "+" in system:  # naive+<predictor>: that one predictor with the artifact's knobs, nothing else
        name = system.split("+", 1)[1]
        plan = dataclasses.replace(plan, predictors=tuple(s for s in own.predictors if s.name == name))
    return plan


def _count_delta(before: dict | None, after: dict | None) -> dict | None:
    """The integer counts of a policy's ``stats()`` that grew between two readings; None for a policy without."""
    if not after:
        return None
    return {k: v - (before or {}).get(k, 0) for k, v in after.items()
            if isinstance(v, int) and not isinstance(v, bool)}


TUNED = "moeprep+tuned"  # the artifact's plan with only the techniques `moeload tune` kept at the row's budget


def runs_loader(system: str) -> bool:
    """Whether a bench system runs the loader: naive and its variants, moeprep and its tuned plan, and the technique
    systems (``int4``, ``int4+<technique>``) of mixtral-shape-techniques."""
    base = system.split("@", 1)[0]
    return base in ("moeprep", TUNED) or base.startswith(("naive", "int4"))


def _load(spec: dict, routing):
    """(model, loaded-or-None, accelerate probe-or-None, files whose page cache to drop before each step)."""
    system, device = spec["system"].split("@", 1)[0], spec["device"]  # naive@unlimited: naive's plan, unlimited
    model_dir = Path(spec["model_dir"])
    if runs_loader(system):
        from loader.runtime import load

        plan = loader_plan(spec["artifact"], system)
        if system == TUNED:  # the plan without what `moeload tune` switched off at this budget (``measure.tune_rows``)
            from loader.tuning import without

            plan = without(read_plan(spec["artifact"]), spec["tuned_off"])
        loaded = load(spec["artifact"], device=device, memory_budget=spec.get("memory_budget", spec["budget"]),
                      store=spec.get("store") or ("host" if device == "cuda" else "disk"), plan=plan,
                      replay=routing,  # the plan's routing policy (adaptive gating) decides on the replayed decisions
                      ignore_device_file=True)  # ``moeprep`` is the plan as shipped, wherever a tune has run
        return loaded.model, loaded, None, []

    from transformers import AutoModelForCausalLM

    if system == "resident":
        kwargs = {"experts_implementation": spec["experts_implementation"]} if spec.get("experts_implementation") else {}
        dtype = getattr(torch, spec["dtype"]) if spec.get("dtype") else "auto"
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs).to(device).eval()
        wanted = spec.get("experts_implementation")
        if wanted and getattr(model.config, "_experts_implementation", None) != wanted:
            raise RuntimeError(f"transformers runs experts implementation {model.config._experts_implementation!r}, "
                               f"not the {wanted!r} asked for")
        after_router = None
        if routing is None and spec.get("record_routing"):
            routing = RecordingRouting()
            after_router = routing.after_router
            head = model.get_output_embeddings()
            if head is not None:
                head.register_forward_pre_hook(routing.head_hook)
        install_routing(model, spec["experts_modules"], routing, after_router=after_router)
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
    """llama.cpp (``prep/studies/bench/llama.py``) in the spec's memory cgroup: the same prefill and teacher-forced
    decode steps, the model's own routing."""

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


def measure_llama_prefill(spec: dict) -> dict:
    """llama.cpp's prompt evaluation in the spec's memory cgroup: one ``eval`` of the prompt (llama.cpp's own
    batches of ``n_batch`` tokens), the cgroup's peak reset just before it, so that it is the prompt's."""
    cgroup = Path(spec["cgroup"])
    join_cgroup(cgroup)
    gguf = Path(spec["gguf"])
    drop_page_cache([gguf])
    prompt = spec["prompt_ids"]
    started = time.perf_counter()
    llm = open_model(gguf, context=max(512, len(prompt) + 1))
    load_seconds = time.perf_counter() - started
    load_peak = cgroup_peak(cgroup)
    reset = reset_cgroup_peak(cgroup)
    io_start = disk_read_bytes()
    start = time.perf_counter()
    llm.eval(prompt)
    seconds = time.perf_counter() - start
    io_end = disk_read_bytes()
    n_batch = llm.n_batch
    llm.close()
    peak = cgroup_peak(cgroup)
    return {"prefill_tokens": len(prompt), "ttft_s": seconds, "prefill_tokens_per_s": len(prompt) / seconds,
            "load_s": load_seconds, "chunks": -(-len(prompt) // n_batch), "largest_chunk": min(n_batch, len(prompt)),
            "disk_read_bytes": io_end - io_start if io_start is not None else None,
            "budget_bytes": spec["budget_bytes"],
            "cgroup_limit_bytes": int((cgroup / "memory.limit_in_bytes").read_text()),
            "cgroup_peak_bytes": peak if reset else max(peak or 0, load_peak or 0) or None,
            "cgroup_peak_is_prefill": reset,
            "prefill_memory_bytes": peak if reset else None, "peak_rss_mb": peak_rss_mb()}


def bare_rss_mb(model_dir: str) -> float | None:
    """The process's RSS with everything but the model: torch, transformers, the model's modeling code (importing
    Mixtral's costs about 140 MB) and the loader imported, and torch's thread pool started. What a prefill row's
    memory is measured above, so that it is the model's and its prompt's, comparable with the budget."""
    import transformers.models.auto.modeling_auto as auto
    from transformers import AutoConfig

    import loader.runtime  # noqa: F401

    try:
        auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(model_dir))]  # imports the modeling module
    except (KeyError, OSError, ValueError):
        pass  # the model's memory then includes its modeling code
    torch.ones(64, 64) @ torch.ones(64, 64)
    return rss_mb()


PREFILL_TIMING_KEYS = ("forwards", "tokens", "layer_steps", "step_seconds", "stall_seconds", "reads",
                       "prefill_form_computes")


def measure_prefill(spec: dict) -> dict:
    """Time to the first token of ``spec["prompt_ids"]`` on a freshly loaded system (nothing decoded).

    The loader systems run ``LoadedModel.prefill`` (the prompt in chunks inside the budget's prefill reserve); an
    ``@unlimited`` system runs the prompt once untimed first, so every expert it needs is held (the compute
    floor). Resident and accelerate run one forward of the whole prompt, logits of the last token only, as the
    loader's prefill keeps. Memory: VmHWM is reset just before the timed prompt, so ``prefill_peak_rss_mb`` is the
    peak during it; ``prefill_memory_bytes`` is that less the process's RSS before the model was loaded (torch and
    transformers imported), what the model and its prompt took, set against the budget by the bench."""
    if spec["system"] == "llama.cpp":
        return measure_llama_prefill(spec)
    routing = _replay(spec)
    baseline = bare_rss_mb(spec["model_dir"])
    started = time.perf_counter()
    model, loaded, _probe, cached_files = _load(spec, routing)
    load_seconds = time.perf_counter() - started
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    prompt = torch.tensor([spec["prompt_ids"]], device=device)
    result: dict = {"prefill_tokens": prompt.shape[1], "load_s": load_seconds, "baseline_rss_mb": baseline}
    with torch.inference_mode():
        if loaded is not None:
            if spec["system"].endswith("@unlimited"):
                loaded.prefill(prompt)
                if routing is not None:
                    routing.reset()  # the replay starts over with the timed prompt
            before = loaded.stats()
            result["load_peak_rss_mb"] = peak_rss_mb()
            reset = reset_peak_rss()
            done = loaded.prefill(prompt)
            after = loaded.stats()
            seconds, chunks = done.seconds, done.chunks
        else:
            drop_page_cache(cached_files)  # accelerate reads its offloaded weights from the disk, as in decode
            result["load_peak_rss_mb"] = peak_rss_mb()
            reset = reset_peak_rss()
            io_start = disk_read_bytes()
            start = time.perf_counter()
            model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds, chunks = time.perf_counter() - start, [prompt.shape[1]]
            io_end = disk_read_bytes()
            result["disk_read_bytes"] = io_end - io_start if io_start is not None else None
    peak = peak_rss_mb()
    result |= {"ttft_s": seconds, "prefill_tokens_per_s": prompt.shape[1] / seconds, "chunks": len(chunks),
               "largest_chunk": max(chunks), "prefill_peak_rss_mb": peak if reset else None,
               "peak_rss_mb": max(peak, result["load_peak_rss_mb"]),
               "prefill_memory_bytes": int((peak - baseline) * 1e6) if reset and baseline is not None else None,
               "budget_bytes": spec["budget_bytes"]}
    if loaded is None:
        result["dtype"] = str(next(p.dtype for p in model.parameters())).removeprefix("torch.")
        result["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
        return result
    b, a = before["prefill_timing"], after["prefill_timing"]
    result |= {"bytes_read": after["bytes_read"] - before["bytes_read"],
               "records_read": after["reads"]["records"] - before["reads"]["records"],
               "read_seconds": after["reads"]["read_seconds"] - before["reads"]["read_seconds"],
               "hits": after["hits"] - before["hits"], "misses": after["misses"] - before["misses"],
               "prefill_timing": {k: a[k] - b[k] for k in PREFILL_TIMING_KEYS}
               | {"most_reads_per_layer_step": a["most_reads_per_layer_step"]},  # a maximum since load
               "loader_budget": {k: after["budget"].get(k) for k in ("limit_bytes", "dense_bytes", "prefill_bytes",
                                                              "prefill_chunk", "prefill_form_bytes", "cache_slots")},
               "budget_bytes": loaded.budget["limit_bytes"], "peak_expert_bytes": after["peak_expert_bytes"],
               "direct_io": after["direct_io"]}
    loaded.close()
    return result


def measure(spec: dict) -> dict:
    """One decode measurement (the module docstring): load the system, run the prompt and the teacher-forced decode
    steps timed, and report speed, reads, hits and memory."""
    if spec["system"] == "llama.cpp":
        return measure_llama(spec)
    routing = _replay(spec)
    started = time.perf_counter()
    model, loaded, probe, cached_files = _load(spec, routing)
    load_seconds = time.perf_counter() - started
    device = next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))
    with torch.inference_mode():
        if spec["system"].endswith("@unlimited"):  # the compute floor: every expert the run uses cached first
            _warm_up(model, spec, device, routing)
        timed = _timed_decode(spec, model, loaded, probe, cached_files, device)
    n = len(spec["decode_ids"])
    io_bytes = ((timed.io_after - timed.io_before) / n if timed.io_after is not None and timed.io_before is not None
                else None)
    result = {"prefill_s": timed.prefill_s, "decode_s": timed.decode_s, "decode_tokens": n,
              "decode_tokens_per_s": n / timed.decode_s, "load_s": load_seconds,
              "disk_read_bytes_per_token": io_bytes,
              "prefill_disk_read_bytes": (timed.io_before - timed.io_start) if timed.io_start is not None else None}
    if loaded is not None:
        result |= _loader_figures(loaded, timed.before, timed.decode_s, n)
        loaded.close()
    elif probe is not None:
        result |= _accelerate_figures(spec, probe, timed, io_bytes)
    else:
        result |= {"bytes_read_per_token": 0.0, "hit_rate": 1.0, "stall_fraction": 0.0}
    recorder = getattr(model, "_bench_routing", None)
    if isinstance(recorder, RecordingRouting):
        recorder.save(spec["record_routing"])
        result["routing_file"] = spec["record_routing"]
    experts_impl = getattr(model.config, "_experts_implementation", None)
    result["experts_implementation"] = experts_impl
    if loaded is None:  # the dtype transformers computes in (the loader's held forms are in "compute")
        result["dtype"] = str(next(p.dtype for p in model.parameters())).removeprefix("torch.")
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_up(model, spec: dict, device: torch.device, routing) -> None:
    """The prompt and the continuation once, untimed (an ``@unlimited`` row: every expert they use is cached when
    the timed run starts); a replay starts over after it."""
    warm = model(input_ids=torch.tensor([spec["prompt_ids"]], device=device), use_cache=True)
    for token in spec["decode_ids"]:
        warm = model(input_ids=torch.tensor([[token]], device=device), past_key_values=warm.past_key_values,
                     use_cache=True)
    del warm
    if routing is not None:
        routing.reset()  # the replay starts over with the timed prefill


@dataclass
class _Timed:
    """The timed prefill and decode steps: seconds, the kernel's read counters around them, and the loader's stats
    (None: not the loader) and accelerate's loading seconds when the decode steps began."""

    prefill_s: float
    decode_s: float
    io_start: int | None
    io_before: int | None
    io_after: int | None
    before: dict | None
    probe_before: float


def _timed_decode(spec: dict, model, loaded, probe, cached_files: list[Path], device: torch.device) -> _Timed:
    """A timed prefill of the prompt, then each decode token timed (teacher-forced) with the page cache of
    ``cached_files`` dropped before each step."""
    drop_page_cache(cached_files)
    io_start = disk_read_bytes()
    start = time.perf_counter()
    out = model(input_ids=torch.tensor([spec["prompt_ids"]], device=device), use_cache=True)
    _sync(device)
    prefill = time.perf_counter() - start
    before = loaded.stats() if loaded else None
    probe_before = probe["seconds"] if probe else 0.0
    io_before = disk_read_bytes()
    decode_seconds = 0.0
    for token in tqdm(spec["decode_ids"], desc=f"{spec['subject']} {spec['system']} {spec['budget']}", unit="tok",
                      leave=False, file=sys.stderr):
        # Dropping the page cache before each step keeps accelerate on the budget it was given: without
        # it, the offloaded weights stay in RAM after the first token and the disk is never read again.
        drop_page_cache(cached_files)
        step = torch.tensor([[token]], device=device)
        start = time.perf_counter()
        out = model(input_ids=step, past_key_values=out.past_key_values, use_cache=True)
        _sync(device)
        decode_seconds += time.perf_counter() - start
    return _Timed(prefill, decode_seconds, io_start, io_before, disk_read_bytes(), before, probe_before)


def _loader_figures(loaded, before: dict, decode_seconds: float, n: int) -> dict:
    """The loader's counters over the ``n`` decode steps: reads, hits, stalls, prefetches, overhead, what its
    policies decided, where misses were computed, neuron-level loading."""
    after = loaded.stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    result = {"bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / n,
              "hit_rate": hits / (hits + misses) if hits + misses else None,
              "stall_fraction": (after["stall_seconds"] - before["stall_seconds"]) / decode_seconds,
              "direct_io": after["direct_io"], "cache_slots": loaded.budget["cache_slots"],
              "budget_bytes": loaded.budget["limit_bytes"], "misses_per_token": misses / n,
              "prefetch": {k: after["prefetch"][k] - before["prefetch"][k]  # decode steps only
                           for k in ("issued", "used", "wasted", "cancelled", "saved_seconds")}}
    result |= overhead(before, after, decode_seconds, n)
    result["per_miss_ms"] = per_miss(before.get("reads"), after.get("reads"))
    # what the routing and miss policies decided in the decode steps (gating: single-expert decisions and expert
    # runs; dynamic precision: misses read high, low, skipped)
    result["decisions"] = {what: _count_delta(before.get(what), after.get(what)) for what in ("routing", "miss_policy")}
    # a GPU with the store in host RAM: each miss copied, or computed on the CPU where the costs measured at
    # load say that is cheaper (both costs per precision, and how many misses the CPU took)
    result["miss_costs"] = after["compute"]["miss_costs"]
    result["cpu_computed_per_token"] = (after["compute"]["cpu_computed"] - before["compute"]["cpu_computed"]) / n
    if after["neuron"] is not None:  # neuron-level loading (decode only): the whole run's shares
        result["neuron"] = {k: after["neuron"][k] for k in ("theta", "crossover", "active_share", "computed_share",
                                                            "partial_reads", "whole_reads", "neuron_recall")}
    return result


def _accelerate_figures(spec: dict, probe: dict, timed: _Timed, io_bytes: float | None) -> dict:
    """accelerate's figures: the kernel's bytes read, the share of MoE layers it kept in RAM, the seconds in its
    weight-loading hooks."""
    moe_modules = spec["experts_modules"]
    offloaded = set(probe["offloaded"])
    resident_layers = sum(1 for path in moe_modules if path not in offloaded)
    return {"bytes_read_per_token": io_bytes,
            "hit_rate": resident_layers / len(moe_modules),
            "stall_fraction": (probe["seconds"] - timed.probe_before) / timed.decode_s,
            "offloaded_modules": len(offloaded), "budget_bytes": spec["budget_bytes"],
            "device_map": probe["device_map"]}


def per_miss(before: dict | None, after: dict | None) -> dict | None:
    """Milliseconds per record read from the disk over the decode steps, by part: the read call, checking its hash,
    making its held form (on the reader threads); None without reads or counters."""
    if not before or not after:
        return None
    records = after["records"] - before["records"]
    if records <= 0:
        return None
    return {"records": records} | {part: (after[f"{part}_seconds"] - before[f"{part}_seconds"]) / records * 1e3
                                   for part in ("read", "check", "make")}


TIMING_KEYS = ("layer_steps", "step_seconds", "compute_seconds", "stall_seconds")


def overhead(before: dict, after: dict, decode_seconds: float | None = None, tokens: int = 0) -> dict:
    """The loader's own time per MoE layer step over the decode steps: ``decode_timing``'s counters (cumulative:
    MoE layer steps of one-token forwards, the wall seconds inside them, the expert compute and the waits for
    reads) differenced between ``before`` and ``after``; step - compute - stall per layer step, in us. None
    (and no ``decode_timing``) where the loader does not count them."""
    b, a = before.get("decode_timing"), after.get("decode_timing")
    if not isinstance(b, dict) or not isinstance(a, dict) or not all(k in a and k in b for k in TIMING_KEYS):
        return {"overhead_us_per_layer": None}
    d = {k: a[k] - b[k] for k in TIMING_KEYS}
    steps = d["layer_steps"]
    per_step = (d["step_seconds"] - d["compute_seconds"] - d["stall_seconds"]) / steps if steps else None
    # the rest of each decode step: attention, dense layers, routers, LM head, predictors (the model's, not the cache's)
    outside = (decode_seconds - d["step_seconds"]) / tokens if decode_seconds is not None and tokens else None
    return {"decode_timing": d, "overhead_us_per_layer": per_step * 1e6 if per_step is not None else None,
            "outside_us_per_token": outside * 1e6 if outside is not None else None}


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m prep.studies.bench.worker SPEC.json")
    spec = json.loads(Path(argv[0]).read_text())
    result = measure_prefill(spec) if spec.get("mode") == "prefill" else measure(spec)
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
