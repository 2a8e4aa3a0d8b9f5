"""Files: atomic writes (the one helper every writer in both packages uses) and the safetensors header and
record-offset readers every reader of an artifact goes through.

A file is written to a temporary sibling, flushed to disk, then renamed over its target, so a reader
(or a run killed at any moment) sees either the old file or the new one, never a torn one. A
safetensors header is read bounded by the file's real size, so a damaged length field is an error, not
an allocation.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from loader.errors import PREPARE_AGAIN as _PREPARE_AGAIN
from loader.errors import ArtifactError, disk_error


@contextmanager
def atomic_file(path: str | Path) -> Iterator[BinaryIO]:
    """A binary file to write ``path`` through: a temporary sibling (unique per process), flushed and renamed
    over ``path`` when the block ends, removed if it raises."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise (disk_error(e, path) or e) from None
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` in one rename."""
    with atomic_file(path) as f:
        f.write(data)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj, indent: int | None = 2, sort_keys: bool = False) -> None:
    """JSON (with a trailing newline) written atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


ST_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100_000_000  # the safetensors format's own limit


def replace_directory(built: str | Path, final: str | Path) -> None:
    """Put the finished directory ``built`` at ``final``. An old ``final`` is renamed aside first and removed only
    once the new one is in place, so ``final`` is the old complete directory or the new one (a kill between the
    two renames leaves the old one beside it as ``.<name>.old-<pid>``)."""
    built, final = Path(built), Path(final)
    aside = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(built, final)
    shutil.rmtree(aside, ignore_errors=True)


def hold_for_reading(directory: str | Path) -> int:
    """A shared ``flock`` on an artifact's version directory for as long as the returned descriptor is open: a
    ``prepare`` that publishes a new version removes this one only once no reader holds it. Close the
    descriptor (``os.close``) to let go; a killed process lets go by itself."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError:
        os.close(fd)
        raise
    return fd


def unread(directory: str | Path) -> bool:
    """Whether no reader holds ``directory`` (``hold_for_reading``), tested without waiting; a directory that is
    gone counts as unread."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@contextmanager
def building_directory(final: str | Path) -> Iterator[Path]:
    """An empty temporary directory beside ``final`` (unique per process) to build it in: when the block ends it
    replaces ``final`` (``replace_directory``); if the block raises it is removed and ``final`` is untouched."""
    final = Path(final)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        replace_directory(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


# ------------------------------------------------------------------------------ safetensors headers


def read_safetensors_header(path: Path, name: str | None = None) -> tuple[dict, dict, int]:
    """(tensors {name: {dtype, shape, data_offsets}}, metadata, data start) of a safetensors file.

    Checks what the safetensors format requires, bounded by the file's real size (a length field that
    claims 2**60 bytes is an error, not an allocation): a JSON object of known dtypes, shapes and
    offsets whose tensors tile the data section exactly.
    """
    name = name or path.name

    def fail(what: str) -> ArtifactError:
        return ArtifactError(f"{path}: {what}; the file is damaged: {_PREPARE_AGAIN}", file=name)

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise fail("truncated (no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > MAX_HEADER_BYTES:
                raise fail(f"its header length field says {n:,} bytes, the file has {size:,}")
            raw = f.read(n)
    except OSError as e:
        raise ArtifactError(f"cannot read {path} ({e.strerror or e}); {_PREPARE_AGAIN}", file=name) from None
    if len(raw) < n:
        raise fail("truncated (header cut short)")
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise fail("its header is not valid JSON") from None
    if not isinstance(header, dict):
        raise fail("its header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise fail("its __metadata__ is not a map of strings")
    spans = []
    for key, entry in header.items():
        if (not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}
                or not isinstance(entry["dtype"], str) or entry["dtype"] not in ST_DTYPES
                or not isinstance(entry["shape"], list)
                or not all(_is_int(s) and s >= 0 for s in entry["shape"])
                or not isinstance(entry["data_offsets"], list) or len(entry["data_offsets"]) != 2
                or not all(_is_int(o) for o in entry["data_offsets"])):
            raise fail(f"tensor {key!r} has a malformed entry {json.dumps(entry)[:100]}")
        begin, end = entry["data_offsets"]
        numel = 1
        for s in entry["shape"]:
            numel *= s
        if not 0 <= begin <= end or end - begin != numel * ST_DTYPES[entry["dtype"]]:
            raise fail(f"tensor {key!r}: offsets {entry['data_offsets']} do not hold its shape and dtype")
        spans.append((begin, end, key))
    position = 0
    for begin, end, key in sorted(spans):
        if begin != position:
            raise fail(f"tensor {key!r} starts at {begin}, expected {position} (overlapping or missing data)")
        position = end
    if 8 + n + position != size:
        raise fail(f"its tensors end at byte {8 + n + position:,}, the file has {size:,}")
    return header, meta, 8 + n


def read_record_offsets(path: Path) -> tuple[dict[str, int], int, int]:
    """{record key: absolute file offset}, record bytes and stride of an aligned record store."""
    header, meta, start = read_safetensors_header(path)
    try:
        record_bytes, stride = int(meta["record_bytes"]), int(meta["stride"])
    except (KeyError, ValueError):
        raise ArtifactError(f"{path}: its __metadata__ lacks integer record_bytes and stride; {_PREPARE_AGAIN}",
                            file=path.name) from None
    return {key: start + entry["data_offsets"][0] for key, entry in header.items()}, record_bytes, stride


MAX_JSON_DEPTH = 64  # nesting no file of either package comes near (a manifest is 5 deep); deeper is damage


def json_depth(value) -> int:
    """How deeply ``value`` (parsed JSON) nests lists and objects: 0 for a scalar. Iterative, so any depth counts."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def parse_json(data: bytes | str, max_depth: int = MAX_JSON_DEPTH):
    """JSON text as a value, nested at most ``max_depth`` deep; ValueError saying why not (invalid JSON, not UTF-8,
    or nested deeper: Python's parser recurses, so a deep file must be one clear error, not a RecursionError)."""
    try:
        value = json.loads(data)
    except RecursionError:
        raise ValueError(f"nested deeper than {max_depth} levels") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if json_depth(value) > max_depth:
        raise ValueError(f"nested deeper than {max_depth} levels")
    return value
