"""The source model in bounded memory: dense weights loaded, routed experts read from the shards on demand.

Mixtral-8x7B is 93 GB in bfloat16, of which 90 GB are routed experts. ``load_streamed`` builds the model on
the meta device, loads every non-expert tensor from the checkpoint (through transformers' own renamings of
hub names, so a per-expert hub checkpoint and a fused one load alike) and leaves the expert parameters on
meta. An ``ExpertStream`` then owns them:

- a forward through an experts module first makes its MoE layer *resident*: every expert of the layer read
  from the shards (``adapter.read_expert``, only those bytes) into real parameters;
- resident layers are kept, least recently used first out, while they fit ``resident_bytes``; with 0 only
  the layer running is in memory. A forward over a batch of sequences thus reads each layer once: the
  calibration activations are what is held between layers;
- ``adapter.get_expert`` / ``set_expert`` work on a layer that is not resident: reads come from the source,
  writes are kept as per-expert overrides (dropped again when an expert is set back to its source bytes);
- ``use_source`` swaps where experts come from (the bitwidth search scores decoded records this way), and
  ``preserved`` puts source and overrides back however a block ends.

Peak memory is then the dense weights, the resident layers (at least the one running) and the activations.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from torch import nn

from loader.runtime import _rebuild_meta_buffers
from prep.adapters import build_skeleton, get_adapter, load_config
from prep.adapters.base import ExpertWeights, MoeAdapter
from prep.adapters.checkpoint import CheckpointTensors
from prep.adapters.source_formats import source_format
from prep.errors import MoeprepError

ExpertSource = Callable[[int, int], ExpertWeights]  # (model layer, expert) -> that expert's weights


class ExpertStream:
    """The routed experts of a model whose expert parameters live on meta until a layer is needed."""

    def __init__(self, model: nn.Module, adapter: MoeAdapter, checkpoint_dir: Path, dtype: torch.dtype,
                 device: torch.device, resident_bytes: int) -> None:
        self.model, self.adapter, self.dtype, self.device = model, adapter, dtype, device
        self.resident_bytes = max(0, int(resident_bytes))
        self.tensors = CheckpointTensors(checkpoint_dir)
        self.checkpoint_dir = Path(checkpoint_dir)
        self.modules = {layer: adapter.experts(model, layer) for layer in adapter.moe_layers}
        self.shapes = {layer: {name: tuple(p.shape) for name, p in m.named_parameters(recurse=False)}
                       for layer, m in self.modules.items()}
        self.layer_bytes = sum(torch.Size(s).numel() for s in self.shapes[adapter.moe_layers[0]].values()) \
            * torch.empty((), dtype=dtype).element_size()
        self.source: ExpertSource = self.checkpoint_expert
        self.overrides: dict[tuple[int, int], ExpertWeights] = {}
        self.resident: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.pins: dict[int, int] = {}
        self.reads = 0  # layers made resident, for tests and progress
        for layer, module in self.modules.items():
            self._to_meta(layer)
            module.expert_stream = self
            module.register_forward_pre_hook(lambda m, args, layer=layer: self.acquire(layer))
            module.register_forward_hook(lambda m, args, out, layer=layer: self.release(layer), always_call=True)

    # --- where experts come from ---------------------------------------------------------------
    def checkpoint_expert(self, layer: int, expert: int) -> ExpertWeights:
        """Expert ``expert`` of model layer ``layer`` as the checkpoint holds it."""
        return self.adapter.read_expert(self.checkpoint_dir, layer, expert, tensors=self.tensors)

    def is_resident(self, layer: int) -> bool:
        return layer in self.resident

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        """A copy of the expert of a layer that is not resident as the model would compute with it (override,
        else source), in the model's dtype."""
        override = self.overrides.get((layer, expert))
        if override is not None:  # a copy: the caller may change what it gets
            return ExpertWeights(**{n: t.clone() for n, t in override.tensors().items()})
        return self.source(layer, expert).to(self.dtype).contiguous()

    def set_expert(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        """Make the model compute expert (layer, expert) with ``weights`` from now on."""
        source = self.source(layer, expert)
        same = all(torch.equal(a.to("cpu", self.dtype), b.to("cpu", self.dtype))
                   for a, b in zip(weights.tensors().values(), source.tensors().values(), strict=True))
        if same:
            self.overrides.pop((layer, expert), None)
        else:
            self.overrides[(layer, expert)] = ExpertWeights(**{n: t.to("cpu", self.dtype).clone()
                                                               for n, t in weights.tensors().items()})
        if layer in self.resident:
            self._write(layer, expert, weights)

    def use_source(self, source: ExpertSource | None) -> None:
        """Compute every expert from ``source`` (None: the checkpoint) and forget the overrides."""
        self._check_idle()
        self.drop_all()
        self.source = source or self.checkpoint_expert
        self.overrides.clear()

    @contextmanager
    def preserved(self) -> Iterator[None]:
        """Run the block, then put source and overrides back as they were (also on errors)."""
        source, overrides = self.source, dict(self.overrides)
        try:
            yield
        except BaseException:
            self.source, self.overrides = source, overrides
            self.drop_all()  # never raises: the block's own error is the one to see
            raise
        self.source, self.overrides = source, overrides
        self._check_idle()
        self.drop_all()

    # --- residency -------------------------------------------------------------------------------
    def acquire(self, layer: int) -> None:
        """Make ``layer`` resident (reading it if needed) and keep it so until ``release``."""
        if layer in self.resident:
            self.resident.move_to_end(layer)
        else:
            self._trim(extra=self.layer_bytes)
            try:
                self._fill(layer)
            except BaseException:  # a shard refused mid-layer: the layer stays unread, not half written
                self._to_meta(layer)
                raise
            self.resident[layer] = None
        self.pins[layer] = self.pins.get(layer, 0) + 1

    def release(self, layer: int) -> None:
        if not self.pins.get(layer):  # its acquire failed (the forward hook runs anyway): nothing to release
            return
        self.pins[layer] -= 1
        self._trim()

    @contextmanager
    def layer(self, layer: int) -> Iterator[None]:
        """``layer`` resident for the block."""
        self.acquire(layer)
        try:
            yield
        finally:
            self.release(layer)

    def drop_all(self) -> None:
        """Forget every resident layer (they are read again from the source when next needed)."""
        for layer in list(self.resident):
            self.pins.pop(layer, None)
            self._drop(layer)

    def _check_idle(self) -> None:
        if any(self.pins.values()):
            raise MoeprepError("cannot swap the expert source while a MoE layer is running; swap it between forwards")

    def _trim(self, extra: int = 0) -> None:
        for layer in list(self.resident):
            if len(self.resident) * self.layer_bytes + extra <= self.resident_bytes:
                return
            if not self.pins.get(layer):
                self._drop(layer)

    def _drop(self, layer: int) -> None:
        del self.resident[layer]
        self._to_meta(layer)

    def _to_meta(self, layer: int) -> None:
        module = self.modules[layer]
        for name, shape in self.shapes[layer].items():
            module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=self.dtype, device="meta"),
                                                    requires_grad=False)

    def _fill(self, layer: int) -> None:
        module = self.modules[layer]
        for name, shape in self.shapes[layer].items():
            module._parameters[name] = nn.Parameter(torch.empty(shape, dtype=self.dtype, device=self.device),
                                                    requires_grad=False)
        for expert in range(self.adapter.num_experts):
            self._write(layer, expert, self.overrides.get((layer, expert)) or self.source(layer, expert))
        self.reads += 1

    @torch.no_grad()
    def _write(self, layer: int, expert: int, weights: ExpertWeights) -> None:
        views = self.adapter.module_views(self.modules[layer], expert).tensors()
        for name, tensor in weights.tensors().items():
            views[name].copy_(tensor)


def give_back_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; nothing elsewhere): after a streamed pass
    the freed layers and activations otherwise stay in the process's resident set, and the next model's memory
    comes on top of them."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def stream_of(model: nn.Module, adapter: MoeAdapter) -> ExpertStream | None:
    """The model's expert stream, None for a model loaded whole."""
    return getattr(adapter.experts(model, adapter.moe_layers[0]), "expert_stream", None)


def resident_layer(model: nn.Module, adapter: MoeAdapter, layer: int):
    """Context: MoE layer ``layer``'s expert parameters real for the block (nothing to do for a whole model)."""
    stream = stream_of(model, adapter)
    return stream.layer(layer) if stream is not None else nullcontext()


# --- loading -----------------------------------------------------------------------------------


def _renamings(model_type: str) -> list[tuple[re.Pattern, str]]:
    """transformers' renamings from hub checkpoint names to its module names (e.g. Mixtral's
    ``block_sparse_moe`` -> ``mlp``); its expert converters are ours to do (``read_expert``)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    out = []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        if type(rule).__name__ == "WeightRenaming":
            out += [(re.compile(s), t) for s, t in zip(rule.source_patterns, rule.target_patterns, strict=True)]
    return out


def _model_dtype(config, tensors: CheckpointTensors, names: list[str]) -> torch.dtype:
    # from_pretrained(dtype="auto"): the config's dtype, else the first floating tensor's
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if isinstance(dtype, torch.dtype):
        return dtype
    for name in names:
        t = tensors.get(name)
        if t.is_floating_point() and t.element_size() > 1:  # not an FP8 weight: it is dequantized
            return t.dtype
    return torch.float32


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


AUTO_SHARE = 0.5  # --expert-memory auto: resident experts may take this share of the memory available at load


def _fp32_patterns(model: nn.Module, dtype: torch.dtype) -> list[re.Pattern]:
    """The tensors ``from_pretrained`` keeps in float32 at ``dtype`` (e.g. DeepSeek-V2's router,
    ``_keep_in_fp32_modules_strict``), as name patterns."""
    names = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) if dtype in (torch.float16,
                                                                                            torch.bfloat16) else set()
    if dtype == torch.float16:
        names |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return [re.compile(rf"(^|\.){re.escape(n)}($|\.)") for n in sorted(names)]


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device; one clear error when it asks for CUDA and there is none."""
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise MoeprepError(f"--device {device!r} is not a device; use cpu or cuda (cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise MoeprepError(f"--device {device!r}: moeprep runs its stages on cpu or cuda (cuda:N)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MoeprepError("--device cuda was asked for, but torch sees no CUDA GPU here; use --device cpu")
    return device


def load_streamed(model_dir: str | Path, *, device: str | torch.device = "cpu",
                  resident_bytes: int | str | None = "auto") -> nn.Module:
    """The ``*ForCausalLM`` of a checkpoint directory with its routed experts streamed (see module docstring).

    resident_bytes: expert bytes kept in memory between uses: None keeps every layer once read (as a whole
    load would), 0 only the layer running, "auto" what fits in ``AUTO_SHARE`` of the memory available now
    after the dense weights (every layer, for a model that fits).
    Raises MoeprepError for a missing directory, an unsupported architecture or a checkpoint that lacks a
    non-expert tensor of the model.
    """

    model_dir = Path(model_dir)
    device = check_device(device)
    free = available_memory() if device.type == "cpu" else None  # before the dense weights take their share
    config = load_config(model_dir)
    source_format(config)  # a quantization this reader cannot dequantize is one clear error, before any read
    model = build_skeleton(config).eval()
    adapter = get_adapter(model)
    tensors = CheckpointTensors(model_dir)
    names = tensors.names()
    dtype = _model_dtype(config, tensors, names)
    keep_fp32 = _fp32_patterns(model, dtype)
    expert_prefixes = tuple(f"{p}." for p in adapter.module_paths(model)["experts_modules"])
    wanted = {n: t for n, t in model.state_dict(keep_vars=True).items() if not n.startswith(expert_prefixes)}
    renamings = _renamings(adapter.model_type)
    loaded = set()
    for name in names:
        target = name
        for pattern, replacement in renamings:
            target = pattern.sub(replacement, target)
        if target.startswith(expert_prefixes) or target not in wanted:
            continue
        value = tensors.get_float(name)  # an FP8 weight with block scales comes dequantized; a float, finite
        value = value.to(torch.float32 if any(p.search(target) for p in keep_fp32) else dtype)
        module_name, _, attr = target.rpartition(".")
        module = model.get_submodule(module_name)
        if tuple(value.shape) != tuple(wanted[target].shape):
            raise MoeprepError(f"checkpoint tensor {name} has shape {tuple(value.shape)}, the model's {target} "
                               f"{tuple(wanted[target].shape)}; is {model_dir} the model its config.json describes?")
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(value.to(device), requires_grad=False)
        else:
            module._buffers[attr] = value.to(device)
        loaded.add(target)
    if getattr(config, "tie_word_embeddings", False) or getattr(getattr(config, "text_config", None),
                                                                "tie_word_embeddings", False):
        model.tie_weights()
        loaded |= {n for n, t in model.state_dict(keep_vars=True).items() if not t.is_meta}
    missing = sorted(n for n in wanted if n not in loaded and wanted[n].is_meta
                     and n in dict(model.named_parameters(remove_duplicate=False)))
    if missing:
        raise MoeprepError(f"checkpoint {model_dir} lacks {len(missing)} tensor(s) of the model, e.g. {missing[:3]}; "
                           "is it complete (every shard present) and the model its config.json describes?")
    _rebuild_meta_buffers(model, device)
    experts_bytes = sum(m.numel() for layer in adapter.moe_layers
                        for m in adapter.experts(model, layer).parameters(recurse=False)) * \
        torch.empty((), dtype=dtype).element_size()
    if resident_bytes == "auto":  # the memory available before the dense weights, less them
        dense_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values() if not t.is_meta)
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0] + dense_bytes
        resident_bytes = experts_bytes if free is None else int(max(0, AUTO_SHARE * free - dense_bytes))
    ExpertStream(model, adapter, model_dir, dtype, device,
                 experts_bytes if resident_bytes is None else resident_bytes)
    return model
