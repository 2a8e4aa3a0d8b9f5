"""Stage ``package``: assemble the artifact directory the loader opens (format: ``loader/format.py``).

Built in a temporary directory next to the target and renamed into place; ``manifest.json`` is written
last, so a directory with a manifest is complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from loader.format import FORMAT, MANIFEST, SCHEMA_VERSION, expert_key, sha256_file, write_aligned_records
from prep.stages.quantize import read_records

VERSION = 1


def _producer() -> dict:
    from importlib.metadata import version

    import transformers

    from prep import __version__

    # hqq sets no __version__; the installed distribution's metadata knows it
    return {"moeprep": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "hqq": version("hqq")}


def _dense_state(model, expert_params: set[str]) -> dict[str, torch.Tensor]:
    """Every non-expert tensor once (a tied lm_head is left to the loader to tie again)."""
    out, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if name in expert_params:
            continue
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.detach().contiguous().cpu()
    return out


def package_artifact(model, adapter, tokenizer, recipe, source: dict, quantize_dir: Path, quantize: dict,
                     timings: dict, out_dir: Path) -> dict:
    """Write the artifact to ``out_dir``; returns the report."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    names = {id(m): n for n, m in model.named_modules()}
    experts = [adapter.experts(model, layer) for layer in adapter.moe_layers]
    modules = [names[id(m)] for m in experts]
    expert_params = {f"{path}.{p}" for path, m in zip(modules, experts, strict=True)
                     for p, _ in m.named_parameters(recurse=False)}
    model.config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    dense = _dense_state(model, expert_params)
    save_file(dense, str(tmp / "dense.safetensors"), metadata={"format": "pt"})

    precision = quantize["precision"]
    store_name = f"experts-{precision}.safetensors"
    records = read_records(quantize_dir, quantize)
    ordered = {expert_key(layer, e): records[expert_key(layer, e)].numpy().tobytes()
               for layer in adapter.moe_layers for e in range(adapter.num_experts)}
    write_aligned_records(tmp / store_name, ordered, quantize["record_bytes"])

    slots = max(1, math.ceil(recipe.package.cache_fraction * adapter.num_experts))
    plan = {
        "expert_precision": {str(layer): [precision] * adapter.num_experts for layer in adapter.moe_layers},
        "cache_slots": {str(layer): slots for layer in adapter.moe_layers},
        "eviction_policy": "lru",
    }
    (tmp / "plan.json").write_text(json.dumps(plan, indent=2) + "\n")

    source_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False))
    store_bytes = len(ordered) * quantize["record_bytes"]
    dense_bytes = (tmp / "dense.safetensors").stat().st_size
    report = {
        "architecture": adapter.architecture,
        "sizes": {"dense_bytes": dense_bytes, f"experts_{precision}_bytes": store_bytes,
                  "experts_source_bytes": source_bytes, "store_file_bytes": (tmp / store_name).stat().st_size},
        "compression": {precision: round(source_bytes / store_bytes, 3)},
        "record_bytes": quantize["record_bytes"],
        "stage_seconds": timings,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "producer": _producer(),
        "source_model": source,
        "recipe": recipe.to_dict(),
        "moe": {
            "architecture": adapter.model_type,
            "layers": adapter.moe_layers,
            "num_experts": adapter.num_experts,
            "top_k": adapter.top_k,
            "dtype": str(model.dtype).removeprefix("torch."),
            "experts_modules": modules,
            "expert_params": sorted(expert_params),
        },
        "stores": {precision: {"file": store_name, "record_bytes": quantize["record_bytes"],
                               "layout": quantize["layout"]}},
        "plan_summary": {"precision": precision, "cache_slots_per_layer": slots},
        "files": files,
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")  # last: marks completeness
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return report
