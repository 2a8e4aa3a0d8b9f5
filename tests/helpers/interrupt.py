"""Kill a preparation at a chosen point and resume it: the one skeleton the interruption tests share.

In-process, ``interrupted(monkeypatch, owner, name, ...)`` replaces ``owner.name`` with a function that dies at
one call (the n-th, or the first whose arguments match), expects the death from the ``with`` body and puts the
real function back, so the test goes on to resume and compare. The death is a ``KeyboardInterrupt`` (Ctrl-C),
``Killed`` (a BaseException nothing in prep catches, so no cleanup runs: a SIGKILL at that exact step), any
other exception (a lost worker), or, with ``raising=None``, ``os._exit(1)`` of a forked worker process.
Across processes, ``sigkill`` kills a real process (or its whole group) at a moment the test picks from outside.
``uninterrupted`` prepares the same recipe in a fresh root, and ``stage_files`` fingerprints a root's stage
cache and artifact: what a resumed run is compared with."""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from prep.pipeline import prepare
from tests.helpers.tiny_models import save_tiny_model


class Killed(BaseException):
    """Stands for a kill at one exact step: nothing catches it, so no cleanup code runs."""


def dying(real: Callable, *, on_call: int | None = None, when: Callable | None = None,
          raising: type[BaseException] | None = KeyboardInterrupt) -> Callable:
    """``real`` wrapped to die at one call: the ``on_call``-th (counted from 1), or each call for which
    ``when(*args)`` (its positional arguments) says so: "after" dies right after the real call, any other true answer right
    before it. With neither, it never dies. ``raising=None`` ends the process at once (``os._exit(1)``)."""
    calls = {"n": 0}

    def die() -> None:
        if raising is None:
            os._exit(1)
        raise raising(getattr(real, "__name__", "call"))

    def wrapped(*args, **kwargs):
        calls["n"] += 1
        moment = when(*args) if when is not None else calls["n"] == on_call
        if moment and moment != "after":
            die()
        out = real(*args, **kwargs)
        if moment == "after":
            die()
        return out

    return wrapped


@contextmanager
def interrupted(monkeypatch: pytest.MonkeyPatch, owner, names: str | tuple[str, ...], *,
                raising: type[BaseException] = KeyboardInterrupt, **at) -> Iterator[None]:
    """``owner.<name>`` (each of ``names``) dies as ``dying(..., **at)`` says while the ``with`` body runs; the
    body must die of it (``pytest.raises``), and the real functions are back once the block is left."""
    with monkeypatch.context() as patch:
        for name in (names,) if isinstance(names, str) else names:
            patch.setattr(owner, name, dying(getattr(owner, name), raising=raising, **at))
        with pytest.raises(raising):
            yield


def sigkill(pid: int, *, group: bool = False) -> bool:
    """SIGKILL the process ``pid`` (with ``group``, its whole process group); False if it had already ended."""
    try:
        (os.killpg if group else os.kill)(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def uninterrupted(tmp_path_factory, recipe, arch: str = "qwen3_moe", **prepare_args) -> tuple[Path, dict]:
    """``recipe`` prepared without interruption in a root holding the tiny ``arch``: (root, summary). The clean run
    every interrupted one is compared with: prepared once per run for each (recipe, arch, arguments) and shared
    read-only (``tests.helpers.shared``; copy the root before changing it)."""
    from tests.helpers.shared import shared_store

    key = hashlib.sha256(repr((recipe, arch, sorted(prepare_args.items()))).encode()).hexdigest()[:16]

    def build(root: Path) -> None:
        save_tiny_model(arch, root / "model")
        (root / "summary.json").write_text(json.dumps(prepare(recipe, root=root, **prepare_args)))

    root = shared_store(tmp_path_factory).get(f"clean-{arch}-{key}", build)
    return root, json.loads((root / "summary.json").read_text())


TIMINGS = ("seconds", "crossover_measured")  # measured on this machine's clock and disk, never the same twice


def _untimed(value):
    """A JSON value without its timings, at any depth."""
    if isinstance(value, dict):
        return {k: _untimed(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_untimed(v) for v in value]
    return value


def stage_files(root: Path) -> dict[str, str]:
    """{path: sha256} of every file of every stage directory and of the artifact (``artifact`` links to its
    versioned directory), JSON without its timings: report.json, and so the manifest's digests of it, hold the
    sweep's seconds, so for the manifest its other fields (package_key, record stores, files) are compared."""
    out = {}
    artifacts = root / "artifacts"
    files = [(p, str(p.relative_to(artifacts))) for p in sorted(artifacts.rglob("*"))
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(artifacts).parts)]
    for link in sorted(artifacts.glob("*/artifact")):
        files += [(p, str(link.relative_to(artifacts) / p.relative_to(link.resolve())))
                  for p in sorted(link.resolve().rglob("*")) if p.is_file()]
    for path, name in files:
        if path.suffix == ".journal":  # Optuna's log of the search: when each trial ran, and in which process
            continue  # (its trials, their values and the choice are in tune_policy's result.json, compared)
        data = path.read_bytes()
        if path.suffix == ".json":
            raw = _untimed(json.loads(data))
            if path.name == "manifest.json":
                raw.pop("digest")
                for timed in ("report.json", "report.md"):
                    raw["files"].pop(timed)
            data = json.dumps(raw, sort_keys=True).encode()
        out[name] = hashlib.sha256(data).hexdigest()
    return out
