"""Reused files are checked before they are trusted: the stage cache and the work units of an interrupted run.

A file moeprep reuses (a finished work unit's file after a killed run; a cached stage's directory on a rerun) is
only a cache of a computation, so a damaged one (truncated, swapped, a flipped byte) must never reach an
artifact, whose own hashes would then vouch for the damage. Each is sealed with an xxh3_64 (memory speed) when
it is written:

- a unit file ``out`` by a hidden sidecar ``.<name>.xxh3`` beside it, written before the file is renamed into
  place, so a unit file without its sidecar was written before the seals or by hand;
- a stage directory by a hidden ``.seal.json`` beside its ``result.json``: the hash of every file in it,
  ``result.json``'s included, written just before ``result.json``.

On reuse a mismatch is not an error: the cache is recomputed, and a notice names the file.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from xxhash import xxh3_64

SIDECAR = ".xxh3"
_CHUNK = 8 << 20


def notice(message: str) -> None:
    """One line on stderr that leaves the progress bars intact."""
    from tqdm import tqdm

    tqdm.write(f"moeprep: {message}", file=sys.stderr)


def file_xxh3(path: str | Path) -> str:
    """The xxh3_64 of a file's bytes, in hex."""
    h = xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


# ------------------------------------------------------------------------------------------- unit files


def sidecar(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(f".{out.name}{SIDECAR}")


def seal_unit(written: Path, out: Path) -> None:
    """Seal the unit file ``written`` (a temporary) that will be renamed to ``out``: its sidecar goes first."""
    mark = sidecar(out)
    tmp = mark.with_name(f"{mark.name}.tmp-{os.getpid()}")
    tmp.write_text(file_xxh3(written) + "\n")
    os.replace(tmp, mark)


def unit_damage(out: str | Path) -> str | None:
    """Why the finished unit file ``out`` may not be reused (None: it is what its unit wrote)."""
    out = Path(out)
    try:
        want = sidecar(out).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return f"{out.name} has no seal (written before the seals, or put there by hand)"
    if file_xxh3(out) != want:
        return f"{out.name} is not what its unit wrote (its xxh3 differs: truncated, replaced or changed)"
    return None


def drop_unit(out: str | Path) -> None:
    """Remove a unit file and its seal, so the unit runs again."""
    Path(out).unlink(missing_ok=True)
    sidecar(out).unlink(missing_ok=True)


def seal_tree(directory: str | Path, mark: str | Path) -> None:
    """Seal a finished directory a stage builds in its work directory (the merged trace) in the file ``mark``."""
    from loader.io import write_json_atomic

    write_json_atomic(Path(mark), {"files": directory_hashes(directory)}, sort_keys=True)


def tree_damage(directory: str | Path, mark: str | Path) -> str | None:
    """Why the directory sealed by ``seal_tree`` in ``mark`` may not be reused (None: it is as sealed)."""
    try:
        files = json.loads(Path(mark).read_text())["files"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        return f"{Path(directory).name} has no readable seal"
    return None if directory_hashes(directory) == files else f"{Path(directory).name} is not what was sealed"


# ------------------------------------------------------------------------------------------ stage files

SEAL = ".seal.json"  # in a stage directory: {"files": {relative path: xxh3}}, result.json's included


def directory_hashes(directory: str | Path) -> dict[str, str]:
    """{path relative to ``directory``: xxh3} of every file in it but its seal."""
    directory = Path(directory)
    return {p.relative_to(directory).as_posix(): file_xxh3(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and p.relative_to(directory).as_posix() != SEAL}


def seal_directory(directory: str | Path, result_name: str, result_text: str) -> None:
    """Seal a stage directory whose ``result_name`` (written next, last) will hold ``result_text``."""
    from loader.io import write_json_atomic

    files = directory_hashes(directory)
    files.pop(result_name, None)
    files[result_name] = xxh3_64(result_text.encode()).hexdigest()
    write_json_atomic(Path(directory) / SEAL, {"files": files}, sort_keys=True)


def stage_damage(directory: str | Path) -> str | None:
    """Why the cached stage ``directory`` may not be reused (None: every file is the one its run sealed)."""
    directory = Path(directory)
    try:
        files = json.loads((directory / SEAL).read_text())["files"]
        if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
            raise ValueError("not {path: xxh3}")
    except FileNotFoundError:
        return f"it has no {SEAL} (written before the stage cache was sealed, or damaged)"
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        return f"its {SEAL} cannot be read ({e})"
    found = directory_hashes(directory)
    for name, want in sorted(files.items()):
        if name not in found:
            return f"file {name} is missing"
        if found[name] != want:
            return f"file {name} is not what the stage wrote (its xxh3 differs: truncated, replaced or changed)"
    if extra := sorted(set(found) - set(files)):
        return f"file {extra[0]} was not written by the stage"
    return None
