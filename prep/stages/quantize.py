"""Stage ``quantize``: every expert packed at the recipe's precision, one record per expert.

Work is written one MoE layer at a time (``layer-<l>.safetensors``, atomically), so an interrupted run
resumes at the first layer not yet written; HQQ on CPU is deterministic, so a resumed run yields the
same bytes as an uninterrupted one.
"""

from __future__ import annotations

import os
from pathlib import Path

from safetensors.torch import load_file, save_file
from tqdm import tqdm

from loader.format import expert_key
from prep.quant.hqq_codec import encode_expert
from prep.recipe import QuantizeSection

VERSION = 1


def expert_tensors(adapter, model, layer: int, expert: int) -> tuple[dict, bool]:
    """One expert's tensors in the experts module's own per-expert layout, and whether it is transposed."""
    module = adapter.experts(model, layer)
    tensors = {name: p[expert].detach() for name, p in module.named_parameters(recurse=False)}
    return tensors, bool(getattr(module, "is_transposed", False))


def quantize_experts(model, adapter, cfg: QuantizeSection, work: Path) -> dict:
    """Write ``work/layer-<l>.safetensors`` for every MoE layer; returns the layout and file list."""
    layout = None
    files = []
    units = [(layer, e) for layer in adapter.moe_layers for e in range(adapter.num_experts)]
    bar = tqdm(total=len(units), desc=f"quantize {cfg.precision}", unit="expert")
    for layer in adapter.moe_layers:
        path = work / f"layer-{layer}.safetensors"
        files.append(path.name)
        if path.is_file():  # finished before an interruption
            bar.update(adapter.num_experts)
            if layout is None:
                tensors, transposed = expert_tensors(adapter, model, layer, 0)
                layout, _ = encode_expert(tensors, cfg.precision, cfg.group_size, transposed)
            continue
        records = {}
        for expert in range(adapter.num_experts):
            tensors, transposed = expert_tensors(adapter, model, layer, expert)
            layout, record = encode_expert(tensors, cfg.precision, cfg.group_size, transposed)
            records[expert_key(layer, expert)] = record
            bar.update(1)
        tmp = path.with_name(f".{path.name}.tmp")
        save_file(records, str(tmp))
        os.replace(tmp, path)
    bar.close()
    return {"precision": cfg.precision, "group_size": cfg.group_size, "layout": layout.to_json(),
            "record_bytes": layout.nbytes, "files": files}


def read_records(stage_dir: Path, result: dict) -> dict:
    """All records of a finished quantize stage, keyed ``layers.{l}.experts.{e}``, in order."""
    records = {}
    for name in result["files"]:
        records.update(load_file(str(stage_dir / name)))
    return records
