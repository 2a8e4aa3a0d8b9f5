"""Stage ``package``: assemble the artifact directory the loader opens (format: ``loader/format.py``).

Reads the quantize stage (every expert at every precision) and the bitwidth stage (which precision each
expert ships at): each precision's store holds the records of exactly the experts planned at it. With the
predict stage on, the plan names its predictors and ``predictors.safetensors`` holds what they read.
Needs the model (dense weights, config, tokenizer, module paths), the
recipe (recorded in the manifest) and the artifact output. The files are written into a fresh
directory beside ``--output`` (``prep.store.ArtifactOutput.build``), ``manifest.json`` last, and the
finished directory is swapped in with one rename. The manifest records this stage's key
(``package_key``): a later run reuses the artifact only when that key matches and every listed file
has its recorded size; otherwise it builds it again. Every file is a pure function of the key's inputs
(no timestamps, no timings), so a rebuild is byte-identical.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as save_numpy
from safetensors.torch import save_file

from loader.codec import RecordLayout
from loader.device import DEVICE_FILE, load_profile
from loader.format import FORMAT, SCHEMA_VERSION, block_file, sha256_file, write_manifest
from loader.hashing import bound_rows
from loader.io import write_bytes_atomic, write_json_atomic
from loader.plan import PLAN_FILE
from loader.predict import PREDICTORS_FILE
from loader.simulate import ROUTING_SAMPLE
from loader.tuning import profile_choice
from loader.vocab import BITS, DENSE_FORMS
from prep import __version__
from prep.adapters.model_state import dense_state, expert_parameters
from prep.errors import MoeprepError
from prep.methods.trace import open_trace
from prep.quant.records import write_aligned_records
from prep.report import ReportLayout, report_files
from prep.stages import EARLIER_CONTRIBUTIONS, Stage, StageResult, report_entries
from prep.stages.bitwidth import BitwidthChoice, uniform_choice
from prep.stages.operating_points import PLAN_PLOT, operating_points_plot
from prep.stages.planning import PlanContext, compose_plan, model_sizes, shipped_layout
from prep.stages.predict import predictor_tensors
from prep.stages.quantize import PackedExperts
from prep.stages.trace import RoutingTraces

VERSION = 15  # 9: a neuron store carries its per-block hashes; 10: xxh3_64 per record, int4 in the kernel layout;
# 11: the routing sample and the device profile the plan was tuned with (``moeload plan`` predicts with them);
# 12: the plan without the techniques `moeload tune` switched off in that profile, and report.json's technique_choice;
# 13: a CPU target ships int4 in the codec's layout (the compiled kernels read it), int4pack only for cpu-int4pack;
# 14: the plan's ``dense`` (``package.dense``); 15: a neuron store's block table binds each row to its record's
# xxh3_64 (``bound``)
TARGETS = ("cpu", "cuda", "cpu-int4pack")
REPORT = "report.json"
REPORTED_DETAILS = ("loss", "metric", "sequences", "b_hi", "b_lo", "K", "met", "bounds", "trail", "sensitivity")  # the rest: the stage result


@dataclass(frozen=True)
class PackageSection:
    """Plan defaults written into the artifact: the share of each layer's experts to cache. ``targets``: the
    devices the artifact is for. ``cpu`` and ``cuda`` ship every store in the codec's own layout, which the compiled
    kernels (``loader/kernels``) compute from in place on any x86 CPU, so a miss read from disk lands ready to
    compute with nothing made. ``cpu-int4pack`` writes int4 stores in the layout of torch's CPU int4 kernel
    (``loader/codec.py``, ``int4pack``) instead: read in place only by torch builds that pack int4 as the AVX-512
    kernel does, decoded elsewhere, and 6% larger than the codec's own with 8-bit scales (the plan sizes them as the
    codec's). ``dense``: the held form of the dense weights the plan asks the loader for (``loader/dense.py``):
    "int8" (attention, shared experts and the LM head computed by the compiled kernels from int8 codes), "float" (as
    stored), or "auto": int8 when the artifact ships experts we quantized (int8/int4/int3/int2), float when every
    expert is kept as released or as the source holds it (a lossless artifact stays lossless)."""

    cache_fraction: float = 0.5
    targets: tuple[str, ...] = ("cpu",)
    dense: str = "auto"

    def __post_init__(self) -> None:
        if not 0 < self.cache_fraction <= 1:
            raise MoeprepError("package.cache_fraction must be in (0, 1]")
        if not isinstance(self.targets, tuple | list) or not self.targets \
                or any(t not in TARGETS for t in self.targets):
            raise MoeprepError(f"package.targets must be a non-empty list of {list(TARGETS)}, got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(self.targets))
        if self.dense not in ("auto", *DENSE_FORMS):
            raise MoeprepError(f"package.dense must be one of {['auto', *DENSE_FORMS]}, got {self.dense!r}")

    def dense_form(self, precisions) -> str:
        """The plan's ``dense`` for an artifact shipping experts at ``precisions``."""
        if self.dense != "auto":
            return self.dense
        return "int8" if any(p in BITS for p in precisions) else "float"

    def kernel_layout(self, layout: RecordLayout) -> RecordLayout | None:
        """The layout a store of ``layout`` is written in for these targets, where it differs (None: as it is)."""
        shipped = shipped_layout(layout, "cpu-int4pack") if "cpu-int4pack" in self.targets else layout
        return shipped if shipped != layout else None


@dataclass(frozen=True)
class ArtifactReport(StageResult):
    """What the artifact holds and how much smaller it is, then the entries of the stages it derives from (each
    result's ``report``, in the table's order); also written, flat, as the artifact's report.json."""

    architecture: str
    sizes: dict
    compression: dict  # expert bytes of the source dtype and of bfloat16 over the shipped expert bytes
    record_bytes: dict  # precision -> bytes of one record
    bits_per_weight: dict  # precision -> stored bits per weight, metadata included
    bitwidth: dict  # the bitwidth stage's method, knobs, expert counts and measured loss
    contributed: dict = field(default_factory=dict)  # report.json entry -> value, from the stages read

    def to_json(self) -> dict:
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "contributed"}
        return own | self.contributed

    @classmethod
    def from_json(cls, raw: dict) -> ArtifactReport:
        own = {f.name for f in dataclasses.fields(cls)} - {"contributed"}
        return cls(**{k: raw[k] for k in own}, contributed={k: v for k, v in raw.items() if k not in own})


def _producer() -> dict:
    from importlib.metadata import version

    import transformers


    # hqq sets no __version__; the installed distribution's metadata knows it
    return {"moeprep": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "hqq": version("hqq")}


def package_artifact(model, adapter, tokenizer, recipe: dict, source: dict, quantize_dir: Path,
                     quantize: PackedExperts, choice: BitwidthChoice, cfg: PackageSection, package_key: str,
                     out: Path, techniques: dict | None = None, contributions: list | None = None,
                     trace_dir: Path | None = None, device_profile: dict | None = None, contributed: dict | None = None,
                     report_layout: ReportLayout | None = None) -> ArtifactReport:
    """Write every artifact file into the empty directory ``out``, ``manifest.json`` last; returns the report.

    ``recipe`` is the resolved recipe the artifact derives from, ``source`` the source model's
    {path, revision, fingerprint}, ``package_key`` this stage's cache key. ``techniques``: the results of the
    stages the recipe switched on whose files the artifact carries: ``predict`` ((stage dir, PredictionStats)),
    ``neuron`` ((stage dir, NeuronChoice)), ``dynamic_precision`` (PrecisionThresholds). ``contributions``: the results
    the plan is composed of, in the stage table's order (``StageInputs.contributions``). ``trace_dir``: the trace stage's routing, whose
    first tokens the artifact carries (``routing_sample``); ``device_profile``: the profile the plan was tuned with
    (its JSON), carried as ``device.json``: ``moeload plan`` predicts speed from both without ``prep``.
    ``contributed``: report.json's entries from the stages read (``prep.stages.report_entries``); ``report_layout``:
    the sections report.md renders them in (``prep.stages.table.REPORT``; None: report.md holds the header only).
    """
    techniques = techniques or {}
    prediction, dynamic = techniques.get("predict"), techniques.get("dynamic_precision")
    neuron = techniques.get("neuron")  # (stage dir, NeuronChoice): its neuron-layout records replace quantize's
    if neuron is not None:
        quantize_dir, quantize = neuron[0], neuron[1].packed_experts()
    out = Path(out)
    paths = adapter.module_paths(model)
    expert_params, experts = expert_parameters(model, adapter)
    model.config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_file(dense_state(model, expert_params), str(out / "dense.safetensors"), metadata={"format": "pt"})

    grid = choice.expert_precision
    position = {layer: pos for pos, layer in enumerate(quantize.layers)}
    planned = [p for p in quantize.stores if choice.counts.get(p)]
    low = dynamic.knobs["low"] if dynamic is not None else None
    used = [p for p in quantize.stores if p in planned or p == low]
    stores, hashes = {}, {}
    for precision in used:
        store = quantize.stores[precision]
        # a store holds the experts planned at it; the low copies of dynamic precision are every expert
        keep = (lambda p: (lambda layer, e: True) if p == low else lambda layer, e: grid[position[layer]][e] == p)(precision)
        records = quantize.records(quantize_dir, precision, keep)
        layout = RecordLayout.from_json(store["layout"])
        kernel = cfg.kernel_layout(layout) if neuron is None else None
        stores[precision] = store | {"file": f"experts-{precision}.safetensors"}
        if kernel is not None:
            stores[precision] |= {"layout": kernel.to_json(), "record_bytes": kernel.nbytes}
            records = _InLayout(records, layout, kernel)
        blocks = [] if neuron is not None else None  # a neuron store is read in part: a hash per 4 KiB block
        hashes[precision] = write_aligned_records(out / stores[precision]["file"], records,
                                                  stores[precision]["record_bytes"], blocks)
        if blocks is not None:
            stores[precision]["blocks"] = block_file(precision)
            table = np.asarray(blocks, dtype=np.uint64).reshape(len(blocks), -1)
            bound = bound_rows(table, list(hashes[precision].values()))  # each row bound to its record's hash
            save_numpy({"blocks": table, "bound": np.asarray(bound, dtype=np.uint64)}, str(out / block_file(precision)))

    budget = f"{cfg.cache_fraction * 100:g}%"
    if prediction is not None:
        stage_dir, stats = prediction
        wanted = stats.knobs.get("next_gates", {}).get("precision")
        if wanted is not None and wanted not in used:
            raise MoeprepError(f"predict.next_gates.precision is {wanted}, but the artifact ships no {wanted} store "
                               f"(its experts are at {used}); set it to null or to one of those")
    shipped = {p: s["record_bytes"] for p, s in quantize.stores.items()} | {p: stores[p]["record_bytes"] for p in used}
    sizes = model_sizes(model, adapter, shipped)
    plan = compose_plan(grid, {p: shipped[p] for p in planned}, budget, contributions or [],
                        PlanContext(sizes, adapter.routing_weights()))
    plan = dataclasses.replace(plan, dense=cfg.dense_form(used))
    # the techniques `moeload tune` measured on the profile's device: those that lost there are left out
    plan, choice_of_techniques = profile_choice(plan, device_profile)
    if prediction is not None:
        save_file(predictor_tensors(stage_dir, stats.predictors), str(out / PREDICTORS_FILE), metadata={"format": "pt"})
    write_json_atomic(out / PLAN_FILE, plan.to_json())
    if trace_dir is not None:
        write_routing_sample(trace_dir, out / ROUTING_SAMPLE, with_inputs=bool(plan.predictors))
    if device_profile is not None:
        write_json_atomic(out / DEVICE_FILE, device_profile)

    source_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters(recurse=False))
    weights = sum(p.numel() for m in experts for p in m.parameters(recurse=False))
    expert_bytes = {p: len(hashes[p]) * shipped[p] for p in used}
    total = sum(expert_bytes.values())
    report = ArtifactReport(
        architecture=adapter.architecture,
        sizes={"dense_bytes": (out / "dense.safetensors").stat().st_size, "expert_bytes": total,
               "expert_bytes_by_precision": expert_bytes, "experts_source_bytes": source_bytes,
               "store_file_bytes": {p: (out / stores[p]["file"]).stat().st_size for p in used}},
        compression={"source": round(source_bytes / total, 3), "bfloat16": round(2 * weights / total, 3)},
        record_bytes={p: shipped[p] for p in used},
        bits_per_weight={p: round(RecordLayout.from_json(stores[p]["layout"]).bits_per_weight, 4) for p in used},
        bitwidth={"method": choice.method, **choice.knobs, "experts": choice.counts,
                  **{k: v for k, v in choice.details.items() if k in REPORTED_DETAILS}},
        contributed=(contributed or {}) | {"technique_choice": choice_of_techniques},
    )
    reported = report.to_json()
    name = recipe.get("name", "artifact")
    for file, content in report_files(name, reported, report_layout or ReportLayout(())).items():
        write_bytes_atomic(out / file, content)
    if reported.get("operating_points"):
        (out / PLAN_PLOT).parent.mkdir(exist_ok=True)
        write_bytes_atomic(out / PLAN_PLOT, operating_points_plot(reported))

    for path in out.rglob("*"):  # safetensors writes 0600; every file of an artifact is readable alike
        if path.is_file():
            path.chmod(0o644)
    files = {p.relative_to(out).as_posix(): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(out.rglob("*")) if p.is_file()}
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
            "routing_weights": adapter.routing_weights(),
            "source_expert_bytes": source_bytes,
        },
        "stores": {p: {"file": stores[p]["file"], "record_bytes": stores[p]["record_bytes"],
                       "layout": stores[p]["layout"], "xxh3": hashes[p]}
                   | ({"neuron": {"pairing": neuron[1].pairing}, "blocks": stores[p]["blocks"]} if neuron is not None
                      else {}) for p in used},
        "plan_summary": {"precision": quantize.precision if len(planned) == 1 else "mixed",
                         "experts": choice.counts, "default_budget": budget, "eviction": plan.eviction.name},
        "files": files,
    }
    write_manifest(out, manifest)  # last (sealed with its digest): marks completeness
    return report


SAMPLE_TOKENS = 1024  # routing the artifact carries: the first sequences of the trace up to this many tokens
SAMPLE_INPUT_BYTES = 32 << 20  # router inputs ride along (for the predictors) only up to this size, in float16


def write_routing_sample(trace_dir: Path, path: Path, with_inputs: bool) -> None:
    """The trace's first whole sequences, up to ``SAMPLE_TOKENS`` tokens (at least one sequence), as the loader's cost
    model reads them (``loader.simulate.read_routing_sample``): expert ids and weights [T, L, K], router logits
    [T, L, E] and the sequences' lengths; with ``with_inputs``, the routers' inputs [T, L, H] and the LM head's
    inputs [T, H] in float16 where they fit ``SAMPLE_INPUT_BYTES`` (else the predictors go unmodelled)."""
    trace = open_trace(RoutingTraces.path(trace_dir))
    lengths, total = [], 0
    for n in trace.sequence_tokens:
        if lengths and total + n > SAMPLE_TOKENS:
            break
        lengths.append(n)
        total += n
    routing = trace.routing()[:len(lengths)]
    tensors = {"expert_ids": torch.cat([r.expert_ids for r in routing]).to(torch.int32).contiguous(),
               "weights": torch.cat([r.expert_weights for r in routing]).float().contiguous(),
               "sequence_lengths": torch.tensor(lengths, dtype=torch.int64)}
    names = trace.index["tensors"]
    first = trace.layers[0]
    if f"layers.{first}.router_logits" in names:
        tensors["logits"] = torch.stack([trace.router_logits(layer)[:total] for layer in trace.layers], 1).half()
    if with_inputs and f"layers.{first}.router_input" in names:
        width = trace.router_inputs(first).shape[-1]
        if total * (len(trace.layers) + 1) * width * 2 <= SAMPLE_INPUT_BYTES:
            tensors["router_inputs"] = torch.stack([trace.router_inputs(layer)[:total] for layer in trace.layers],
                                                   1).half()
            if "head_input" in names:
                tensors["head_inputs"] = trace.tensor("head_input")[:total].half()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


class _InLayout:
    """Records read from the quantize stage, each converted into the store's kernel layout as it is written."""

    def __init__(self, records, layout: RecordLayout, kernel: RecordLayout) -> None:
        self.records, self.layout, self.kernel = records, layout, kernel

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self):
        return iter(self.records)

    def items(self):
        for key, record in self.records.items():
            converted = self.layout.to_kernel(self.kernel, torch.frombuffer(bytearray(record), dtype=torch.uint8))
            yield key, converted.numpy().tobytes()


def _run(inputs) -> ArtifactReport:
    quantize_dir, quantize = inputs.upstream("quantize")
    chosen = inputs.upstream("bitwidth", optional=True)
    choice = chosen[1] if chosen is not None else uniform_choice(quantize)
    dynamic = inputs.upstream("dynamic_precision", optional=True)
    techniques = {"predict": inputs.upstream("predict", optional=True),
                  "neuron": inputs.upstream("neuron", optional=True),
                  "dynamic_precision": dynamic[1] if dynamic is not None else None}
    traced = inputs.upstream("trace", optional=True)
    device = (inputs.recipe.get("plan") or {}).get("device")
    profile = load_profile(Path(inputs.root) / device).to_json() if device else None
    with inputs.artifact.build() as out:
        return package_artifact(inputs.model, inputs.adapter, inputs.tokenizer, inputs.recipe, inputs.source,
                                quantize_dir, quantize, choice, inputs.config, inputs.key, out, techniques,
                                inputs.contributions(), traced[0] if traced is not None else None, profile,
                                report_entries(inputs.read_results()), inputs.report_layout)


STAGE = Stage(
    name="package", version=VERSION, config=PackageSection, result=ArtifactReport,
    reads=("quantize", "bitwidth", "trace", EARLIER_CONTRIBUTIONS), needs=frozenset({"model", "recipe", "artifact"}),
    files=lambda recipe: [recipe.plan.device] if recipe.plan.device else [],
    run=_run,
    output_ok=lambda inputs, result: inputs.artifact.matches(inputs.key),
    section="package",
)
