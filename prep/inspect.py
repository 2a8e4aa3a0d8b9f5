"""The README's table of supported models, computed from the shipped configs (``moeprep inspect-model --table``).

For every real-model recipe: its model (built on the meta device from ``recipes/<name>/config.json``, no
weights), total and active parameters, the bytes of all routed experts at each precision (the record sizes
the codec writes, metadata included), the memory ``prepare`` needs when it streams the checkpoint one MoE
layer at a time (``--expert-memory 0``), and the artifact's size. The README holds the output between two
markers; ``--readme README.md`` rewrites that block, and a test checks it is current.

Memory to prepare is an estimate from sizes, in the terms the streaming test measures (tests/prep/sources/test_streaming.py):
the process itself (``RUNTIME_BYTES``, measured), the dense weights, two MoE layers of experts (the layer
read and the records written from it), and the trace stage's activations for one batch of calibration
sequences: ``ACTIVATION_COPIES`` float32 hidden states per token, one layer's eager attention scores, and the
captures the trace keeps per token until the batch is written (router inputs in float16, router logits,
experts and weights for every MoE layer).
"""

from __future__ import annotations

from pathlib import Path

import torch

from loader.codec import CodecError, RecordLayout
from loader.vocab import PRECISIONS as STORE_PRECISIONS
from prep.adapters import build_skeleton, get_adapter, inspect_model, load_config
from prep.adapters.source_formats import fp8_block, source_format, stored_bytes
from prep.calibration import check_context
from prep.errors import MoeprepError
from prep.evals.data import load_benchmarks
from prep.evals.workload import DEVICES, suite_seconds, suite_workloads
from prep.pipeline import STAGES
from prep.quant.hqq_codec import matrix_spec
from prep.readme_block import update_readme as update_readme  # re-exported: cli, tests
from prep.recipe import load_recipe
from prep.stages.quantize import QuantizeSection

PRECISIONS = ("bfloat16", *(p for p in STORE_PRECISIONS if p != "passthrough"))  # the table's columns
RUNTIME_BYTES = 400 * 2**20  # python + torch + transformers + moeprep, no model (the streaming test measures ~380 MiB)
ACTIVATION_COPIES = 8  # float32 [tokens, H] tensors alive at once in a decoder layer (residual, norm, attention, MLP)
MARKERS = ("<!-- models-table:start (moeprep inspect-model --table recipes/*.yaml --readme README.md) -->",
           "<!-- models-table:end -->")
EVAL_MARKERS = ("<!-- eval-time:start (moeprep inspect-model --table recipes/*.yaml --data ../shared/data/benchmarks "
                "--readme README.md) -->", "<!-- eval-time:end -->")


def _gb(n: float | None) -> str:
    if n is None:  # a precision whose default format cannot encode these experts
        return "n/a"
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def expert_record_bytes(adapter, skeleton, precision: str, quantize: QuantizeSection | None = None) -> int | None:
    """Bytes of one routed expert's record at ``precision`` (bfloat16: the plain weights in bfloat16), in the format
    ``quantize`` (the recipe's section) gives it, else the precision's default; None where that format cannot
    encode these experts (a group size that does not divide their input dimension)."""

    experts = adapter.experts(skeleton, adapter.moe_layers[0])
    params = {name: p[0].to(torch.bfloat16) for name, p in experts.named_parameters(recurse=False)}
    transposed = bool(getattr(experts, "is_transposed", False))
    if precision == "bfloat16":
        return sum(t.numel() * 2 for t in params.values())
    group, meta = (quantize if quantize is not None and precision in quantize.precisions
                   else QuantizeSection(precision=precision)).format_of(precision)
    try:
        return RecordLayout(tuple(matrix_spec(n, t, precision, group, transposed, meta_group=meta)
                                  for n, t in params.items())).nbytes
    except (MoeprepError, CodecError):
        return None


def model_row(recipe_path: str | Path, root: str | Path = ".") -> dict:
    """The sizes of one real-model recipe's model, from its shipped config (see the module docstring)."""

    recipe = load_recipe(recipe_path)
    if recipe.model.config is None:
        raise MoeprepError(f"{recipe_path} ships no config (model.config); the table covers real-model recipes")
    return recipe_sizes(recipe, (Path(root) / recipe.model.config).parent)


def recipe_sizes(recipe, config_dir: Path) -> dict:
    """The sizes of ``recipe``'s model, from the config.json in ``config_dir`` (no weights read)."""

    info = inspect_model(config_dir)
    config = load_config(config_dir)
    skeleton = build_skeleton(config)
    adapter = get_adapter(config)
    n_layers, n_experts = len(adapter.moe_layers), adapter.num_experts
    one = {p: expert_record_bytes(adapter, skeleton, p, recipe.quantize) for p in PRECISIONS}
    experts = {p: b * n_layers * n_experts if b is not None else None for p, b in one.items()}
    dense = (info["total_params"] - info["expert_params_total"]) * 2  # bfloat16
    layer = experts["bfloat16"] // n_layers
    tokens = recipe.trace.batch * recipe.calibration.sequence_length
    heads = getattr(adapter.config, "num_attention_heads", 1)
    capture = n_layers * (2 * adapter.hidden_size + 4 * n_experts + 12 * adapter.top_k) + 4 * adapter.hidden_size
    activations = (tokens * ACTIVATION_COPIES * 4 * adapter.hidden_size
                   + recipe.trace.batch * heads * recipe.calibration.sequence_length ** 2 * 4 + tokens * capture)
    shipped = recipe.quantize.precision
    fmt = source_format(config)
    return {
        "recipe": recipe.name, "hub_id": recipe.model.hub_id, "architecture": info["architecture"],
        "total_params": info["total_params"], "active_params": info["active_params"],
        "expert_bytes": experts, "dense_bytes": dense,
        "prepare_bytes": RUNTIME_BYTES + dense + 2 * layer + activations,
        "artifact_bytes": dense + experts["bfloat16" if shipped == "passthrough" else shipped],
        "artifact_mixed": recipe.bitwidth.method != "uniform",
        "shipped": shipped,
        "num_moe_layers": n_layers, "num_experts": n_experts,
        "source_expert_bytes": info["expert_params_total"] * _itemsize(config),
        "source_format": fmt,
        "checkpoint_bytes": checkpoint_bytes(skeleton, adapter, fmt, _itemsize(config), config),
        "dequantized_bytes": info["total_params"] * _itemsize(config),
    }


def checkpoint_bytes(skeleton, adapter, fmt: str, itemsize: int, config) -> int:
    """Bytes of the checkpoint as released (one pass of ``prepare`` over it reads them): the experts' matrices in
    MXFP4 for an ``mxfp4`` release, every linear weight but the head's and the routers' in FP8 for an ``fp8`` one
    (``prep/adapters/source_formats.py``), the rest at the model's dtype."""
    from torch import nn

    block = fp8_block(config)
    experts = set(adapter.module_paths(skeleton)["experts_modules"])
    routers = set(adapter.module_paths(skeleton)["router_modules"])
    linear_names = {f"{m}.weight" for m, mod in skeleton.named_modules()
                    if isinstance(mod, nn.Linear) and m not in routers and not m.endswith("lm_head")}
    total = 0
    for name, p in skeleton.named_parameters():
        in_experts = any(name.startswith(f"{e}.") for e in experts)
        matrix = in_experts and p.dim() == 3  # the fused expert matrices (biases are 2-D: [E, out])
        linear = matrix if fmt == "mxfp4" else (name in linear_names or matrix)
        if fmt == "fp8" and matrix:  # per expert
            total += p.shape[0] * stored_bytes(fmt, tuple(p.shape[1:]), itemsize, True, block)
        else:
            total += stored_bytes(fmt, tuple(p.shape), itemsize, linear, block)
    return total


def _itemsize(config) -> int:
    """Bytes per weight of the checkpoint's dtype as its config states it (bfloat16 when it states none)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.bfloat16
    return torch.empty((), dtype=getattr(torch, dtype) if isinstance(dtype, str) else dtype).element_size()


def check_formats(recipe, config) -> None:
    """Every precision the quantize stage writes can encode this model's experts (a group size divides their input
    dimension), as the run's encoder would refuse."""
    skeleton, adapter = build_skeleton(config), get_adapter(config)
    experts = adapter.experts(skeleton, adapter.moe_layers[0])
    transposed = bool(getattr(experts, "is_transposed", False))
    for precision in recipe.quantize.precisions:
        if precision == "passthrough":
            continue
        group, meta = recipe.quantize.format_of(precision)
        try:
            RecordLayout(tuple(matrix_spec(n, p[0], precision, group, transposed, meta_group=meta)
                               for n, p in experts.named_parameters(recurse=False)))
        except CodecError as e:
            raise MoeprepError(f"quantize at {precision}: {e}; pick a group size that divides it "
                               "(quantize.group_size)") from None


def dry_run(recipe, root: str | Path = ".") -> str:
    """What ``prepare`` would do with ``recipe``, without the weights: the model (from ``model.config``, else
    the config.json of ``model.path``), the stages it would run, the sizes, and how many experts per layer
    the default budget and each operating point's budget would cache at the shipped precision."""

    root = Path(root)
    if recipe.model.config is not None:
        config_dir = (root / recipe.model.config).parent
    else:
        config_dir = Path(recipe.model_path(root))
        if not (config_dir / "config.json").is_file():
            raise MoeprepError(f"no config for a dry run: model {recipe.model.path!r} is not here and the recipe ships "
                               "no model.config")
    config = load_config(config_dir)
    check_context(recipe, config)
    check_formats(recipe, config)
    row = recipe_sizes(recipe, config_dir)
    source = row["source_expert_bytes"]  # what a budget's percentage is a share of (the loader's rule)
    shipped = "bfloat16" if row["shipped"] == "passthrough" else row["shipped"]
    per_expert = row["expert_bytes"][shipped] / (row["num_moe_layers"] * row["num_experts"])
    lines = [f"recipe {recipe.name}: {row['architecture']} from {config_dir / 'config.json'}",
             f"  parameters {_params(row['total_params'])} total, {_params(row['active_params'])} active; "
             f"{row['num_moe_layers']} MoE layers x {row['num_experts']} experts",
             "  stages: " + ", ".join(s.name if s.enabled is None or s.enabled(recipe) else f"({s.name} off)"
                                      for s in STAGES),
             f"  dense {_gb(row['dense_bytes'])} (bfloat16); experts {_gb(source)} at the model's dtype, "
             f"{_gb(row['expert_bytes'][shipped])} "
             f"at {shipped}; memory to prepare (streamed, --expert-memory 0) {_gb(row['prepare_bytes'])}; artifact "
             f"{'<= ' if row['artifact_mixed'] else ''}{_gb(row['artifact_bytes'])}",
             source_line(row),
             f"  executor: {executor_line(recipe.executor)}; work units: {units_line(recipe, row['num_moe_layers'])}"]
    shares = sorted({recipe.package.cache_fraction, *recipe.plan.points})
    for share in shares:
        cached = int(share * source // (per_expert * row["num_moe_layers"]))
        lines.append(f"  budget {share * 100:g}% = dense + {_gb(share * source)} of experts: about "
                     f"{min(cached, row['num_experts'])} of {row['num_experts']} experts per layer cached at {shipped} "
                     "(records; a held compute form takes more, loader/README.md)")
    return "\n".join(lines) + "\n"


FORMAT_WORDS = {"mxfp4": "MXFP4 experts (*_blocks, *_scales), dequantized one MoE layer at a time as read",
                "fp8": "FP8 linear weights with block scales (*_scale_inv), dequantized as read",
                "float": "float weights, read as stored"}


def source_line(row: dict) -> str:
    """``--dry-run``'s source: its format, the bytes one pass of ``prepare`` reads, and for a quantized release what
    the dequantize-first route (a float copy saved first) would cost instead."""
    line = (f"  source: {FORMAT_WORDS[row['source_format']]}; a pass over the checkpoint reads "
            f"{_gb(row['checkpoint_bytes'])}")
    if row["source_format"] == "float":
        return line
    return (line + f" (dequantize-first instead: load the whole model to dequantize it, peak about "
            f"{_gb(row['dequantized_bytes'])}, write a {_gb(row['dequantized_bytes'])} copy, then read "
            f"{_gb(row['dequantized_bytes'])} a pass; streamed here, peak {_gb(row['prepare_bytes'])})")


def units_line(recipe, num_moe_layers: int) -> str:
    """The work units of each enabled stage that splits (``--dry-run``); the others run whole in the driver."""
    counts = []
    for stage in STAGES:
        if stage.units is None or (stage.enabled is not None and not stage.enabled(recipe)):
            continue
        if n := stage.units(recipe, num_moe_layers):
            rounds = stage.units_per_round is not None and stage.units_per_round(recipe)
            counts.append(f"{stage.name} {n}" + (" + one map per search round" if rounds else ""))
    return ", ".join(counts or ["none"]) + " (every other stage runs whole in the driver)"


def executor_line(cfg) -> str:
    """The recipe's executor section in words (``--dry-run``)."""
    if cfg.kind == "local":
        return "local (units run one after another in this process)"
    return (f"ray at {cfg.ray_address} ({cfg.num_cpus_per_task:g} CPU per unit, up to {cfg.max_retries} retries; "
            "the model and the stage cache must be on a path every node sees)")


def real_model_recipes(recipe_paths: list[str | Path]) -> list[str | Path]:
    """The recipes of ``recipe_paths`` that ship their model's config (the real-model ones), in order."""

    real = [p for p in recipe_paths if load_recipe(p).model.config is not None]
    if not real:
        raise MoeprepError("none of these recipes ships a model config (model.config); pass recipes/*.yaml")
    return real


def models_table(recipe_paths: list[str | Path], root: str | Path = ".") -> str:
    """The markdown table of the real-model recipes among ``recipe_paths``, one row each, in the order given."""
    rows = [model_row(p, root) for p in real_model_recipes(recipe_paths)]
    head = ("| recipe | model | total params | active params | experts bf16 | "
            + " | ".join(PRECISIONS[1:]) + " | memory to prepare | artifact |")
    lines = [head, "|" + " --- |" * 2 + " ---: |" * (4 + len(PRECISIONS))]
    for r in rows:
        artifact = _gb(r["artifact_bytes"])
        artifact = f"≤ {artifact} (mixed, from {r['shipped']})" if r["artifact_mixed"] else f"{artifact} ({r['shipped']})"
        lines.append(" | ".join([
            f"| `recipes/{r['recipe']}.yaml`", f"[{r['hub_id']}](https://huggingface.co/{r['hub_id']})",
            _params(r["total_params"]), _params(r["active_params"]),
            *(_gb(r["expert_bytes"][p]) for p in PRECISIONS), _gb(r["prepare_bytes"]), artifact]) + " |")
    return "\n".join(lines) + "\n"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} days"


def eval_time_table(recipe_paths: list[str | Path], data: str | Path, root: str | Path = ".") -> str:
    """The markdown table of ``moeprep eval``'s wall-time floor per suite, model and device
    (``prep/evals/workload.py``), on every item of the benchmark files in ``data``."""

    work = suite_workloads(load_benchmarks(data))
    suites = list(work)
    lines = ["| recipe | device | " + " | ".join(f"{s} ({work[s]['items']} items)" for s in suites) + " |",
             "| --- | --- |" + " ---: |" * len(suites)]
    for path in real_model_recipes(recipe_paths):
        row = model_row(path, root)
        for device in DEVICES:
            cells = [_duration(suite_seconds(work[s], row["active_params"], device)) for s in suites]
            lines.append(f"| `{row['recipe']}` | {device.name} | " + " | ".join(cells) + " |")
    tokens = ", ".join(f"{s} {work[s]['row_tokens'] / 1e6:.1f}M tokens"
                       + (f" + {work[s]['decode_steps'] / 1e3:.0f}k decode steps" if work[s]["decode_steps"] else "")
                       for s in suites)
    sources = "; ".join(f"{d.name}: {d.source}" for d in DEVICES)
    return "\n".join(lines) + f"\n\nPer model: {tokens}. Devices: {sources}.\n"
