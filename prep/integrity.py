"""Reused files are checked before they are trusted: the stage cache and the work units of an interrupted run.

A file moeprep reuses (a finished work unit's file after a killed run; a cached stage's directory on a rerun) is
only a cache of a computation, so a damaged one (truncated, swapped, a flipped byte) must never reach an
artifact, whose own hashes would then vouch for the damage. Each is sealed with an xxh3_64 (memory speed) when
it is written, and the seal says what the file is, not only what its bytes are:

- a unit file ``out`` by a hidden sidecar ``.<name>.xxh3`` beside it, written before the file is renamed into
  place: the file's xxh3 and what wrote it (stage, stage key, unit name, file name), so a unit file copied over
  another unit's together with its sidecar is refused; a unit file without its sidecar, or with a sidecar of an
  older moeprep (a bare hash that does not say which unit wrote it), is stale;
- a stage directory by a hidden ``.seal.json`` beside its ``result.json``: the stage and key it was written for
  and the hash of every file in it, ``result.json``'s included, written just before ``result.json``.

A seal's hash proves the bytes are the ones sealed, not that they are sane (a seal can be recomputed), so the
values read back are checked too: every number in a JSON file finite, every float tensor of a safetensors file
finite. A link that leaves the stage cache's ``artifacts/<name>/``, a seal or a file that is not a regular file
(a FIFO would block the reader), a seal nested too deep: each is damage, never a hang or a traceback.

On reuse a mismatch is not an error: the cache is recomputed, and a notice names the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from xxhash import xxh3_64

SIDECAR = ".xxh3"
SEAL_FORMAT = 2  # 1 (never written as such): a bare hash, bound to nothing
UNIT_TEMPORARIES = ".unit-tmp"  # in a work directory: where units write before the rename; never merged or sealed
_CHUNK = 8 << 20
_SEAL_BYTES = 256 << 20  # a stage with a million files still fits
_JSON_BYTES = 1 << 30
_DEPTH = 64  # deeper than any file moeprep writes; a deeper one is refused before anything walks it


class Unreadable(ValueError):
    """A seal or JSON file that cannot be read as one: not a regular file, too large, too deep, not JSON."""


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


def read_json(path: str | Path, limit: int = _SEAL_BYTES):
    """The JSON in ``path``, read only when it is a regular file (not a link, FIFO, device or directory: the
    type is checked before the file is opened, and opened without blocking) of at most ``limit`` bytes, nested at
    most ``_DEPTH`` deep. Raises FileNotFoundError when absent, else ``Unreadable`` saying why."""
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise Unreadable("it is a link" if stat.S_ISLNK(info.st_mode) else "it is not a regular file")
    if info.st_size > limit:
        raise Unreadable(f"it holds {info.st_size} bytes, more than {limit}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise Unreadable(f"it cannot be opened ({e.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # swapped between the lstat and the open
            raise Unreadable("it is not a regular file")
        data = f.read(limit + 1)
    try:
        value = json.loads(data)
    except RecursionError:
        raise Unreadable(f"it is nested deeper than {_DEPTH} levels") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise Unreadable(f"it is not JSON ({e})") from None
    if _too_deep(value):
        raise Unreadable(f"it is nested deeper than {_DEPTH} levels")
    return value


def _too_deep(value) -> bool:
    todo = [(value, 0)]
    while todo:
        item, depth = todo.pop()
        if depth > _DEPTH:
            return True
        if isinstance(item, (dict, list)):
            todo += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return False


def value_problem(value) -> str | None:
    """Why a JSON value cannot be trusted as a result (a number that is not finite, or nesting deeper than
    ``_DEPTH``); None when it can. Walks without recursion, so no input makes it raise."""
    todo = [(value, "", 0)]
    while todo:
        item, where, depth = todo.pop()
        if depth > _DEPTH:
            return f"it is nested deeper than {_DEPTH} levels"
        if isinstance(item, float) and not math.isfinite(item):
            return f"{where or 'a value'} is {item} (not a finite number)"
        if isinstance(item, dict):
            todo += [(v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in item.items()]
        elif isinstance(item, list):
            todo += [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(item)]
    return None


def tensors_problem(path: str | Path) -> str | None:
    """Why the float tensors of a safetensors file cannot be trusted (one holds a NaN or an infinity, or the file
    cannot be read); None when every one is finite. Integer tensors (packed records) are not looked at."""
    import torch
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if f.get_slice(name).get_dtype() not in ("F8_E5M2", "F8_E4M3", "F16", "BF16", "F32", "F64"):
                    continue
                tensor = f.get_tensor(name)
                if tensor.element_size() == 1:
                    tensor = tensor.float()
                if not bool(torch.isfinite(tensor).all()):
                    return f"tensor {name} holds a value that is not finite"
    except Exception as e:  # noqa: BLE001 (the sealed bytes are not a safetensors file: damage, not a crash)
        return f"it cannot be read as safetensors ({type(e).__name__})"
    return None


def contents_problem(path: Path) -> str | None:
    """Why the values in a reused file cannot be trusted, by its kind: JSON numbers and safetensors float
    tensors are checked for finiteness; a file of another kind is only hashed."""
    if path.suffix == ".json":
        try:
            return value_problem(read_json(path, _JSON_BYTES))
        except (OSError, Unreadable) as e:
            return f"it cannot be read ({e})"
    if path.suffix == ".safetensors":
        return tensors_problem(path)
    return None


# ------------------------------------------------------------------------------------------- unit files


def sidecar(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(f".{out.name}{SIDECAR}")


def unit_binding(stage: str, unit: str, file: str, key: str | None = None) -> dict:
    """What a unit seal binds the bytes to: the stage, its key (None outside the pipeline, e.g. a study), the unit's
    name (its index within the stage) and its file's path in the work directory."""
    return {"stage": stage, "key": key, "unit": unit, "file": file}


def _describe(bound) -> str:
    if not isinstance(bound, dict):
        return "something else"
    key = f" (key {str(bound.get('key'))[:16]})" if bound.get("key") else ""
    return f"unit {bound.get('unit')} of stage {bound.get('stage')}{key}, as {bound.get('file')}"


def seal_unit(written: Path, out: Path, bound: dict) -> None:
    """Seal the unit file ``written`` (a temporary) that will be renamed to ``out``, as written by ``bound``
    (``unit_binding``): its sidecar goes first, through a temporary beside ``written``."""
    mark = sidecar(out)
    tmp = Path(written).with_name(f"{Path(written).name}.seal-{os.getpid()}")
    tmp.write_text(json.dumps({"seal": SEAL_FORMAT, "bound": bound, "xxh3": file_xxh3(written)}, sort_keys=True) + "\n")
    os.replace(tmp, mark)


def unit_damage(out: str | Path, bound: dict) -> str | None:
    """Why the finished unit file ``out`` may not be reused as the file of ``bound`` (``unit_binding``); None: it is
    what that unit wrote, and its values are finite."""
    out = Path(out)
    try:
        info = os.lstat(out)
    except OSError:
        return f"{out.name} is missing"
    if stat.S_ISLNK(info.st_mode):
        return f"{out.name} is a link (to {os.readlink(out)}), not the file its unit wrote"
    if not stat.S_ISREG(info.st_mode):
        return f"{out.name} is not a regular file"
    try:
        seal = read_json(sidecar(out), 1 << 16)
    except FileNotFoundError:
        return f"{out.name} has no seal (written before the seals, or put there by hand)"
    except (OSError, Unreadable) as e:
        return f"{out.name}'s seal cannot be read ({e})"
    if not isinstance(seal, dict) or seal.get("seal") != SEAL_FORMAT:
        return f"{out.name}'s seal is an older moeprep's, which does not say which unit wrote it"
    if seal.get("bound") != bound:
        return (f"{out.name} was sealed as the file of {_describe(seal.get('bound'))}, not of {_describe(bound)} "
                "(copied over with its seal)")
    if file_xxh3(out) != seal.get("xxh3"):
        return f"{out.name} is not what its unit wrote (its xxh3 differs: truncated, replaced or changed)"
    if (problem := contents_problem(out)) is not None:
        return f"{out.name} cannot be trusted: {problem}"
    return None


def drop_unit(out: str | Path) -> None:
    """Remove a unit file (a link: the link, never what it points to) and its seal, so the unit runs again."""
    Path(out).unlink(missing_ok=True)
    sidecar(out).unlink(missing_ok=True)


def unit_temporary(work: str | Path, output: str) -> Path:
    """Where a unit of ``work`` writes its file ``output`` before the rename: in ``UNIT_TEMPORARIES``, which no
    merge and no seal takes, named by this process (a worker killed mid-write leaves it there, removed later)."""
    folder = Path(work) / UNIT_TEMPORARIES
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{hashlib.sha256(output.encode()).hexdigest()[:16]}-{os.getpid()}"


def drop_temporaries(work: str | Path) -> None:
    """Remove what units killed mid-write left in ``work``: ``UNIT_TEMPORARIES``, and the temporaries an older
    moeprep wrote beside the unit files (``.<name>.unit-<pid>``, ``.<name>.xxh3.tmp-<pid>``)."""
    work = Path(work)
    folder = work / UNIT_TEMPORARIES
    if folder.is_dir() and not folder.is_symlink():
        shutil.rmtree(folder, ignore_errors=True)
    elif folder.is_symlink() or folder.exists():  # a link or a file in its place: only the name goes
        folder.unlink()
    for pattern in (".*.unit-*", f".*{SIDECAR}.tmp-*"):
        for tmp in work.rglob(pattern):
            tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------ stage files

SEAL = ".seal.json"  # in a stage directory: {"seal": 2, "bound": {stage, key}, "files": {relative path: xxh3}}


def walk_entries(directory: Path) -> Iterator[tuple[str, Path]]:
    """(path relative to ``directory``, path) of everything under it, links not followed."""
    for top, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(top) / name
            yield path.relative_to(directory).as_posix(), path


def links_leaving(directory: str | Path, inside: str | Path) -> str | None:
    """Why ``directory`` (or a file or folder in it) cannot be read as part of ``inside``: a link that points
    outside it (or dangles), or a file that is not a regular file; None when neither."""
    directory, base = Path(directory), Path(inside).resolve()
    for rel, path in [(".", directory), *walk_entries(directory)]:
        if path.is_symlink():
            target = path.resolve()
            if not target.is_relative_to(base) or not target.exists():
                what = "the stage directory" if rel == "." else rel
                return f"{what} is a link to {target}, outside {base}"
            path = target
        mode = path.stat().st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            return f"{rel} is not a regular file"
    return None


def directory_hashes(directory: str | Path) -> dict[str, str]:
    """{path relative to ``directory``: xxh3} of every regular file in it but its seal and unit temporaries (links
    to files followed, links to folders not)."""
    directory = Path(directory)
    return {rel: file_xxh3(path) for rel, path in sorted(walk_entries(directory))
            if rel != SEAL and not rel.startswith(f"{UNIT_TEMPORARIES}/") and path.is_file()
            and stat.S_ISREG(path.stat().st_mode)}


def seal_tree(directory: str | Path, mark: str | Path) -> None:
    """Seal a finished directory a stage builds in its work directory (the merged trace) in the file ``mark``."""
    from loader.io import write_json_atomic

    write_json_atomic(Path(mark), {"seal": SEAL_FORMAT, "bound": {"directory": Path(directory).name},
                                   "files": directory_hashes(directory)}, sort_keys=True)


def tree_damage(directory: str | Path, mark: str | Path) -> str | None:
    """Why the directory sealed by ``seal_tree`` in ``mark`` may not be reused (None: it is as sealed)."""
    directory = Path(directory)
    try:
        seal = read_json(mark)
    except (OSError, Unreadable):
        return f"{directory.name} has no readable seal"
    if not isinstance(seal, dict) or seal.get("bound") != {"directory": directory.name}:
        return f"{directory.name}'s seal is not its own (or an older moeprep's)"
    if (problem := links_leaving(directory, directory)) is not None:
        return problem
    return None if directory_hashes(directory) == seal.get("files") else f"{directory.name} is not what was sealed"


def seal_directory(directory: str | Path, result_name: str, result_text: str, bound: dict) -> None:
    """Seal a stage directory whose ``result_name`` (written next, last) will hold ``result_text``, as the output
    of ``bound`` ({stage, key})."""
    from loader.io import write_json_atomic

    files = directory_hashes(directory)
    files.pop(result_name, None)
    files[result_name] = xxh3_64(result_text.encode()).hexdigest()
    write_json_atomic(Path(directory) / SEAL, {"seal": SEAL_FORMAT, "bound": bound, "files": files}, sort_keys=True)


def stage_damage(directory: str | Path, bound: dict | None = None, inside: str | Path | None = None) -> str | None:
    """Why the cached stage ``directory`` may not be reused as the output of ``bound`` ({stage, key}; None: the
    seal's own) with nothing read from outside ``inside`` (default: the directory itself); None: every file is the
    one its run sealed, and every value in its JSON and safetensors files is finite."""
    directory = Path(directory)
    if (problem := links_leaving(directory, directory.parent if inside is None else inside)) is not None:
        return problem
    try:
        seal = read_json(directory / SEAL)
        files = seal["files"] if isinstance(seal, dict) else None
        if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())):
            raise Unreadable("it is not {path: xxh3}")
    except FileNotFoundError:
        return f"it has no {SEAL} (written before the stage cache was sealed, or damaged)"
    except (OSError, Unreadable, KeyError) as e:
        return f"its {SEAL} cannot be read ({e})"
    if seal.get("seal") != SEAL_FORMAT:
        return f"its {SEAL} is an older moeprep's, which does not say which stage and key it holds"
    if bound is not None and seal.get("bound") != bound:
        return f"it was sealed as the output of {seal.get('bound')}, not of {bound} (copied or renamed)"
    found = directory_hashes(directory)
    for name, want in sorted(files.items()):
        if name not in found:
            return f"file {name} is missing"
        if found[name] != want:
            return f"file {name} is not what the stage wrote (its xxh3 differs: truncated, replaced or changed)"
    if extra := sorted(set(found) - set(files)):
        return f"file {extra[0]} was not written by the stage"
    for name in sorted(files):
        if (problem := contents_problem(directory / name)) is not None:
            return f"file {name} cannot be trusted: {problem}"
    return None
