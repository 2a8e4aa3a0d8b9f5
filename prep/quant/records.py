"""The encoding side of expert records: packing codes, joining parts into a record, writing stores.

The loader only decodes (``loader/codec.py``: unpacking, ``RecordLayout.split``/``decode``) and reads
stores (``loader/format.py``: ``read_record_offsets``); everything that produces those bytes lives here.

A store is uint8 records in a safetensors file whose every tensor starts on a 4 KiB boundary. Each
record is padded to a multiple of 4 KiB and the JSON header is padded with spaces (allowed by the
safetensors format) so the data section starts on a boundary too; O_DIRECT can then read a record
without a bounce copy. The xxh3_64 of each record goes into the manifest, so the loader can check every
record it reads at memory speed.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch
from xxhash import xxh3_64_intdigest

from loader.codec import CodecError, RecordLayout
from loader.format import ALIGN, block_hashes
from loader.io import atomic_file
from prep.errors import MoeprepError


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (any shape, values < 2**bits) -> flat uint8 bytes, little-endian within a byte.

    8, 4 and 2 bits pack 1, 2 and 4 codes per byte; 3 bits packs 8 codes into 3 bytes
    (``loader.codec.unpack_codes`` is the inverse).
    """
    flat = codes.reshape(-1).to(torch.int32)
    if bits == 8:
        return flat.to(torch.uint8)
    if bits in (4, 2):
        per = 8 // bits
        if flat.numel() % per:
            raise CodecError(f"{flat.numel()} codes do not fill whole bytes at {bits} bits")
        groups = flat.view(-1, per)
        out = torch.zeros(groups.shape[0], dtype=torch.int32)
        for i in range(per):
            out |= groups[:, i] << (bits * i)
        return out.to(torch.uint8)
    if bits == 3:
        if flat.numel() % 8:
            raise CodecError(f"{flat.numel()} codes are not a multiple of 8 at 3 bits")
        groups = flat.view(-1, 8)
        word = torch.zeros(groups.shape[0], dtype=torch.int32)
        for i in range(8):
            word |= groups[:, i] << (3 * i)
        return torch.stack([(word >> (8 * j)) & 0xFF for j in range(3)], dim=1).reshape(-1).to(torch.uint8)
    raise CodecError(f"unsupported bit-width {bits}")


def join_record(layout: RecordLayout, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """Record parts (named as ``layout.parts()``) -> one uint8 record of ``layout.nbytes``."""
    record = torch.zeros(layout.nbytes, dtype=torch.uint8)
    for name, _dtype, offset, size in layout.parts():
        raw = parts[name].contiguous().reshape(-1).view(torch.uint8)
        if raw.numel() != size:
            raise CodecError(f"record part {name}: {raw.numel()} bytes, layout says {size}")
        record[offset : offset + size] = raw
    return record


def write_aligned_records(path: Path, records: dict[str, bytes | memoryview], record_bytes: int,
                          blocks: list | None = None) -> dict[str, int]:
    """Write ``records`` (name -> exactly ``record_bytes`` bytes) to ``path``; returns {name: xxh3_64}. ``blocks``:
    a list to append each record's per-4 KiB-block hashes to (``loader.format.block_hashes``), in record order."""
    stride = -(-record_bytes // ALIGN) * ALIGN
    header: dict = {"__metadata__": {"record_bytes": str(record_bytes), "stride": str(stride)}}
    for i, key in enumerate(records):
        header[key] = {"dtype": "U8", "shape": [stride], "data_offsets": [i * stride, (i + 1) * stride]}
    text = json.dumps(header, separators=(",", ":")).encode()
    total = 8 + len(text)
    text += b" " * ((-total) % ALIGN)
    pad = bytes(stride - record_bytes)
    hashes = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for key, record in records.items():
            if len(record) != record_bytes:
                raise MoeprepError(f"record {key} has {len(record)} bytes in a store of {record_bytes}-byte "
                                   "records; the quantize stage result is damaged, rerun with --force quantize")
            hashes[key] = xxh3_64_intdigest(record)
            if blocks is not None:
                blocks.append(block_hashes(record))
            f.write(record)
            f.write(pad)
        f.flush()
        os.fsync(f.fileno())
    return hashes


def write_record_file(path: Path, keys: list[str], record_bytes: int, records) -> None:
    """A plain safetensors file of uint8 records ``[record_bytes]`` named ``keys``, written as ``records``
    (an iterable of uint8 tensors, in ``keys`` order) comes, so one record at a time is in memory; atomic.
    (The quantize stage's per-layer files: ``safe_open(...).get_tensor(key)`` reads one back.)"""
    header = {key: {"dtype": "U8", "shape": [record_bytes], "data_offsets": [i * record_bytes, (i + 1) * record_bytes]}
              for i, key in enumerate(keys)}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((-len(text)) % 8)
    written = 0
    with atomic_file(path) as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for record in records:
            data = record.contiguous().view(torch.uint8).numpy().tobytes()
            if len(data) != record_bytes:
                raise MoeprepError(f"record {keys[written]} has {len(data)} bytes, the layout says {record_bytes}")
            f.write(data)
            written += 1
        if written != len(keys):
            raise MoeprepError(f"{written} records written for {len(keys)} names")
