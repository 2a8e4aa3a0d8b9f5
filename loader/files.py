"""Atomic file writes: the one helper every writer in both packages uses.

A file is written to a temporary sibling, flushed to disk, then renamed over its target, so a reader
(or a run killed at any moment) sees either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


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
