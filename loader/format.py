"""The artifact schema (schema_version 5): what a prepared-model directory holds and how it is checked.

This module is the one owner of the format; ``prep`` imports it to write artifacts. An artifact is a
directory of JSON and safetensors files only (``loader/README.md`` has the full spec):

- ``manifest.json`` (written last: a directory with a manifest is complete): format name, integer
  schema version, producer versions, source model, resolved recipe, the package stage's key, the MoE
  geometry and module paths, the expert stores (record layout and an xxh3_64 per record), a plan summary,
  and every other file with its size and sha256;
- ``config.json`` + tokenizer files of the source model; ``dense.safetensors`` (all non-expert weights);
- ``experts-<precision>.safetensors``: one uint8 tensor ``layers.{l}.experts.{e}`` per expert, each a
  packed record (``loader/codec.py``) starting on a 4 KiB boundary of the file;
- ``plan.json`` (``loader/plan.py``) and ``report.json``.

Trust, in three layers, each raising ``ArtifactError`` (a ``MoeError``) that names the file and what to do:

- ``read_manifest``: the manifest alone, strictly typed (``true`` is not an int), every file name
  mapped through ``artifact_file``, which refuses absolute paths, ``..`` and anything that resolves
  (symlinks included) outside the artifact directory. The directory is resolved once, so an artifact
  that is a symlink to a versioned directory (how ``prepare`` swaps artifacts atomically) is read from
  one version even if the link moves meanwhile.
- ``open_artifact`` (every load): the sizes of every file; the sha256 of every file except the expert
  stores (whose records are checked one by one as they are read) and ``report.json`` (informational,
  rewritten by ``moeprep eval``; ``verify`` checks it); every JSON file parses; the MoE facts agree
  with ``config.json``; ``plan.json`` parses and fits the manifest; every safetensors header is bounded
  by its file and the store headers hold exactly the offsets the manifest implies. ``check_model``
  then checks the manifest's module paths, layouts and the dense weights against the model skeleton,
  and ``check_record`` checks each record's xxh3_64 as it is read.
- ``verify``: all of that plus every sha256 and every record's xxh3_64; one line per bad file.

Records are checked with xxh3_64 (schema 5; crc32 before): it runs at memory speed, so checking a miss costs a
small share of reading it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path, PurePosixPath

from xxhash import xxh3_64, xxh3_64_intdigest

from loader.codec import BITS, KERNELS, PAIRINGS, CodecError, NeuronLayout, RecordLayout
from loader.errors import PREPARE_AGAIN as _PREPARE_AGAIN
from loader.errors import ArtifactError
from loader.io import read_record_offsets, read_safetensors_header, write_json_atomic
from loader.plan import PLAN_FILE, Plan, read_plan
from loader.predict import PREDICTORS_FILE, PredictorContext, PredictorError, make_predictor

FORMAT = "moeprep-artifact"
SCHEMA_VERSION = 5  # 3: neuron-layout stores; 4: their per-block hashes; 5: xxh3_64 per record, kernel layouts
READABLE_SCHEMAS = (5,)  # an older artifact has crc32 checks: prepare it again
ALIGN = 4096
BLOCK = ALIGN  # the unit of a partial read of a neuron record, each with its own hash
MANIFEST = "manifest.json"
DIGEST = "digest"  # the manifest's own sha256 (``manifest_digest``): the manifest protects itself too
DIGEST_REQUIRED = True  # every writer seals the manifest through write_manifest
CONFIG = "config.json"
DENSE = "dense.safetensors"
REPORT = "report.json"
REPORTS_DIR = "reports/"  # plots and study files: informational, whatever their names
INFORMATIONAL_FILES = (REPORT, "report.md")  # rewritten after packaging, with everything under REPORTS_DIR
REQUIRED_FILES = (CONFIG, DENSE, PLAN_FILE)
DTYPES = ("float32", "float16", "bfloat16")
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
PRECISIONS = ("passthrough", *BITS)
MAX_MANIFEST_BYTES = 64 << 20
# config.json names of E and K across architectures (a multimodal config nests them in text_config)
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "top_k", "moe_top_k", "experts_per_token", "num_selected_experts")
# safetensors dtype names -> bytes per element


def expert_key(layer: int, expert: int) -> str:
    return f"layers.{layer}.experts.{expert}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _is_int(x) -> bool:
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
        if limit is not None and path.stat().st_size > limit:
            raise ArtifactError(f"{path} is {path.stat().st_size:,} bytes, more than any {name} can be; {fix}",
                                file=name)
        text = path.read_bytes()
    except FileNotFoundError:
        raise ArtifactError(f"{path} is missing; {fix}", file=name) from None
    except OSError as e:
        raise ArtifactError(f"cannot read {path} ({e.strerror or e}); {fix}", file=name) from None
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ArtifactError(f"{path} is not valid JSON ({str(e)[:120]}); {fix}", file=name) from None


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
class Manifest:
    """The parsed, validated ``manifest.json`` of the artifact directory ``root`` (resolved once).

    ``plan`` is set by ``open_artifact`` (the checked ``plan.json``); ``read_manifest`` leaves it None.
    """

    raw: dict
    root: Path
    plan: Plan | None = None

    @property
    def files(self) -> dict[str, dict]:
        return self.raw["files"]

    @property
    def moe(self) -> dict:
        return self.raw["moe"]

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
        return [expert_key(layer, e) for layer in self.moe["layers"] for e in range(self.moe["num_experts"])]

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
              "int": _is_int,
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


def _validate(raw, root: Path) -> None:
    """Every key of a schema-2 manifest, typed strictly and cross-checked within the manifest."""
    c = _Checker(root / MANIFEST)
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{root / MANIFEST} is not a {FORMAT} manifest; pass an artifact made by "
                            "`moeprep prepare`", file=MANIFEST)
    version = raw.get("schema_version")
    if not _is_int(version):
        raise c.fail(f"schema_version must be an integer, got {json.dumps(version)}")
    if version not in READABLE_SCHEMAS:
        older = version < SCHEMA_VERSION
        raise ArtifactError(
            f"{root / MANIFEST} has schema_version {version}; this loader reads schema_version {SCHEMA_VERSION}: "
            + ("re-run `moeprep prepare` to rebuild the artifact in the current format" if older
               else "upgrade the loader, or prepare the artifact with a matching moeprep"), file=MANIFEST)
    c.only(raw, _TOP_KEYS, "")
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

    moe = c.get(raw, "moe", "", "dict")
    c.only(moe, _MOE_KEYS, "moe")
    c.get(moe, "architecture", "moe.", "str")
    layers = c.get(moe, "layers", "moe.", "list")
    if not layers or not all(_is_int(x) and x >= 0 for x in layers) or layers != sorted(set(layers)):
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
    if "routing_weights" in moe:
        from loader.routing import RoutingError, check_weights_spec

        try:
            check_weights_spec(moe["routing_weights"])
        except RoutingError as e:
            raise c.fail(f"moe.{e}") from None
    params = c.strings(moe, "expert_params", "moe.")
    if c.get(moe, "source_expert_bytes", "moe.", "int") <= 0:
        raise c.fail("moe.source_expert_bytes must be positive")

    stores = c.get(raw, "stores", "", "dict")
    if not stores:
        raise c.fail("stores is empty: an artifact needs at least one expert store")
    keys = None  # built once a checksum table shows the count is real (num_experts may claim 2**60)
    for precision, store in stores.items():
        where = f"stores.{precision}."
        if precision not in PRECISIONS:
            raise c.fail(f"stores has an unknown precision {precision!r}; known: {PRECISIONS}")
        if not isinstance(store, dict):
            raise c.fail(f"stores.{precision} must be dict")
        c.only(store, {"file", "record_bytes", "layout", "xxh3", "neuron", "blocks"}, f"stores.{precision}")
        if c.get(store, "file", where, "str") != f"experts-{precision}.safetensors":
            raise c.fail(f"{where}file must be 'experts-{precision}.safetensors', got {store['file']!r}")
        record_bytes = c.get(store, "record_bytes", where, "int")
        layout = _layout(c, c.get(store, "layout", where, "list"), where, precision, moe["dtype"])
        if layout.nbytes != record_bytes:
            raise c.fail(f"{where}record_bytes is {record_bytes}, its layout needs {layout.nbytes}")
        numel = sum(math.prod(spec.shape) for spec in layout.matrices)
        if moe["source_expert_bytes"] != len(layers) * n_experts * numel * _ITEMSIZE[moe["dtype"]]:
            raise c.fail(f"moe.source_expert_bytes {moe['source_expert_bytes']} is not the size of "
                         f"{len(layers)} x {n_experts} experts of the {precision} layout in {moe['dtype']}")
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
        names = {f"{module}.{name}" for module in modules for name in layout_params(layout, neuron is not None)}
        if names != set(params) or len(params) != len(names):
            raise c.fail(f"moe.expert_params do not match the experts modules and the {precision} layout")
        crc = c.get(store, "xxh3", where, "dict")
        if 0 < len(crc) <= len(layers) * n_experts and keys is None:
            keys = {expert_key(layer, e) for layer in layers for e in range(n_experts)}
        if not 0 < len(crc) <= len(layers) * n_experts or not set(crc) <= keys:
            raise c.fail(f"{where}xxh3 must hold one checksum per expert of the store (some of the "
                         f"{len(layers) * n_experts}: layers {layers} x {n_experts} experts), it holds {len(crc)} "
                         "that do not match")
        if not all(_is_int(v) and 0 <= v < 2**64 for v in crc.values()):
            raise c.fail(f"{where}xxh3 values must be unsigned 64-bit integers")

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
    needed = [*REQUIRED_FILES, *(s["file"] for s in stores.values())]
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
                or not _is_int(d["meta_group"]) or d["meta_group"] < 0
                or not isinstance(d["shape"], list) or not d["shape"]
                or not all(_is_int(s) and s > 0 for s in d["shape"])
                or d["precision"] not in (precision, "passthrough") or d["dtype"] != dtype
                or not _is_int(d["group_size"]) or d["group_size"] < 0 or not isinstance(d["transposed"], bool)):
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

    Reads nothing but the manifest; ``open_artifact`` checks the files it lists.
    """
    root = resolve_artifact(artifact)
    path = artifact_file(root, MANIFEST)
    if not path.is_file():
        raise ArtifactError(f"{root} has no {MANIFEST}: it is not an artifact, or its preparation did not "
                            "finish; re-run `moeprep prepare`", file=MANIFEST)
    raw = read_json(path, MANIFEST, limit=MAX_MANIFEST_BYTES)
    _validate(raw, root)
    return Manifest(raw, root)


# ------------------------------------------------------------------------------------ file checks


def _file_problem(manifest: Manifest, name: str, hash_it: bool) -> str | None:
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
        if problem := _file_problem(manifest, name, hash_it=name not in stores):
            problems.append((name, problem))
    if problems:
        raise ArtifactError(f"artifact {manifest.root} is damaged: "
                            + "; ".join(f"{name}: {p}" for name, p in problems)
                            + f". {_PREPARE_AGAIN[0].upper()}{_PREPARE_AGAIN[1:]}", file=problems[0][0])
    return _check_contents(manifest)


def _check_contents(manifest: Manifest, informational: bool = False) -> Manifest:
    """Every JSON file parses, the MoE facts agree with config.json, the plan fits, every header is sound."""
    for name in sorted(manifest.files):
        # loading needs no report (``informational``: verify parses it too)
        if name.endswith(".json") and name != PLAN_FILE and (informational or not is_informational(name)):
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
        for keys, fact in ((EXPERT_COUNT_KEYS, "num_experts"), (TOP_K_KEYS, "top_k")):
            for key in keys:
                if cfg.get(key) is not None and cfg[key] != moe[fact]:
                    raise fail(f"config {key} is {json.dumps(cfg[key])[:40]}, manifest moe.{fact} is {moe[fact]}")
    if moe["architecture"] not in [cfg.get("model_type") for cfg in configs]:
        raise fail(f"config model_type is {config.get('model_type')!r}, manifest moe.architecture is "
                   f"{moe['architecture']!r}")
    depth = [cfg["num_hidden_layers"] for cfg in configs if _is_int(cfg.get("num_hidden_layers"))]
    if depth:
        n = depth[-1]
        if moe["layers"][-1] >= n:
            raise fail(f"manifest moe.layers {moe['layers']} reach past the config's {n} layers")
        if moe["last_decoder_layer"].split(".")[-1] != str(n - 1):
            raise fail(f"manifest moe.last_decoder_layer {moe['last_decoder_layer']!r} is not layer {n - 1}")


def _check_plan(manifest: Manifest, plan: Plan) -> None:
    moe = manifest.moe
    if plan.num_layers != len(moe["layers"]) or plan.num_experts != moe["num_experts"]:
        raise ArtifactError(f"{manifest.root / PLAN_FILE} is for {plan.num_layers} layers x {plan.num_experts} "
                            f"experts, the manifest has {len(moe['layers'])} x {moe['num_experts']}; "
                            f"{_PREPARE_AGAIN}", file=PLAN_FILE)
    if missing := sorted(set(plan.precisions) - set(manifest.stores)):
        raise ArtifactError(f"{manifest.root / PLAN_FILE} uses precisions {missing} that the artifact has no "
                            f"store for (stores: {sorted(manifest.stores)}); {_PREPARE_AGAIN}", file=PLAN_FILE)
    for pos, (layer, row) in enumerate(zip(moe["layers"], plan.expert_precision, strict=True)):
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


# ------------------------------------------------------------------------------------ per read, per model


def block_file(precision: str) -> str:
    """The file of a neuron store's per-block hashes: uint64 [records, blocks], records in store order."""
    return f"experts-{precision}.blocks.safetensors"


def block_hashes(record) -> list[int]:
    """xxh3_64 of each 4 KiB block of one record (bytes or a memoryview of exactly its bytes). xxh3 rather than
    crc32: it runs at 8.7 GB/s on 4 KiB blocks here against crc32's 2.8, and the loader checks every block of a
    partial read on the reader threads, beside decoding."""
    view = memoryview(record)
    return [xxh3_64_intdigest(view[i:i + BLOCK]) for i in range(0, view.nbytes, BLOCK)]


def read_block_table(manifest: Manifest, precision: str):
    """A neuron store's block hashes, checked against the store's shape: (record key -> row, uint64 numpy array
    [records, blocks]). The file's sha256 was checked with the other files by ``open_artifact``."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    info = manifest.stores[precision]
    keys = manifest.store_keys(precision)
    name = info.blocks
    if name not in manifest.files:
        raise ArtifactError(f"{name} is not listed in the manifest; {_PREPARE_AGAIN}", file=name)
    try:
        table = load_file(str(manifest.path(name))).get("blocks")
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{name} cannot be read ({e}); {_PREPARE_AGAIN}", file=name) from None
    if table is None or str(table.dtype) != "uint64" or tuple(table.shape) != (len(keys), info.block_count):
        got = None if table is None else (str(table.dtype), tuple(table.shape))
        raise ArtifactError(f"{name} must hold 'blocks', uint64 [{len(keys)}, {info.block_count}] (one hash per 4 KiB "
                            f"block of each record), it holds {got}; {_PREPARE_AGAIN}", file=name)
    return {key: i for i, key in enumerate(keys)}, table


def read_predictor_tensors(manifest: Manifest) -> dict:
    """The artifact's ``predictors.safetensors`` as torch tensors ({} when it has none), its header read bounded
    and every float value finite; an unreadable file is one ArtifactError naming it."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if PREDICTORS_FILE not in manifest.files:
        return {}
    path = manifest.path(PREDICTORS_FILE)
    read_safetensors_header(path, PREDICTORS_FILE)  # a garbage header or a 2**60 length is refused before loading
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise ArtifactError(f"{PREDICTORS_FILE} cannot be read ({e}); {_PREPARE_AGAIN}", file=PREDICTORS_FILE) from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ArtifactError(f"{PREDICTORS_FILE}: {name} holds NaN or infinite values; {_PREPARE_AGAIN}",
                                file=PREDICTORS_FILE)
    return tensors


def check_predictors(manifest: Manifest, plan: Plan) -> None:
    """Bind the predictors ``plan`` names as the loader binds them (the routers' weights from dense.safetensors, the
    artifact's predictor tensors), so ``verify`` refuses what ``load`` would; one ArtifactError naming the file."""
    from safetensors import safe_open

    tensors = read_predictor_tensors(manifest)
    if not plan.predictors:
        return
    moe = manifest.moe
    routers = []
    with safe_open(str(manifest.path(DENSE)), framework="pt") as f:
        names = set(f.keys())
        for path in moe["router_modules"]:
            weight = f.get_tensor(f"{path}.weight") if f"{path}.weight" in names else None
            bias = f.get_tensor(f"{path}.bias") if f"{path}.bias" in names else None
            routers.append((weight.float() if weight is not None else None, bias.float() if bias is not None else None))
    context = PredictorContext(len(moe["layers"]), moe["num_experts"], moe["top_k"], routers, tensors)
    for spec in plan.predictors:
        try:
            make_predictor(spec.name, spec.params).bind(context)
        except PredictorError as e:
            raise ArtifactError(f"{PLAN_FILE} names the predictor {spec.name}, which this artifact cannot run: {e}",
                                file=PREDICTORS_FILE if PREDICTORS_FILE in manifest.files else PLAN_FILE) from None


def read_tokenizer(artifact: Path):
    """The artifact's tokenizer, loaded as ``load`` loads it (``AutoTokenizer`` over the artifact directory); a
    tokenizer that cannot be built (a tokenizer.json without its model, a config naming nothing) is one
    ArtifactError naming the files. ``verify`` loads it too: it needs no weights."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(artifact)
    except Exception as e:  # transformers and tokenizers raise many kinds for a malformed file
        raise ArtifactError(f"the artifact's tokenizer files (tokenizer.json, tokenizer_config.json) cannot be read "
                            f"({type(e).__name__}: {str(e)[:200]}); {_PREPARE_AGAIN}", file="tokenizer.json") from None


def check_record(manifest: Manifest, precision: str, key: str, data) -> None:
    """Check one record as read (bytes, memoryview, mmap, numpy array or CPU tensor; at least
    record_bytes long, only the first record_bytes count) against the manifest's xxh3_64."""
    info = manifest.stores[precision]
    expected = info.xxh3.get(key)
    if expected is None:
        raise ArtifactError(f"{info.file} has no record {key} in the manifest; {_PREPARE_AGAIN}", file=info.file)
    if hasattr(data, "numpy"):
        data = data.numpy()
    view = memoryview(data)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes < info.record_bytes:
        raise ArtifactError(f"record {key} of {manifest.root / info.file}: {view.nbytes} bytes read, "
                            f"{info.record_bytes} expected (the file is truncated); {_PREPARE_AGAIN}", file=info.file)
    got = xxh3_64_intdigest(view[: info.record_bytes])
    if got != expected:
        raise ArtifactError(f"record {key} of {manifest.root / info.file} is damaged (xxh3_64 {got:016x}, the "
                            f"manifest says {expected:016x}); {_PREPARE_AGAIN}", file=info.file)


def _check_neuron_store(info: StoreInfo, experts, num_experts: int, path: str, fail) -> None:
    """A neuron store fits an experts module when its gate [I, H] and neuron rows [I, 2H] come from the module's
    fused parameters: gate_up_proj [E, 2I, H] (or [E, H, 2I]) and down_proj [E, H, I] (or [E, I, H])."""
    layout = NeuronLayout(RecordLayout.from_json(info.layout))
    i, h = layout.intermediate, layout.hidden
    want = {"gate_up_proj": {(num_experts, 2 * i, h), (num_experts, h, 2 * i)},
            "down_proj": {(num_experts, h, i), (num_experts, i, h)}}
    if "gate_bias" in layout.specs:
        want |= {"gate_up_proj_bias": {(num_experts, 2 * i)}, "down_proj_bias": {(num_experts, h)}}
    params = experts._parameters
    if set(params) != set(want):
        raise fail(f"the {info.precision} neuron layout comes from {sorted(want)}, the experts module {path!r} has "
                   f"{sorted(params)}")
    for name, shapes in want.items():
        if params[name] is None or tuple(params[name].shape) not in shapes:
            raise fail(f"{path}.{name} is {tuple(params[name].shape)} in the model, the {info.precision} neuron "
                       f"layout needs one of {sorted(shapes)}")


_TORCH_ST = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
             "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def check_model(manifest: Manifest, model) -> None:
    """Check the manifest against the model skeleton built from config.json (meta device is fine), before
    any weight is assigned: every module path exists, each layout matrix has the shape of its experts
    parameter, and ``dense.safetensors`` holds exactly the non-expert weights with their shapes and dtypes.
    """
    moe = manifest.moe

    def fail(what: str, file: str = MANIFEST) -> ArtifactError:
        return ArtifactError(f"{manifest.root / file} does not fit the model built from config.json: {what}; "
                             f"{_PREPARE_AGAIN}", file=file)

    def module(path: str):
        try:
            return model.get_submodule(path)
        except AttributeError:
            raise fail(f"it names the module {path!r}, which the model does not have") from None

    for path in moe["router_modules"]:  # a router scores every expert: it holds a parameter of E rows
        params = module(path)._parameters.values()
        if not any(p is not None and p.dim() >= 1 and p.shape[0] == moe["num_experts"] for p in params):
            raise fail(f"its router module {path!r} holds no parameter with {moe['num_experts']} rows (one per "
                       "expert): it is not this model's router")
    module(moe["last_decoder_layer"])
    for path in moe["experts_modules"]:
        experts = module(path)
        for info in manifest.stores.values():
            if info.neuron is not None:
                _check_neuron_store(info, experts, moe["num_experts"], path, fail)
                continue
            names = [spec["name"] for spec in info.layout]
            if names != list(experts._parameters):  # a record holds every parameter, in the module's order
                raise fail(f"the {info.precision} layout holds {names}, the experts module {path!r} has "
                           f"{list(experts._parameters)} in this order")
            for spec in RecordLayout.from_json(info.layout).matrices:
                param = experts._parameters.get(spec.name)
                shape = spec.shape[::-1] if spec.transposed else spec.shape
                if param is None or tuple(param.shape) != (moe["num_experts"], *shape):
                    got = None if param is None else tuple(param.shape)
                    raise fail(f"{path}.{spec.name} is {got} in the model, the {info.precision} layout says "
                               f"{moe['num_experts']} x {tuple(shape)}")
    header, _, _ = read_safetensors_header(manifest.path(DENSE), DENSE)
    state = model.state_dict(keep_vars=True)
    experts = set(moe["expert_params"])
    for name, entry in header.items():
        tensor = state.get(name)
        if tensor is None or name in experts:
            raise fail(f"it holds {name!r}, which is not a dense weight of the model", DENSE)
        want = _TORCH_ST.get(str(tensor.dtype).removeprefix("torch."))
        if list(tensor.shape) != entry["shape"] or entry["dtype"] != want:
            raise fail(f"{name!r} is {entry['dtype']} {entry['shape']}, the model has {want} "
                       f"{list(tensor.shape)}", DENSE)
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():  # tied weights share one tensor: one name of a group suffices
        groups.setdefault(id(tensor), []).append(name)
    for names in groups.values():
        if not any(n in header or n in experts for n in names):
            raise fail(f"the weight {names[0]!r} is missing", DENSE)


# ------------------------------------------------------------------------------------------ verify


def _hash_store(manifest: Manifest, precision: str, chunk: int = 1 << 24) -> str | None:
    """One pass over a store: its sha256 and every record's xxh3_64; the first problem, or None."""
    info = manifest.stores[precision]
    try:
        offsets = store_offsets(manifest, precision)
    except ArtifactError as e:
        return str(e)
    digest = hashlib.sha256()
    hashes = {}
    blocks = None
    if info.blocks is not None:
        try:
            rows, blocks = read_block_table(manifest, precision)
        except ArtifactError as e:
            return str(e)
    chunk = -(-chunk // BLOCK) * BLOCK  # whole blocks per read, so each block's hash is one call
    bad_blocks = []
    try:
        with open(manifest.path(info.file), "rb") as f:
            start = min(offsets.values())
            digest.update(f.read(start))
            for key in manifest.store_keys(precision):  # records lie in this order, one stride apart
                record, left, useful_left, done = xxh3_64(), info.stride, info.record_bytes, 0
                while left:
                    block = f.read(min(chunk, left))
                    if not block:
                        return "truncated"
                    digest.update(block)
                    if useful_left:
                        useful = memoryview(block)[:useful_left]
                        record.update(useful)
                        if blocks is not None:
                            got = block_hashes(useful)
                            first = done // BLOCK
                            if got != blocks[rows[key], first:first + len(got)].tolist():
                                bad_blocks.append(key)
                        useful_left -= len(useful)
                        done += len(useful)
                    left -= len(block)
                hashes[key] = record.intdigest()
            digest.update(f.read())
    except OSError as e:  # e.g. removed by a concurrent prepare that swapped in a new version
        return f"cannot be read ({e.strerror or e})"
    if bad := [k for k, v in hashes.items() if v != info.xxh3[k]]:  # first: it names the damaged records
        return f"xxh3_64 of records {bad[:4]} differ from the manifest (the manifest or the records changed)"
    if digest.hexdigest() != manifest.files[info.file]["sha256"]:
        return "sha256 mismatch (content changed)"
    if bad_blocks:
        return (f"block hashes of records {sorted(set(bad_blocks))[:4]} differ from {info.blocks} (the records or "
                "the block table changed)")
    return None


