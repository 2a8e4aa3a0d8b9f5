"""The artifact schema (schema_version 5): what a prepared-model directory holds, and its manifest, checked.

This module is the one owner of the format; ``prep`` imports it to write artifacts. An artifact is a
directory of JSON and safetensors files only (``loader/README.md`` has the full spec):

- ``manifest.json`` (written last: a directory with a manifest is complete): format name, integer
  schema version, producer versions, source model, resolved recipe, the package stage's key, the MoE
  geometry and module paths (``MoeSection``), the expert stores (record layout and an xxh3_64 per record),
  a plan summary, and every other file with its size and sha256;
- ``config.json`` + tokenizer files of the source model; ``dense.safetensors`` (all non-expert weights);
- ``experts-<precision>.safetensors``: one uint8 tensor ``layers.{l}.experts.{e}`` per expert, each a
  packed record (``loader/codec.py``) starting on a 4 KiB boundary of the file;
- ``plan.json`` (``loader/plan.py``) and ``report.json``.

Trust, in three layers, each raising ``ArtifactError`` (a ``MoeError``) that names the file and what to do:

- ``read_manifest`` (here): the manifest alone, strictly typed (``true`` is not an int), every file name
  mapped through ``artifact_file``, which refuses absolute paths, ``..`` and anything that resolves
  (symlinks included) outside the artifact directory. The directory is resolved once, so an artifact
  that is a symlink to a versioned directory (how ``prepare`` swaps artifacts atomically) is read from
  one version even if the link moves meanwhile.
- ``open_artifact`` (``loader/artifact.py``, every load): the files the manifest lists, their sizes and hashes
  but the stores', their headers, config.json and plan.json against the manifest; then ``check_model``
  (``loader/binding.py``) against the model skeleton, and ``check_record`` (``loader/hashing.py``) on each
  record as it is read.
- ``verify`` (``loader/verify.py``): all of that plus every sha256 and every record's xxh3_64.

The hashes themselves are ``loader/hashing.py``'s; ``sha256_file`` and ``block_hashes`` are re-exported here,
with the stores' ``read_record_offsets``, for the writers in ``prep``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path, PurePosixPath

from loader.codec import KERNELS, PAIRINGS, CodecError, NeuronLayout, RecordLayout
from loader.errors import PREPARE_AGAIN as _PREPARE_AGAIN
from loader.errors import ArtifactError
from loader.hashing import BLOCK, block_hashes, sha256_file  # noqa: F401 (re-exported: prep writes these hashes)
from loader.io import parse_json, read_record_offsets, write_json_atomic  # noqa: F401 (read_record_offsets: re-exported)
from loader.plan import PLAN_FILE, Plan
from loader.vocab import DTYPES, PRECISIONS, weights_spec_problem

FORMAT = "moeprep-artifact"
SCHEMA_VERSION = 5  # 3: neuron-layout stores; 4: their per-block hashes; 5: xxh3_64 per record, kernel layouts
READABLE_SCHEMAS = (5,)  # an older artifact has crc32 checks: prepare it again
ALIGN = BLOCK  # records start on a 4 KiB boundary, so a partial read covers whole hashed blocks
MANIFEST = "manifest.json"
DIGEST = "digest"  # the manifest's own sha256 (``manifest_digest``): the manifest protects itself too
DIGEST_REQUIRED = True  # every writer seals the manifest through write_manifest
CONFIG = "config.json"
DENSE = "dense.safetensors"
REPORT = "report.json"
TUNING_FILE = "tuning.json"  # ``moeload tune``'s decisions (``loader/tuning.py``)
DEVICE_FILE = "device.json"  # the profile the plan was made for: read only by ``loader.device.read_artifact_profile``
REPORTS_DIR = "reports/"  # plots and study files: informational, whatever their names
INFORMATIONAL_FILES = (REPORT, "report.md")  # rewritten after packaging, with everything under REPORTS_DIR
REQUIRED_FILES = (CONFIG, DENSE, PLAN_FILE)
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_MANIFEST_BYTES = 64 << 20


def expert_key(layer: int, expert: int) -> str:
    return f"layers.{layer}.experts.{expert}"


def block_file(precision: str) -> str:
    """The file of a neuron store's per-block hashes: uint64 [records, blocks], records in store order."""
    return f"experts-{precision}.blocks.safetensors"


def is_int(x) -> bool:
    """An int that is not a bool (JSON's ``true`` is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


def _is_hex64(x) -> bool:
    return isinstance(x, str) and re.fullmatch("[0-9a-f]{64}", x) is not None


# ------------------------------------------------------------------------------------------- paths


def resolve_artifact(artifact: str | Path) -> Path:
    """The artifact directory, resolved once (symlinks followed): every later read goes through it."""
    try:
        root = Path(artifact).resolve(strict=True)
    except (OSError, RuntimeError):
        raise ArtifactError(f"artifact directory {artifact} does not exist; run `moeprep prepare` to make one") from None
    if not root.is_dir():
        raise ArtifactError(f"{artifact} is not a directory; pass the artifact directory (the one holding {MANIFEST})")
    return root


def is_informational(name: str) -> bool:
    """A file the report rewrites after packaging (checked by ``verify`` only, never needed to load)."""
    return name in INFORMATIONAL_FILES or name.startswith(REPORTS_DIR)


def artifact_file(root: Path, name) -> Path:
    """The path of the artifact file ``name`` (as the manifest spells it) inside the resolved ``root``.

    Refuses anything but a plain relative path that stays inside the artifact: absolute paths, ``..``,
    ``.`` or empty components, backslashes, and names whose target (symlinks followed) leaves ``root``.
    """
    def refuse(why: str) -> ArtifactError:
        return ArtifactError(f"{root / MANIFEST} lists the file {name!r}, which {why}; a manifest may only name "
                             f"files inside the artifact. The manifest was edited or damaged: {_PREPARE_AGAIN}",
                             file=MANIFEST)

    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise refuse("is not a plain file name")
    pure = PurePosixPath(name)
    if pure.is_absolute():
        raise refuse("is an absolute path")
    if pure.as_posix() != name or any(part in ("..", ".") for part in pure.parts):
        raise refuse("is not a normalized relative path")
    try:
        target = (root / name).resolve()
    except (OSError, RuntimeError):
        raise refuse("cannot be resolved (a symlink loop?)") from None
    if target == root or not target.is_relative_to(root):
        raise refuse(f"resolves to {target}, outside the artifact directory")
    return target


def read_json(path: Path, name: str, fix: str = _PREPARE_AGAIN, limit: int | None = None):
    """Parse a JSON file of the artifact; any failure is an ArtifactError naming the file."""
    try:
        if path.exists() and not path.is_file():  # a FIFO or a device would block the read or never end
            raise ArtifactError(f"{path} is not a regular file; {fix}", file=name)
        if limit is not None and path.stat().st_size > limit:
            raise ArtifactError(f"{path} is {path.stat().st_size:,} bytes, more than any {name} can be; {fix}",
                                file=name)
        text = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing; {fix}", file=name) from None
    except OSError as e:
        raise ArtifactError(f"cannot read {path} ({e.strerror or e}); {fix}", file=name) from None
    try:
        return parse_json(text)
    except ValueError as e:  # JSONDecodeError is a ValueError; so is parse_json's nesting bound
        raise ArtifactError(f"{path} is not valid JSON ({str(e)[:120]}); {fix}", file=name) from None


# ------------------------------------------------------------------------------------------ sealed files


def file_problem(manifest: Manifest, name: str, hash_it: bool) -> str | None:
    """What is wrong with the listed file ``name`` (None when it matches its manifest entry)."""
    entry = manifest.files[name]
    path = manifest.path(name)
    try:
        if not path.is_file():
            return "missing" if not path.exists() else "not a regular file"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{size} bytes, the manifest says {entry['bytes']} (truncated or replaced)"
        if hash_it and sha256_file(path) != entry["sha256"]:
            return "sha256 mismatch (content changed)"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    return None


def damaged(manifest: Manifest, problems: list[tuple[str, str]]) -> ArtifactError:
    """The one message for listed files that do not match the manifest (``problems``: (name, ``file_problem``)):
    ``load`` and every reader of a sealed file (``sealed_file``) say it alike, and ``verify`` prints its
    ``name: problem`` parts."""
    fix = (f"{_PREPARE_AGAIN[0].upper()}{_PREPARE_AGAIN[1:]}" if any(n != TUNING_FILE for n, _ in problems)
           else f"Run `moeload tune` again to write {TUNING_FILE} anew, or copy the artifact again")
    return ArtifactError(f"artifact {manifest.root} is damaged: "
                         + "; ".join(f"{name}: {p}" for name, p in problems) + f". {fix}", file=problems[0][0])


def sealed_file(manifest: Manifest, name: str) -> Path:
    """The path of the listed file ``name`` once its size and sha256 match the manifest; else ``damaged``'s error.
    What ``moeload plan`` and the other readers of an artifact's device profile, routing sample and report call
    before they trust a byte of it."""
    if problem := file_problem(manifest, name, hash_it=True):
        raise damaged(manifest, [(name, problem)])
    return manifest.path(name)


# ------------------------------------------------------------------------------------------ report


def _figure(x, finite: bool = True) -> bool:
    """A number (``finite``: not NaN or infinite), or null."""
    if x is None:
        return True
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return not finite or math.isfinite(x)
    except OverflowError:  # an integer past float's range
        return False


def _point_problem(i: int, p) -> str | None:
    where = f"operating_points[{i}]"
    if not isinstance(p, dict):
        return f"{where} is not an object"
    if not (is_int(p.get("budget_bytes")) and p["budget_bytes"] > 0):
        return f"{where}.budget_bytes must be a whole number of bytes above 0, got {json.dumps(p.get('budget_bytes'))[:40]}"
    for key in ("modeled_tokens_per_s", "miss_rate", "share", "cost"):
        if not _figure(p.get(key)):
            return f"{where}.{key} must be a finite number or null, got {json.dumps(p.get(key))[:40]}"
    for key in ("accuracy_delta", "accuracy_test", "modeled_prefill"):
        if not isinstance(p.get(key) or {}, dict):
            return f"{where}.{key} must be an object or null"
    if not all(isinstance(k, str) and _figure(v) for k, v in (p.get("accuracy_delta") or {}).items()):
        return f"{where}.accuracy_delta must be {{suite: a finite number}}"
    return None


def _divergence_problem(entry) -> str | None:
    """The divergence entry as report.md renders it: its counts whole numbers, every figure a number (NaN stays
    allowed: a measured NaN is the finding) with its interval, each operating point's the same."""
    if not isinstance(entry, dict) or not isinstance(entry.get("held_out"), dict):
        return "divergence must be an object with held_out {source, sequence_length}"
    if not (is_int(entry["held_out"].get("sequence_length")) and is_int(entry.get("sequences"))
            and is_int(entry.get("tokens")) and is_int(entry.get("resamples")) and _figure(entry.get("level"))
            and entry.get("level") is not None):
        return "divergence.held_out.sequence_length, sequences, tokens and resamples must be whole numbers, level a number"

    def stats_ok(stats) -> bool:
        return isinstance(stats, dict) and all(
            isinstance(s, dict) and all(_figure(s.get(k), finite=False) and s.get(k) is not None
                                        for k in ("value", "low", "high")) for s in stats.values())

    if not stats_ok(entry.get("stats")):
        return "divergence.stats must be {figure: {value, low, high}} numbers"
    points = entry.get("points") or []
    if not (isinstance(points, list) and all(isinstance(p, dict) and isinstance(p.get("summary"), dict)
                                             and stats_ok(p["summary"].get("stats")) for p in points)):
        return "divergence.points must be a list of {budget_bytes, summary: {stats}}"
    return None


def report_problem(report) -> str | None:
    """What is wrong with report.json's value (None: nothing) in what the commands read of it: an object; its
    ``operating_points`` a list of points (``budget_bytes`` whole and positive, the modelled figures finite numbers or
    null); its ``divergence`` entry as report.md renders it. The one check ``moeload info`` and ``plan``
    (``loader.artifact.read_report``) and ``moeprep eval`` and ``accuracy`` (``prep.report.current_report``) run."""
    if not isinstance(report, dict):
        return "must hold a JSON object"
    points = report.get("operating_points")
    if points is not None:
        if not isinstance(points, list):
            return "operating_points must be a list"
        for i, p in enumerate(points):
            if problem := _point_problem(i, p):
                return problem
    if report.get("divergence") is not None:
        return _divergence_problem(report["divergence"])
    return None


# ---------------------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class StoreInfo:
    """One expert store: its file, the precision of its records, their shared layout and checksums."""

    precision: str
    file: str
    record_bytes: int
    layout: list  # RecordLayout.to_json()
    xxh3: dict  # expert key -> xxh3_64 of the record's record_bytes
    neuron: dict | None = None  # neuron layout: {"pairing": "halves" | "interleaved"} (codec.NeuronLayout)
    blocks: str | None = None  # a neuron store's per-block hash file (``block_file``): it is read in part

    @property
    def block_count(self) -> int:
        """4 KiB blocks of one record (the last one may be short)."""
        return -(-self.record_bytes // BLOCK)

    @property
    def stride(self) -> int:
        """Bytes from one record to the next in the file (record_bytes rounded up to 4 KiB)."""
        return -(-self.record_bytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class MoeSection:
    """The manifest's ``moe`` section, typed: the MoE geometry and where its modules sit in the model. Built by
    ``read_manifest`` once its keys are checked (``_check_moe``); ``to_json`` gives the section back as written.
    Layer lists follow the legend of ``loader/__init__.py``: one entry per MoE layer, in model order."""

    architecture: str  # config.json's model_type
    layers: tuple[int, ...]  # the model's layer index of each MoE layer, increasing
    num_experts: int  # E
    top_k: int  # K
    dtype: str  # the source weights' dtype (``loader.vocab.DTYPES``)
    experts_modules: tuple[str, ...]  # per MoE layer: the experts module's path
    router_modules: tuple[str, ...]  # per MoE layer: the router module's path
    last_decoder_layer: str  # the last decoder layer's path (the LM head reads its output)
    expert_params: tuple[str, ...]  # every experts-module parameter the stores hold (absent from dense.safetensors)
    source_expert_bytes: int  # the experts' bytes in the source model, at ``dtype``
    routing_weights: dict | None = None  # the router's weight function (``loader.vocab.weights_spec_problem``)

    @classmethod
    def from_json(cls, raw: dict) -> MoeSection:
        """The section of a manifest whose ``moe`` keys were checked (``_check_moe``)."""
        return cls(raw["architecture"], tuple(raw["layers"]), raw["num_experts"], raw["top_k"], raw["dtype"],
                   tuple(raw["experts_modules"]), tuple(raw["router_modules"]), raw["last_decoder_layer"],
                   tuple(raw["expert_params"]), raw["source_expert_bytes"], raw.get("routing_weights"))

    def to_json(self) -> dict:
        """The section as the manifest holds it (``routing_weights`` only where it was written)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
        return out if self.routing_weights is not None else {k: v for k, v in out.items() if k != "routing_weights"}


@dataclass(frozen=True)
class Manifest:
    """The parsed, validated ``manifest.json`` of the artifact directory ``root`` (resolved once).

    ``moe`` is the typed MoE section; ``plan`` is set by ``open_artifact`` (the checked ``plan.json``),
    ``read_manifest`` leaves it None.
    """

    raw: dict
    root: Path
    moe: MoeSection
    plan: Plan | None = None

    @property
    def files(self) -> dict[str, dict]:
        return self.raw["files"]

    @cached_property
    def stores(self) -> dict[str, StoreInfo]:
        return {p: StoreInfo(p, s["file"], s["record_bytes"], s["layout"], s["xxh3"], s.get("neuron"),
                             s.get("blocks"))
                for p, s in self.raw["stores"].items()}

    def path(self, name: str) -> Path:
        """The checked path of the artifact file ``name`` (see ``artifact_file``)."""
        return artifact_file(self.root, name)

    def expert_keys(self) -> list[str]:
        """Every record key, in store order: MoE layers in manifest order, then experts."""
        return [expert_key(layer, e) for layer in self.moe.layers for e in range(self.moe.num_experts)]

    def store_keys(self, precision: str) -> list[str]:
        """The record keys of one store, in store order (a store may hold only the experts planned at it)."""
        held = self.stores[precision].xxh3
        return [key for key in self.expert_keys() if key in held]


class _Checker:
    """Typed access to the manifest's keys; every failure names the key and what to do."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, what: str) -> ArtifactError:
        return ArtifactError(f"{self.path}: {what}. The manifest is damaged or was edited: {_PREPARE_AGAIN}",
                             file=MANIFEST)

    def get(self, obj: dict, key: str, where: str, kind: str):
        if key not in obj:
            raise self.fail(f"the key {where}{key} is missing")
        value = obj[key]
        ok = {"str": lambda v: isinstance(v, str) and v != "",
              "int": is_int,
              "dict": lambda v: isinstance(v, dict),
              "list": lambda v: isinstance(v, list),
              "hex64": _is_hex64,
              "str|null": lambda v: v is None or isinstance(v, str)}[kind](value)
        if not ok:
            raise self.fail(f"{where}{key} must be {kind}, got {json.dumps(value)[:80]}")
        return value

    def only(self, obj: dict, keys: set, where: str) -> None:
        if unknown := sorted(set(obj) - keys):
            raise self.fail(f"{where or 'the manifest'} has unknown keys {unknown}")

    def strings(self, obj: dict, key: str, where: str, length: int | None = None) -> list[str]:
        value = self.get(obj, key, where, "list")
        if not all(isinstance(v, str) and v for v in value) or (length is not None and len(value) != length):
            raise self.fail(f"{where}{key} must be a list of {length if length is not None else 'any number of'} "
                            "non-empty strings")
        return value


_TOP_KEYS = {"format", "schema_version", "producer", "source_model", "recipe", "package_key", "moe", "stores",
             "plan_summary", "files", "digest"}
_MOE_KEYS = {"architecture", "layers", "num_experts", "top_k", "dtype", "experts_modules", "router_modules",
             "last_decoder_layer", "expert_params", "source_expert_bytes", "routing_weights"}  # routing_weights: optional (older manifests lack it)
_STORE_KEYS = {"file", "record_bytes", "layout", "xxh3", "neuron", "blocks"}


def _validate(raw, root: Path) -> MoeSection:
    """Every key of a manifest, typed strictly and cross-checked within the manifest; its typed MoE section."""
    c = _Checker(root / MANIFEST)
    version = _check_version(c, raw, root)
    c.only(raw, _TOP_KEYS, "")
    _check_provenance(c, raw)
    moe = _check_moe(c, c.get(raw, "moe", "", "dict"))
    stores = c.get(raw, "stores", "", "dict")
    if not stores:
        raise c.fail("stores is empty: an artifact needs at least one expert store")
    for precision, store in stores.items():
        _check_store(c, precision, store, moe, version)
    _check_files(c, raw, root)
    return moe


def _check_version(c: _Checker, raw, root: Path) -> int:
    """The manifest is this format's, at a schema version this loader reads; that version."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{root / MANIFEST} is not a {FORMAT} manifest; pass an artifact made by "
                            "`moeprep prepare`", file=MANIFEST)
    version = raw.get("schema_version")
    if not is_int(version):
        raise c.fail(f"schema_version must be an integer, got {json.dumps(version)}")
    if version not in READABLE_SCHEMAS:
        older = version < SCHEMA_VERSION
        raise ArtifactError(
            f"{root / MANIFEST} has schema_version {version}; this loader reads schema_version {SCHEMA_VERSION}: "
            + ("re-run `moeprep prepare` to rebuild the artifact in the current format" if older
               else "upgrade the loader, or prepare the artifact with a matching moeprep"), file=MANIFEST)
    return version


def _check_provenance(c: _Checker, raw: dict) -> None:
    """Who made the artifact, from what: the producer's versions, the source model, the recipe and keys."""
    producer = c.get(raw, "producer", "", "dict")
    for key in ("moeprep", "torch", "transformers", "hqq"):
        c.get(producer, key, "producer.", "str")
    source = c.get(raw, "source_model", "", "dict")
    c.get(source, "path", "source_model.", "str")
    c.get(source, "revision", "source_model.", "str|null")
    c.get(source, "fingerprint", "source_model.", "str")
    c.get(raw, "recipe", "", "dict")
    c.get(raw, "package_key", "", "hex64")
    c.get(raw, "plan_summary", "", "dict")


def _check_moe(c: _Checker, moe: dict) -> MoeSection:
    """The ``moe`` section: every key typed, the module paths one per MoE layer and of that layer."""
    c.only(moe, _MOE_KEYS, "moe")
    c.get(moe, "architecture", "moe.", "str")
    layers = c.get(moe, "layers", "moe.", "list")
    if not layers or not all(is_int(x) and x >= 0 for x in layers) or layers != sorted(set(layers)):
        raise c.fail("moe.layers must be a non-empty increasing list of layer indices")
    n_experts = c.get(moe, "num_experts", "moe.", "int")
    top_k = c.get(moe, "top_k", "moe.", "int")
    if not 1 <= top_k <= n_experts:
        raise c.fail(f"moe.top_k {top_k} must be between 1 and num_experts {n_experts}")
    if c.get(moe, "dtype", "moe.", "str") not in DTYPES:
        raise c.fail(f"moe.dtype must be one of {DTYPES}")
    modules = c.strings(moe, "experts_modules", "moe.", len(layers))
    routers = c.strings(moe, "router_modules", "moe.", len(layers))
    for name, paths in (("experts_modules", modules), ("router_modules", routers)):
        if len(set(paths)) != len(paths):
            raise c.fail(f"moe.{name} names one module twice")
        for layer, path in zip(layers, paths, strict=True):
            if str(layer) not in path.split("."):
                raise c.fail(f"moe.{name}: {path!r} is not a module of layer {layer}")
    c.get(moe, "last_decoder_layer", "moe.", "str")
    if "routing_weights" in moe and (problem := weights_spec_problem(moe["routing_weights"])):
        raise c.fail(f"moe.{problem}; prepare the artifact again")
    c.strings(moe, "expert_params", "moe.")
    if c.get(moe, "source_expert_bytes", "moe.", "int") <= 0:
        raise c.fail("moe.source_expert_bytes must be positive")
    return MoeSection.from_json(moe)


def _check_store(c: _Checker, precision, store, moe: MoeSection, version: int) -> None:
    """One expert store: its file name, its layout against the MoE section, its neuron keys and checksums."""
    where = f"stores.{precision}."
    if precision not in PRECISIONS:
        raise c.fail(f"stores has an unknown precision {precision!r}; known: {PRECISIONS}")
    if not isinstance(store, dict):
        raise c.fail(f"stores.{precision} must be dict")
    c.only(store, _STORE_KEYS, f"stores.{precision}")
    if c.get(store, "file", where, "str") != f"experts-{precision}.safetensors":
        raise c.fail(f"{where}file must be 'experts-{precision}.safetensors', got {store['file']!r}")
    record_bytes = c.get(store, "record_bytes", where, "int")
    layout = _layout(c, c.get(store, "layout", where, "list"), where, precision, moe.dtype)
    if layout.nbytes != record_bytes:
        raise c.fail(f"{where}record_bytes is {record_bytes}, its layout needs {layout.nbytes}")
    numel = sum(math.prod(spec.shape) for spec in layout.matrices)
    if moe.source_expert_bytes != len(moe.layers) * moe.num_experts * numel * _ITEMSIZE[moe.dtype]:
        raise c.fail(f"moe.source_expert_bytes {moe.source_expert_bytes} is not the size of "
                     f"{len(moe.layers)} x {moe.num_experts} experts of the {precision} layout in {moe.dtype}")
    neuron = _check_neuron_keys(c, store, precision, layout, version)
    names = {f"{module}.{name}" for module in moe.experts_modules for name in layout_params(layout, neuron)}
    if names != set(moe.expert_params) or len(moe.expert_params) != len(names):
        raise c.fail(f"moe.expert_params do not match the experts modules and the {precision} layout")
    _check_checksums(c, c.get(store, "xxh3", where, "dict"), where, moe)


def _check_neuron_keys(c: _Checker, store: dict, precision: str, layout: RecordLayout, version: int) -> bool:
    """A neuron store's ``neuron`` and ``blocks`` keys (and no row-interleaved layout elsewhere); whether it is one."""
    where = f"stores.{precision}."
    neuron = store.get("neuron")
    if neuron is not None:
        if version < 3 or not isinstance(neuron, dict) or set(neuron) != {"pairing"} \
                or neuron["pairing"] not in PAIRINGS:
            raise c.fail(f"{where}neuron must be {{pairing: one of {list(PAIRINGS)}}} (schema_version 3)")
        try:
            NeuronLayout(layout)
        except CodecError as e:
            raise c.fail(f"{where}layout: {e}") from None
        if store.get("blocks") != block_file(precision):
            raise c.fail(f"{where}blocks must be {block_file(precision)!r}: a neuron store is read in part, and each "
                         "part is checked against its block's hash (schema_version 4; an older artifact has none, "
                         "prepare it again)")
    elif "blocks" in store:
        raise c.fail(f"{where}blocks belongs to a neuron store only")
    elif NeuronLayout.holds(layout):
        raise c.fail(f"{where}layout has row-interleaved matrices, which only a neuron store (its 'neuron' key) "
                     "holds")
    return neuron is not None


def _check_checksums(c: _Checker, crc: dict, where: str, moe: MoeSection) -> None:
    """A store's xxh3 table: one unsigned 64-bit checksum per record it holds, each an expert of the MoE section.
    The expert keys are built only once the table's size shows the count is real (num_experts may claim 2**60)."""
    total = len(moe.layers) * moe.num_experts
    if not 0 < len(crc) <= total or not set(crc) <= {expert_key(layer, e) for layer in moe.layers
                                                       for e in range(moe.num_experts)}:
        raise c.fail(f"{where}xxh3 must hold one checksum per expert of the store (some of the "
                     f"{total}: layers {list(moe.layers)} x {moe.num_experts} experts), it holds {len(crc)} "
                     "that do not match")
    if not all(is_int(v) and 0 <= v < 2**64 for v in crc.values()):
        raise c.fail(f"{where}xxh3 values must be unsigned 64-bit integers")


def _check_files(c: _Checker, raw: dict, root: Path) -> None:
    """The files table (every name inside the artifact, sizes and sha256s typed, the required files listed) and the
    manifest's own digest."""
    files = c.get(raw, "files", "", "dict")
    if not files:
        raise c.fail("files is empty: the manifest must list every file of the artifact")
    for name, entry in files.items():
        artifact_file(root, name)
        if name == MANIFEST:
            raise c.fail(f"files lists {MANIFEST} itself")
        if not isinstance(entry, dict):
            raise c.fail(f"files[{name!r}] must be dict")
        c.only(entry, {"bytes", "sha256"}, f"files[{name!r}]")
        if c.get(entry, "bytes", f"files[{name!r}].", "int") < 0:
            raise c.fail(f"files[{name!r}].bytes must not be negative")
        c.get(entry, "sha256", f"files[{name!r}].", "hex64")
    needed = [*REQUIRED_FILES, *(s["file"] for s in raw["stores"].values())]
    if missing := [n for n in needed if n not in files]:
        raise c.fail(f"files does not list {missing}")
    if DIGEST_REQUIRED or DIGEST in raw:
        if c.get(raw, DIGEST, "", "hex64") != manifest_digest(raw):
            raise c.fail(f"its content does not match its {DIGEST} (a key was changed after it was written)")


def manifest_digest(raw: dict) -> str:
    """sha256 of the manifest's canonical JSON (sorted keys, no spaces), without the digest key itself."""
    body = {k: v for k, v in raw.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_manifest(directory: str | Path, raw: dict) -> dict:
    """Seal ``raw`` with its digest and write it as ``directory/manifest.json`` atomically; returns it.

    Every writer of a manifest goes through here (package, ``moeprep eval``), so an edit by hand or a
    flipped bit anywhere in the manifest is refused at load rather than silently obeyed.
    """
    sealed = {k: v for k, v in raw.items() if k != DIGEST} | {DIGEST: manifest_digest(raw)}
    write_json_atomic(Path(directory) / MANIFEST, sealed)
    return sealed


def layout_params(layout: RecordLayout, neuron: bool) -> list[str]:
    """The experts-module parameters a store's records hold: the layout's matrices, or for a neuron layout
    the fused parameters its gate, neuron rows and biases come from."""
    if not neuron:
        return [spec.name for spec in layout.matrices]
    has_bias = any(spec.name.endswith("_bias") for spec in layout.matrices)
    return ["gate_up_proj", "down_proj", *(["gate_up_proj_bias", "down_proj_bias"] if has_bias else [])]


def _layout(c: _Checker, raw: list, where: str, precision: str, dtype: str) -> RecordLayout:
    """A store's record layout, every field typed, each matrix at the store's precision (or passthrough)."""
    fields = {"name", "shape", "precision", "dtype", "group_size", "transposed", "meta_group"}
    if not raw:
        raise c.fail(f"{where}layout is empty")
    for i, d in enumerate(raw):
        if isinstance(d, dict) and d.get("rows") is not True and "rows" in d:
            raise c.fail(f"{where}layout[{i}].rows must be true when present")
        if isinstance(d, dict) and "kernel" in d and d["kernel"] not in KERNELS:
            raise c.fail(f"{where}layout[{i}].kernel must be one of {list(KERNELS)} when present")
        if (not isinstance(d, dict) or set(d) - {"rows", "kernel"} != fields or not isinstance(d["name"], str) or not d["name"]
                or not is_int(d["meta_group"]) or d["meta_group"] < 0
                or not isinstance(d["shape"], list) or not d["shape"]
                or not all(is_int(s) and s > 0 for s in d["shape"])
                or d["precision"] not in (precision, "passthrough") or d["dtype"] != dtype
                or not is_int(d["group_size"]) or d["group_size"] < 0 or not isinstance(d["transposed"], bool)):
            raise c.fail(f"{where}layout[{i}] must be {{name, shape (positive ints), precision ({precision} or "
                         f"passthrough), dtype ({dtype}), group_size >= 0, transposed (bool), meta_group >= 0}}, "
                         f"got {json.dumps(d)[:120]}")
    if len({d["name"] for d in raw}) != len(raw):
        raise c.fail(f"{where}layout names one matrix twice")
    if any(d["precision"] == "passthrough" and (d["group_size"] or d["transposed"] or d["meta_group"])
           for d in raw):
        raise c.fail(f"{where}layout: a passthrough matrix has no group_size or meta_group (0) and is not "
                     "transposed")
    layout = RecordLayout.from_json(raw)
    try:
        for spec in layout.matrices:
            spec.check()
    except CodecError as e:
        raise c.fail(f"{where}layout: {e}") from None
    return layout


def read_manifest(artifact: str | Path) -> Manifest:
    """Parse and validate ``manifest.json`` (schema, every key's type, every file name's path).

    Reads nothing but the manifest; ``loader.artifact.open_artifact`` checks the files it lists.
    """
    root = resolve_artifact(artifact)
    path = artifact_file(root, MANIFEST)
    if not path.is_file():
        raise ArtifactError(f"{root} has no {MANIFEST}: it is not an artifact, or its preparation did not "
                            "finish; re-run `moeprep prepare`", file=MANIFEST)
    raw = read_json(path, MANIFEST, limit=MAX_MANIFEST_BYTES)
    moe = _validate(raw, root)
    return Manifest(raw, root, moe)
