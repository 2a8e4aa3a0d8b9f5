"""The artifact schema: what a prepared-model directory contains and how it is checked.

This module is the one owner of the format; ``prep`` imports it to write artifacts. An artifact is a
directory of JSON and safetensors files only:

- ``manifest.json`` (written last: a directory with a manifest is complete): format name, integer
  schema version, producer versions, source model, resolved recipe, the MoE geometry, the expert
  stores and their record layouts, a plan summary, and every other file with its size and sha256;
- ``config.json`` + tokenizer files of the source model; ``dense.safetensors`` (all non-expert weights);
- ``experts-<precision>.safetensors``: one uint8 tensor ``layers.{l}.experts.{e}`` per expert, each a
  packed record (``loader/codec.py``) starting on a 4 KiB boundary of the file;
- ``plan.json`` (per-expert precision, per-layer cache sizes) and ``report.json``.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from loader.errors import MoeError

FORMAT = "moeprep-artifact"
SCHEMA_VERSION = 1
ALIGN = 4096
MANIFEST = "manifest.json"


class ArtifactError(MoeError):
    """An artifact that cannot be used as it is; the message names the file and what to do."""


def expert_key(layer: int, expert: int) -> str:
    return f"layers.{layer}.experts.{expert}"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class StoreInfo:
    """One expert store: its file, the precision of its records and their shared layout."""

    precision: str
    file: str
    record_bytes: int
    layout: list  # RecordLayout.to_json()


@dataclass(frozen=True)
class Manifest:
    """The parsed ``manifest.json``."""

    raw: dict

    @property
    def files(self) -> dict[str, dict]:
        return self.raw["files"]

    @property
    def moe(self) -> dict:
        return self.raw["moe"]

    @property
    def stores(self) -> dict[str, StoreInfo]:
        return {p: StoreInfo(p, s["file"], s["record_bytes"], s["layout"]) for p, s in self.raw["stores"].items()}


def read_manifest(artifact: str | Path) -> Manifest:
    """Parse and check ``manifest.json``: format, schema version, required keys."""
    artifact = Path(artifact)
    path = artifact / MANIFEST
    if not artifact.is_dir():
        raise ArtifactError(f"artifact directory {artifact} does not exist; run `moeprep prepare` to make one")
    if not path.is_file():
        raise ArtifactError(
            f"{artifact} has no {MANIFEST}: it is not an artifact, or its preparation did not finish; "
            "rerun `moeprep prepare`"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); the artifact is corrupt, prepare it again") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a {FORMAT} manifest")
    version = raw.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ArtifactError(
            f"{path} has schema_version {version!r}; this loader reads schema_version {SCHEMA_VERSION}. "
            "Prepare the artifact again with a matching moeprep, or upgrade the loader"
        )
    for key in ("files", "moe", "stores", "producer", "source_model", "recipe"):
        if key not in raw:
            raise ArtifactError(f"{path} lacks the key {key!r}; the artifact is corrupt, prepare it again")
    return Manifest(raw)


def check_sizes(artifact: str | Path, manifest: Manifest) -> None:
    """Every listed file exists with its recorded size (cheap; run on every load)."""
    artifact = Path(artifact)
    problems = []
    for name, entry in manifest.files.items():
        path = artifact / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, manifest says {entry['bytes']} (truncated or replaced)")
    if problems:
        raise ArtifactError(f"artifact {artifact} is damaged: " + "; ".join(problems)
                            + ". Copy it again or rerun `moeprep prepare`")


def verify(artifact: str | Path) -> list[str]:
    """Full check: schema, sizes and every sha256. Returns one line per bad file (empty when sound)."""
    artifact = Path(artifact)
    try:
        manifest = read_manifest(artifact)
    except ArtifactError as e:
        return [f"{MANIFEST}: {e}"]
    bad = []
    for name, entry in sorted(manifest.files.items()):
        path = artifact / name
        if not path.is_file():
            bad.append(f"{name}: missing")
        elif path.stat().st_size != entry["bytes"]:
            bad.append(f"{name}: size {path.stat().st_size}, expected {entry['bytes']}")
        elif sha256_file(path) != entry["sha256"]:
            bad.append(f"{name}: sha256 mismatch (content changed)")
    return bad


# ------------------------------------------------------------------------------- aligned safetensors


def write_aligned_records(path: Path, records: dict[str, bytes | memoryview], record_bytes: int) -> None:
    """Write uint8 records as a valid safetensors file whose every tensor starts on a 4 KiB boundary.

    Each record is padded to a multiple of 4 KiB; the JSON header is padded with spaces (allowed by the
    safetensors format) so the data section starts on a boundary too.
    """
    stride = -(-record_bytes // ALIGN) * ALIGN
    header: dict = {"__metadata__": {"record_bytes": str(record_bytes), "stride": str(stride)}}
    for i, key in enumerate(records):
        header[key] = {"dtype": "U8", "shape": [stride], "data_offsets": [i * stride, (i + 1) * stride]}
    text = json.dumps(header, separators=(",", ":")).encode()
    total = 8 + len(text)
    text += b" " * ((-total) % ALIGN)
    pad = bytes(stride - record_bytes)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for record in records.values():
            if len(record) != record_bytes:
                raise ValueError(f"record of {len(record)} bytes in a store of {record_bytes}-byte records")
            f.write(record)
            f.write(pad)


def read_record_offsets(path: Path) -> tuple[dict[str, int], int, int]:
    """{tensor name: absolute file offset}, record bytes and stride of an aligned record store."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ArtifactError(f"{path.name} is truncated (no safetensors header); copy the artifact again")
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    if len(raw) < n:
        raise ArtifactError(f"{path.name} is truncated (header cut short); copy the artifact again")
    try:
        header = json.loads(raw)
    except json.JSONDecodeError:
        raise ArtifactError(f"{path.name} has a corrupt header; run `moeload verify` and copy the artifact again") from None
    meta = header.pop("__metadata__", {})
    base = 8 + n
    offsets = {name: base + entry["data_offsets"][0] for name, entry in header.items()}
    return offsets, int(meta["record_bytes"]), int(meta["stride"])
