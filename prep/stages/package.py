"""Stage ``package``: assemble the artifact directory the loader opens (format: ``loader/format.py``).

Reads the quantize stage; needs the model (dense weights, config, tokenizer, module paths), the
recipe (recorded in the manifest) and the artifact output. The files are written into a fresh
directory beside ``--output`` (``prep.store.ArtifactOutput.build``), ``manifest.json`` last, and the
finished directory is swapped in with one rename. The manifest records this stage's key
(``package_key``): a later run reuses the artifact only when that key matches and every listed file
has its recorded size; otherwise it builds it again. Every file is a pure function of the key's inputs
(no timestamps, no timings), so a rebuild is byte-identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from loader.files import write_json_atomic
from loader.format import FORMAT, SCHEMA_VERSION, sha256_file, write_manifest
from loader.plan import PLAN_FILE, Plan
from prep.recipe import PackageSection
from prep.records import write_aligned_records
from prep.stages import Stage, StageResult
from prep.stages.quantize import PackedExperts

VERSION = 2
REPORT = "report.json"


@dataclass(frozen=True)
class ArtifactReport(StageResult):
    """What the artifact holds and how much smaller it is; also written as the artifact's report.json."""

    architecture: str
    sizes: dict
    compression: dict
    record_bytes: int


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


def package_artifact(model, adapter, tokenizer, recipe: dict, source: dict, quantize_dir: Path,
                     quantize: PackedExperts, cfg: PackageSection, package_key: str, out: Path) -> ArtifactReport:
    """Write every artifact file into the empty directory ``out``, ``manifest.json`` last; returns the report.

    ``recipe`` is the resolved recipe the artifact derives from, ``source`` the source model's
    {path, revision, fingerprint}, ``package_key`` this stage's cache key.
    """
    out = Path(out)
    paths = adapter.module_paths(model)
    experts = [adapter.experts(model, layer) for layer in adapter.moe_layers]
    expert_params = {f"{path}.{p}" for path, m in zip(paths["experts_modules"], experts, strict=True)
                     for p, _ in m.named_parameters(recurse=False)}
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(_dense_state(model, expert_params), str(out / "dense.safetensors"), metadata={"format": "pt"})

    precision = quantize.precision
    store_name = f"experts-{precision}.safetensors"
    crc32 = write_aligned_records(out / store_name, quantize.records(quantize_dir), quantize.record_bytes)

    budget = f"{cfg.cache_fraction * 100:g}%"
    plan = Plan.default(len(adapter.moe_layers), adapter.num_experts, precision, default_budget=budget)
    write_json_atomic(out / PLAN_FILE, plan.to_json())

    source_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False))
    store_bytes = len(crc32) * quantize.record_bytes
    report = ArtifactReport(
        architecture=adapter.architecture,
        sizes={"dense_bytes": (out / "dense.safetensors").stat().st_size, f"experts_{precision}_bytes": store_bytes,
               "experts_source_bytes": source_bytes, "store_file_bytes": (out / store_name).stat().st_size},
        compression={precision: round(source_bytes / store_bytes, 3)},
        record_bytes=quantize.record_bytes,
    )
    write_json_atomic(out / REPORT, report.to_json())

    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(out.iterdir()) if p.is_file()}
    manifest = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "producer": _producer(),
        "source_model": source,
        "recipe": recipe,
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
        "stores": {precision: {"file": store_name, "record_bytes": quantize.record_bytes,
                               "layout": quantize.layout, "crc32": crc32}},
        "plan_summary": {"precision": precision, "default_budget": budget, "eviction": plan.eviction.name},
        "files": files,
    }
    write_manifest(out, manifest)  # last (sealed with its digest): marks completeness
    return report


def _run(inputs) -> ArtifactReport:
    quantize_dir, quantize = inputs.upstream("quantize")
    with inputs.artifact.build() as out:
        return package_artifact(inputs.model, inputs.adapter, inputs.tokenizer, inputs.recipe, inputs.source,
                                quantize_dir, quantize, inputs.config, inputs.key, out)


STAGE = Stage(
    name="package", version=VERSION, config=PackageSection, result=ArtifactReport,
    reads=("quantize",), needs=frozenset({"model", "recipe", "artifact"}),
    run=_run,
    output_ok=lambda inputs, result: inputs.artifact.matches(inputs.key),
)
