"""Stage ``package``: assemble the artifact directory the loader opens (format: ``loader/format.py``).

Built in a temporary directory next to the target and renamed into place; ``manifest.json`` is written
last, so a directory with a manifest is complete.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from loader.files import write_json_atomic
from loader.format import FORMAT, MANIFEST, SCHEMA_VERSION, expert_key, sha256_file
from loader.plan import PLAN_FILE, Plan
from prep.records import write_aligned_records
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
                     out_dir: Path, package_key: str) -> dict:
    """Write the artifact to ``out_dir``; returns the report."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    paths = adapter.module_paths(model)
    experts = [adapter.experts(model, layer) for layer in adapter.moe_layers]
    expert_params = {f"{path}.{p}" for path, m in zip(paths["experts_modules"], experts, strict=True)
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
    crc32 = write_aligned_records(tmp / store_name, ordered, quantize["record_bytes"])

    budget = f"{recipe.package.cache_fraction * 100:g}%"
    plan = Plan.default(len(adapter.moe_layers), adapter.num_experts, precision, default_budget=budget)
    write_json_atomic(tmp / PLAN_FILE, plan.to_json())

    source_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False))
    store_bytes = len(ordered) * quantize["record_bytes"]
    dense_bytes = (tmp / "dense.safetensors").stat().st_size
    report = {
        "architecture": adapter.architecture,
        "sizes": {"dense_bytes": dense_bytes, f"experts_{precision}_bytes": store_bytes,
                  "experts_source_bytes": source_bytes, "store_file_bytes": (tmp / store_name).stat().st_size},
        "compression": {precision: round(source_bytes / store_bytes, 3)},
        "record_bytes": quantize["record_bytes"],
    }
    write_json_atomic(tmp / "report.json", report)

    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(tmp.iterdir()) if p.is_file()}
    manifest = {
        "format": FORMAT,
        "schema_version": max(SCHEMA_VERSION, 2),  # TODO: SCHEMA_VERSION once format.py reads 2
        "producer": _producer(),
        "source_model": source,
        "recipe": recipe.to_dict(),
        "package_key": package_key,
        "moe": {
            "architecture": adapter.model_type,
            "layers": adapter.moe_layers,
            "num_experts": adapter.num_experts,
            "top_k": adapter.top_k,
            "dtype": str(model.dtype).removeprefix("torch."),
            "experts_modules": paths["experts_modules"],
            "router_modules": paths["router_modules"],
            "last_decoder_layer": paths["last_decoder_layer"],
            "expert_params": sorted(expert_params),
            "source_expert_bytes": source_bytes,
        },
        "stores": {precision: {"file": store_name, "record_bytes": quantize["record_bytes"],
                               "layout": quantize["layout"], "crc32": crc32}},
        "plan_summary": {"precision": precision, "default_budget": budget, "eviction": plan.eviction.name},
        "files": files,
    }
    write_json_atomic(tmp / MANIFEST, manifest)  # last: marks completeness
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return report
