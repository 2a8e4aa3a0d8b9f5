"""The artifact's hashes, what each one is and how data is checked against it.

Three kinds, each defined once here (``loader/format.py`` names where the manifest keeps them, and re-exports
the writers' functions so ``prep`` takes the schema from one module):

- sha256 of every file (``sha256_file``): the manifest's ``files`` table;
- xxh3_64 of every record (``check_record``): a store's ``xxh3`` table, checked as each record is read;
- xxh3_64 of every 4 KiB block of a neuron store's records (``block_hashes``): its block table
  (``read_block_table``), checked on every partial read. Each row of the table is bound to its record's xxh3_64
  (``bound_rows``: the table's ``bound`` column, checked against the manifest's record hashes when the table is
  read), so the rows a prompt reads in part are checked against hashes that belong to the record the manifest
  names: the block hashes cannot change without the record hash, nor the record hash without them.

xxh3 rather than crc32 for records and blocks: it runs at memory speed (8.7 GB/s on 4 KiB blocks here against
crc32's 2.8), so checking a miss costs a small share of reading it. This module sits below the manifest: the
functions that take a manifest use only its public attributes.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

from xxhash import xxh3_64_intdigest

from loader.errors import PREPARE_AGAIN as _PREPARE_AGAIN
from loader.errors import ArtifactError

BLOCK = 4096  # the unit of a partial read of a neuron record, each with its own hash (records start on one)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def block_hashes(record) -> list[int]:
    """xxh3_64 of each 4 KiB block of one record (bytes or a memoryview of exactly its bytes): the loader checks
    every block of a partial read on the reader threads, beside decoding."""
    view = memoryview(record)
    return [xxh3_64_intdigest(view[i:i + BLOCK]) for i in range(0, view.nbytes, BLOCK)]


def bound_rows(blocks, record_hashes) -> list[int]:
    """The block table's ``bound`` column: per record, the xxh3_64 of its row of block hashes (uint64 little-endian)
    followed by its record's xxh3_64 (8 bytes, little-endian). ``blocks``: [records, blocks] unsigned integers (a
    numpy array or lists); ``record_hashes``: the records' xxh3_64, in the same order."""
    import numpy as np

    rows = np.asarray(blocks, dtype="<u8")
    return [xxh3_64_intdigest(row.tobytes() + struct.pack("<Q", int(h)))
            for row, h in zip(rows, record_hashes, strict=True)]


def read_block_table(manifest, precision: str):
    """A neuron store's block hashes (``manifest``: a ``loader.format.Manifest``), checked against the store's
    shape and each row against its record's xxh3_64 in the manifest (``bound_rows``): (record key -> row, uint64
    numpy array [records, blocks]). The file's sha256 was checked with the other files by
    ``loader.artifact.open_artifact``."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    info = manifest.stores[precision]
    keys = manifest.store_keys(precision)
    name = info.blocks
    if name not in manifest.files:
        raise ArtifactError(f"{name} is not listed in the manifest; {_PREPARE_AGAIN}", file=name)
    try:
        tensors = load_file(str(manifest.path(name)))
    except (SafetensorError, OSError, ValueError) as e:
        raise ArtifactError(f"{name} cannot be read ({e}); {_PREPARE_AGAIN}", file=name) from None
    table, bound = tensors.get("blocks"), tensors.get("bound")
    if table is None or str(table.dtype) != "uint64" or tuple(table.shape) != (len(keys), info.block_count):
        got = None if table is None else (str(table.dtype), tuple(table.shape))
        raise ArtifactError(f"{name} must hold 'blocks', uint64 [{len(keys)}, {info.block_count}] (one hash per 4 KiB "
                            f"block of each record), it holds {got}; {_PREPARE_AGAIN}", file=name)
    if bound is None or str(bound.dtype) != "uint64" or tuple(bound.shape) != (len(keys),):
        got = None if bound is None else (str(bound.dtype), tuple(bound.shape))
        raise ArtifactError(f"{name} must hold 'bound', uint64 [{len(keys)}] (each row of block hashes bound to its "
                            f"record's xxh3_64; an artifact prepared before it has none), it holds {got}; "
                            f"{_PREPARE_AGAIN}", file=name)
    want = bound_rows(table, [info.xxh3[key] for key in keys])
    if bad := [key for key, got, w in zip(keys, bound.tolist(), want, strict=True) if got != w]:
        raise ArtifactError(f"record {bad[0]} of {manifest.root / info.file}: its block hashes in {name} are not "
                            "bound to its xxh3_64 in the manifest (the block table or the record hash changed "
                            f"without the other{f'; {len(bad)} records in all' if len(bad) > 1 else ''}), so a "
                            f"read of part of it cannot be trusted; {_PREPARE_AGAIN}", file=info.file)
    return {key: i for i, key in enumerate(keys)}, table


def check_record(manifest, precision: str, key: str, data) -> None:
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
