"""Opening an artifact: the load-time checks of the files its manifest lists (the second layer of the trust
``loader/format.py`` describes).

``open_artifact`` runs on every load: the sizes of every file; the sha256 of every file except the expert stores
(whose records are checked one by one as they are read, ``loader.hashing.check_record``) and the informational
report files; every JSON file parses; the MoE facts agree with ``config.json``; ``plan.json`` parses and fits the
manifest; every safetensors header is bounded by its file and the store headers hold exactly the offsets the
manifest implies. ``verify`` (``loader/verify.py``) runs the same checks with every hash.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from loader.errors import PREPARE_AGAIN as _PREPARE_AGAIN
from loader.errors import ArtifactError
from loader.format import (
    ALIGN,
    CONFIG,
    DENSE,
    DEVICE_FILE,
    MANIFEST,
    REPORT,
    Manifest,
    damaged,
    expert_key,
    file_problem,
    is_informational,
    is_int,
    read_json,
    read_manifest,
    report_problem,
    sealed_file,
)
from loader.io import read_record_offsets, read_safetensors_header
from loader.plan import PLAN_FILE, Plan, read_plan

# config.json names of E and K across architectures (a multimodal config nests them in text_config)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_top_k", "experts_per_token", "num_selected_experts")


def open_artifact(artifact: str | Path) -> Manifest:
    """The load-time checks; returns the validated manifest with its checked ``plan``.

    Raises ArtifactError (or PlanError, both MoeError) naming the file at fault and what to do.
    """
    manifest = read_manifest(artifact)
    stores = {s.file for s in manifest.stores.values()}
    problems = []
    for name in sorted(manifest.files):
        if is_informational(name):  # rewritten by `moeprep eval` and the studies: verified by `verify`
            continue
        if problem := file_problem(manifest, name, hash_it=name not in stores):
            problems.append((name, problem))
    if problems:
        raise damaged(manifest, problems)
    return check_contents(manifest)


def read_report(manifest: Manifest) -> dict:
    """The artifact's report.json ({} where it has none): sealed (``sealed_file``), nested at most
    ``loader.io.MAX_JSON_DEPTH`` deep, and what the commands read of it checked (``loader.format.report_problem``);
    ``moeload info`` and ``plan`` read it here, ``verify`` refuses what they refuse."""
    if REPORT not in manifest.files:
        return {}
    report = read_json(sealed_file(manifest, REPORT), REPORT)
    if problem := report_problem(report):
        raise ArtifactError(f"{manifest.path(REPORT)}: {problem}; {_PREPARE_AGAIN}", file=REPORT)
    return report


def check_contents(manifest: Manifest, informational: bool = False) -> Manifest:
    """Every JSON file parses, the MoE facts agree with config.json, the plan fits, every header is sound."""
    for name in sorted(manifest.files):
        # loading needs no report (``informational``: verify parses it too); device.json has its own reader
        # (``loader.device.read_artifact_profile``), which verify, plan and generate call, and a load does not read it
        if (name.endswith(".json") and name not in (PLAN_FILE, DEVICE_FILE)
                and (informational or not is_informational(name))):
            value = read_json(manifest.path(name), name)
            if name == CONFIG:
                _check_config(manifest, value)
    plan = read_plan(manifest.root)
    _check_plan(manifest, plan)
    read_safetensors_header(manifest.path(DENSE), DENSE)
    for precision in manifest.stores:
        store_offsets(manifest, precision)
    return replace(manifest, plan=plan)


def _check_config(manifest: Manifest, config) -> None:
    """num_experts, top_k, the architecture and the layer indices agree with config.json."""
    where = manifest.root / CONFIG

    def fail(what: str) -> ArtifactError:
        return ArtifactError(f"{where} and {manifest.root / MANIFEST} disagree: {what}. One of them was edited "
                             f"or mixed up with another model's: {_PREPARE_AGAIN}", file=CONFIG)

    if not isinstance(config, dict):
        raise ArtifactError(f"{where} must hold a JSON object; {_PREPARE_AGAIN}", file=CONFIG)
    moe = manifest.moe
    configs = [config] + ([config["text_config"]] if isinstance(config.get("text_config"), dict) else [])
    for cfg in configs:
        for keys, fact, value in ((EXPERT_COUNT_KEYS, "num_experts", moe.num_experts), (TOP_K_KEYS, "top_k", moe.top_k)):
            for key in keys:
                if cfg.get(key) is not None and cfg[key] != value:
                    raise fail(f"config {key} is {json.dumps(cfg[key])[:40]}, manifest moe.{fact} is {value}")
    if moe.architecture not in [cfg.get("model_type") for cfg in configs]:
        raise fail(f"config model_type is {config.get('model_type')!r}, manifest moe.architecture is "
                   f"{moe.architecture!r}")
    depth = [cfg["num_hidden_layers"] for cfg in configs if is_int(cfg.get("num_hidden_layers"))]
    if depth:
        n = depth[-1]
        if moe.layers[-1] >= n:
            raise fail(f"manifest moe.layers {list(moe.layers)} reach past the config's {n} layers")
        if moe.last_decoder_layer.split(".")[-1] != str(n - 1):
            raise fail(f"manifest moe.last_decoder_layer {moe.last_decoder_layer!r} is not layer {n - 1}")


def _check_plan(manifest: Manifest, plan: Plan) -> None:
    moe = manifest.moe
    if plan.num_layers != len(moe.layers) or plan.num_experts != moe.num_experts:
        raise ArtifactError(f"{manifest.root / PLAN_FILE} is for {plan.num_layers} layers x {plan.num_experts} "
                            f"experts, the manifest has {len(moe.layers)} x {moe.num_experts}; "
                            f"{_PREPARE_AGAIN}", file=PLAN_FILE)
    if missing := sorted(set(plan.precisions) - set(manifest.stores)):
        raise ArtifactError(f"{manifest.root / PLAN_FILE} uses precisions {missing} that the artifact has no "
                            f"store for (stores: {sorted(manifest.stores)}); {_PREPARE_AGAIN}", file=PLAN_FILE)
    for pos, (layer, row) in enumerate(zip(moe.layers, plan.expert_precision, strict=True)):
        for e, precision in enumerate(row):
            if expert_key(layer, e) not in manifest.stores[precision].xxh3:
                raise ArtifactError(f"{manifest.root / PLAN_FILE} plans expert {e} of MoE layer {pos} at {precision}, "
                                    f"but the {precision} store has no record of it; {_PREPARE_AGAIN}", file=PLAN_FILE)


def store_offsets(manifest: Manifest, precision: str) -> dict[str, int]:
    """The record offsets of a store, after checking its header holds exactly what the manifest implies:
    the manifest's record_bytes and stride, the data section 4 KiB-aligned, and record i of
    ``manifest.store_keys(precision)`` at data offset i * stride as ``shape [stride]`` uint8."""
    info = manifest.stores[precision]
    path = manifest.path(info.file)
    offsets, record_bytes, stride = read_record_offsets(path)
    header, _, start = read_safetensors_header(path, info.file)

    def fail(what: str) -> ArtifactError:
        return ArtifactError(f"{path}: {what}, which does not match the manifest; {_PREPARE_AGAIN}", file=info.file)

    if record_bytes != info.record_bytes or stride != info.stride:
        raise fail(f"records of {record_bytes} bytes every {stride}")
    if start % ALIGN:
        raise fail(f"its data starts at byte {start}, not on a {ALIGN}-byte boundary")
    keys = manifest.store_keys(precision)
    if list(header) != keys:
        raise fail(f"it holds {len(header)} records under other names or in another order")
    for i, key in enumerate(keys):
        entry = header[key]
        if entry["dtype"] != "U8" or entry["shape"] != [stride] or entry["data_offsets"] != [i * stride, (i + 1) * stride]:
            raise fail(f"record {key} is laid out as {json.dumps(entry)}")
    return offsets
