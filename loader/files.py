"""Atomic file writes: the one helper every writer in both packages uses.

A file is written to a temporary sibling, flushed to disk, then renamed over its target, so a reader
(or a run killed at any moment) sees either the old file or the new one, never a torn one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_bytes_atomic(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` in one rename; the temporary name is unique per process."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    write_bytes_atomic(path, text.encode())


def write_json_atomic(path: str | Path, obj, indent: int | None = 2, sort_keys: bool = False) -> None:
    """JSON (with a trailing newline) written atomically."""
    write_text_atomic(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")
