"""Run an artifact: dense weights resident, experts streamed from the store through per-layer caches.

``load()`` builds the Hugging Face model skeleton on the meta device, assigns the dense weights, drops
the (never materialised) fused expert parameters, and plugs an offloaded experts forward into
transformers through its experts-implementation registry (``ALL_EXPERTS_FUNCTIONS``), so every
architecture whose experts module uses ``@use_experts_implementation`` works without patching classes.

Per MoE layer and call: the experts the router picked are looked up in the layer's cache; reads of
the misses are submitted to the store's worker threads first, hits compute while they are in flight,
then each miss is waited for (stall time), inserted if the cache can take it, and computed. An expert
computes exactly as transformers' eager experts loop does, using the module's own gate function.
"""

from __future__ import annotations

import json
import re
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from loader.cache import POLICIES, LayerCache, MemoryMeter
from loader.codec import RecordLayout
from loader.format import ArtifactError, check_sizes, expert_key, read_manifest
from loader.routing import InstalledRouting, RoutingPolicy, install_routing
from loader.store import ExpertStore

IMPLEMENTATION = "moeprep_offload"
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


class LoaderError(ArtifactError):
    """A request the loader cannot satisfy (budget too small, no GPU, ...); the message says what to do."""


def parse_budget(budget) -> tuple[str, float] | None:
    """None | bytes (int) | "1.5GiB" | "25%" -> None | ("bytes", n) | ("fraction", f)."""
    if budget is None:
        return None
    if isinstance(budget, int | float) and not isinstance(budget, bool):
        return ("bytes", float(budget))
    text = str(budget).strip().lower().replace(" ", "")
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1
        if not 0 < share <= 1:
            raise LoaderError(f"memory budget {budget!r}: a percentage must be in (0, 100]")
        return ("fraction", share)
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", text)
    if not match or match.group(2) not in _UNITS | {"": 1}:
        raise LoaderError(f"memory budget {budget!r} not understood; use bytes, a size like 1.5GiB, or a share like 25%")
    return ("bytes", float(match.group(1)) * _UNITS.get(match.group(2), 1))


@dataclass
class LayerStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    read_seconds: float = 0.0
    stall_seconds: float = 0.0


class OffloadedExperts:
    """The offloaded state of one MoE layer: its cache, its store, its record layout, its stats."""

    def __init__(self, layer: int, cache: LayerCache, store: ExpertStore, layout: RecordLayout,
                 max_in_flight: int) -> None:
        self.layer = layer
        self.cache = cache
        self.store = store
        self.layout = layout
        self.max_in_flight = max(1, max_in_flight)
        self.stats = LayerStats()

    def forward(self, module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], top_k_index [T, K], top_k_weights [T, K] -> [T, H].

        Hits compute while the misses are read; at most ``max_in_flight`` records are being read or
        waiting outside the cache at any time (the read buffers the budget reserves), so a prefill that
        needs every expert of the layer stays inside the budget too.
        """
        out = torch.zeros_like(hidden)
        needed = [e for e in top_k_index.unique().tolist() if 0 <= e < module.num_experts]
        resident = {e: r for e in needed if (r := self.cache.get(e)) is not None}
        misses = [e for e in needed if e not in resident]
        self.stats.hits += len(resident)
        self.stats.misses += len(misses)
        record_bytes = self.store.record_bytes
        meter = self.cache.meter
        pending: deque = deque()

        def submit_next() -> None:
            if misses and len(pending) < self.max_in_flight:
                expert = misses.pop(0)
                meter.add(record_bytes)
                pending.append((expert, self.store.submit(expert_key(self.layer, expert))))

        for _ in range(self.max_in_flight):
            submit_next()
        for expert, record in resident.items():
            self._compute(module, expert, record, hidden, top_k_index, top_k_weights, out)
        protected = set(needed)
        while pending:
            expert, future = pending.popleft()
            start = time.perf_counter()
            record, seconds = future.result()
            self.stats.stall_seconds += time.perf_counter() - start
            self.stats.read_seconds += seconds
            self.stats.bytes_read += record.numel()
            meter.sub(record_bytes)  # it leaves the read buffers: into the cache (counted there) or used once
            kept = self.cache.put(expert, record, protected)
            if kept:
                submit_next()
            else:
                meter.add(record_bytes)  # held outside the cache until computed
            self._compute(module, expert, record, hidden, top_k_index, top_k_weights, out)
            if not kept:
                meter.sub(record_bytes)
                submit_next()
        return out

    def _compute(self, module, expert, record, hidden, top_k_index, top_k_weights, out) -> None:
        tokens, slot = torch.where(top_k_index == expert)
        w = self.layout.decode(record)
        x = hidden[tokens]
        if module.is_transposed:
            gate_up = x @ w["gate_up_proj"].to(x.dtype)
            if "gate_up_proj_bias" in w:
                gate_up = gate_up + w["gate_up_proj_bias"].to(x.dtype)
            y = module._apply_gate(gate_up) @ w["down_proj"].to(x.dtype)
        else:
            gate_up = F.linear(x, w["gate_up_proj"].to(x.dtype), w.get("gate_up_proj_bias"))
            y = F.linear(module._apply_gate(gate_up), w["down_proj"].to(x.dtype))
        if "down_proj_bias" in w:
            y = y + w["down_proj_bias"].to(x.dtype)
        y = y * top_k_weights[tokens, slot, None]
        out.index_add_(0, tokens, y.to(out.dtype))


def _offloaded_forward(module, hidden_states, top_k_index, top_k_weights):
    return module._moeprep.forward(module, hidden_states, top_k_index, top_k_weights)


def _register_implementation() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, _offloaded_forward)


@dataclass
class LoadedModel:
    """What ``load`` returns: the model, its tokenizer, and the offloading state behind ``stats()``."""

    model: torch.nn.Module
    tokenizer: object
    layers: dict[int, OffloadedExperts]
    store: ExpertStore
    budget: dict
    routing: InstalledRouting | None = None
    meter: MemoryMeter = field(default_factory=MemoryMeter)  # shared by every layer's cache
    _tokens: int = 0
    _seconds: float = 0.0
    _peak_cache_bytes: int = 0
    _started: list = field(default_factory=list)

    def cache_bytes(self) -> int:
        return sum(layer.cache.nbytes for layer in self.layers.values())

    def stats(self) -> dict:
        per_layer = {str(layer): vars(o.stats).copy() | {"slots": o.cache.slots} for layer, o in self.layers.items()}
        hits = sum(o.stats.hits for o in self.layers.values())
        misses = sum(o.stats.misses for o in self.layers.values())
        return {
            "layers": per_layer,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
            "bytes_read": sum(o.stats.bytes_read for o in self.layers.values()),
            "read_seconds": sum(o.stats.read_seconds for o in self.layers.values()),
            "stall_seconds": sum(o.stats.stall_seconds for o in self.layers.values()),
            "tokens": self._tokens,
            "forward_seconds": self._seconds,
            "tokens_per_second": self._tokens / self._seconds if self._seconds else None,
            "peak_cache_bytes": self._peak_cache_bytes,
            # caches + records being read or used outside a cache, at the worst moment (always <= the
            # budget's expert share: slots plus read buffers)
            "peak_expert_bytes": self.meter.peak,
            "budget": self.budget,
            "direct_io": self.store.direct_io,
        }

    def close(self) -> None:
        self.store.close()


def _rebuild_meta_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies) are computed in __init__; on meta they are empty.

    Rebuild each module that holds one from its config, on the target device, and take its buffers.
    """
    for name, module in model.named_modules():
        metas = [b for b, t in module.named_buffers(recurse=False) if t.is_meta]
        if not metas:
            continue
        config = getattr(module, "config", None)
        if config is None:
            raise LoaderError(f"cannot materialise buffers {metas} of {name}: module has no config")
        with torch.device(device):
            fresh = type(module)(config)
        for buf in metas:
            module.register_buffer(buf, getattr(fresh, buf), persistent=False)


def _experts_module(model: torch.nn.Module, path: str) -> torch.nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        raise ArtifactError(f"the manifest names experts module {path!r}, which the model does not have") from None


def load(artifact: str | Path, device: str = "cpu", memory_budget=None, store: str = "disk",
         policy: str = "lru", workers: int = 2, routing: RoutingPolicy | None = None) -> LoadedModel:
    """Open ``artifact`` and return a runnable model with its experts offloaded.

    memory_budget: None (the plan's cache sizes), bytes, a size string ("1.5GiB") for everything
    resident, or a percentage ("25%") meaning the dense weights plus that share of the expert store.
    routing: None (the model's own routers) or a ``loader.routing`` policy, e.g. ``ReplayRouting``.
    """
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    artifact = Path(artifact)
    manifest = read_manifest(artifact)
    check_sizes(artifact, manifest)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise LoaderError("device 'cuda' was asked for but torch sees no CUDA GPU; use device='cpu'")
    if policy not in POLICIES:
        raise LoaderError(f"eviction policy {policy!r} unknown; use one of {sorted(POLICIES)}")
    dev = torch.device(device)
    plan = json.loads((artifact / "plan.json").read_text())
    moe = manifest.moe
    (precision, info), = manifest.stores.items()  # one precision per artifact for now
    layout = RecordLayout.from_json(info.layout)

    dense_path = artifact / "dense.safetensors"
    dense = load_file(dense_path, device=str(dev))
    dense_bytes = sum(t.numel() * t.element_size() for t in dense.values())
    layers = moe["layers"]
    n_experts = moe["num_experts"]
    record = info.record_bytes
    buffers = moe["top_k"] * record  # records in flight while a layer waits on reads
    budget = parse_budget(memory_budget)
    minimum = dense_bytes + buffers + len(layers) * record
    if budget is None:
        slots = {int(k): v for k, v in plan["cache_slots"].items()}
        limit = None
    else:
        if budget[0] == "fraction":
            limit = dense_bytes + buffers + budget[1] * len(layers) * n_experts * record
        else:
            limit = budget[1]
        if limit < minimum:
            raise LoaderError(
                f"memory budget {memory_budget!r} ({int(limit):,} bytes) is below the minimum of {minimum:,} bytes "
                f"(dense weights {dense_bytes:,} + one expert per layer and read buffers); raise the budget"
            )
        per_layer = int((limit - dense_bytes - buffers) // (len(layers) * record))
        slots = {layer: max(1, min(n_experts, per_layer)) for layer in layers}

    config = AutoConfig.from_pretrained(artifact)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, moe["dtype"]))
    missing, unexpected = model.load_state_dict(dense, strict=False, assign=True)
    expert_params = set(moe["expert_params"])
    tied = {k for k in missing if k.endswith("lm_head.weight")} if config.get_text_config().tie_word_embeddings else set()
    other = [k for k in missing if k not in expert_params and k not in tied]
    if unexpected or other:
        raise ArtifactError(f"dense.safetensors does not fit the model: missing {other[:5]}, unexpected {unexpected[:5]}")
    if tied:
        model.tie_weights()
    _rebuild_meta_buffers(model, dev)

    expert_store = ExpertStore(artifact / info.file, mode=store, device=dev, workers=workers)
    meter = MemoryMeter()  # every layer's cache and reads in flight, counted together
    offloaded: dict[int, OffloadedExperts] = {}
    for layer, path in zip(layers, moe["experts_modules"], strict=True):
        module = _experts_module(model, path)
        for name in [n for n, p in module.named_parameters(recurse=False) if p.is_meta]:
            del module._parameters[name]  # never materialised: experts live in the store and the cache
        state = OffloadedExperts(layer, LayerCache(slots[layer], POLICIES[policy](), meter), expert_store, layout,
                                 max_in_flight=buffers // record)
        module._moeprep = state
        offloaded[layer] = state
    _register_implementation()
    model.config._experts_implementation = IMPLEMENTATION
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    if leftover:
        raise ArtifactError(f"weights missing from the artifact: {leftover[:5]}")
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(artifact)
    loaded = LoadedModel(model, tokenizer, offloaded, expert_store, {
        "requested": memory_budget, "limit_bytes": int(limit) if limit is not None else None,
        "dense_bytes": dense_bytes, "buffer_bytes": buffers, "record_bytes": record,
        "cache_slots": {str(k): v for k, v in slots.items()}, "precision": precision,
    }, meter=meter)
    loaded.routing = install_routing(model, moe["experts_modules"], routing)
    _attach_counters(loaded)
    return loaded


def _attach_counters(loaded: LoadedModel) -> None:
    """Count tokens, forward time and the cache's peak bytes on every forward of the model."""

    def before(_module, args, kwargs):
        loaded._started.append(time.perf_counter())

    def after(_module, args, kwargs, output):
        ids = kwargs.get("input_ids", args[0] if args else None)
        loaded._seconds += time.perf_counter() - loaded._started.pop()
        if ids is not None:
            loaded._tokens += ids.numel()
        loaded._peak_cache_bytes = max(loaded._peak_cache_bytes, loaded.cache_bytes())

    loaded.model.register_forward_pre_hook(before, with_kwargs=True)
    loaded.model.register_forward_hook(after, with_kwargs=True)
