"""Things the suite builds once per run and every test reads: prepared artifacts, saved models, traces.

``Shared.get(key, build)`` returns the directory ``build`` filled, built at most once per run: under
pytest-xdist the workers share one directory beside their own temporary roots, and a file lock makes the second
worker wait for the first one's build instead of repeating it. The directory is read-only to the tests: its
files' hashes are recorded when it is built, a test that changes, adds or removes a file fails at its teardown
(sizes and modification times, checked after every test), and the run ends with the hashes checked again. A test
that changes an artifact copies it first (``tests.helpers.shared.writable_copy``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

SEAL = "shared-seal.json"


def _stats(directory: Path) -> dict[str, list[int]]:
    return {str(p.relative_to(directory)): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _hashes(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


class Shared:
    """The run's shared builds under ``root`` (one directory per key, and its seal beside it)."""

    def __init__(self, root: Path):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.used: dict[str, dict] = {}  # key -> its seal, for what this process handed out

    def get(self, key: str, build: Callable[[Path], object]) -> Path:
        """The directory of ``key``, made by ``build(directory)`` once per run (``build`` writes into the empty
        directory it is given; what it returns is ignored)."""
        directory, seal = self.root / key, self.root / f"{key}.{SEAL}"
        if key not in self.used:
            with FileLock(str(self.root / f"{key}.lock")):
                if not seal.is_file():
                    shutil.rmtree(directory, ignore_errors=True)  # a build that died half way
                    directory.mkdir(parents=True)
                    build(directory)
                    tmp = seal.with_suffix(".tmp")
                    tmp.write_text(json.dumps({"stats": _stats(directory), "sha256": _hashes(directory)}))
                    tmp.replace(seal)
            self.used[key] = json.loads(seal.read_text())
        return directory

    def changed(self) -> list[str]:
        """What differs from the seals in sizes and modification times (cheap: after every test)."""
        return self._differences("stats", _stats)

    def acknowledge(self) -> None:
        """Take the builds' present sizes and times as the reference, so that one test's change fails that test
        alone (the hash check at the end of the run still fails the run)."""
        for key in self.used:
            self.used[key] = self.used[key] | {"stats": _stats(self.root / key)}

    def rehashed(self) -> list[str]:
        """What differs from the seals in content (thorough: once at the end of the run)."""
        return self._differences("sha256", _hashes)

    def _differences(self, field: str, measure: Callable[[Path], dict]) -> list[str]:
        """``key/file`` of every file added, removed or changed since the seal's ``field`` was taken."""
        out = []
        for key, seal in self.used.items():
            now, then = measure(self.root / key), seal[field]
            out += [f"{key}/{name}" for name in sorted(set(now) | set(then)) if now.get(name) != then.get(name)]
        return out


_STORE: Shared | None = None


def shared_store(tmp_path_factory) -> Shared:
    """This run's ``Shared``: one directory for the whole run, beside the xdist workers' own temporary roots (or in
    a plain run's own)."""
    global _STORE
    if _STORE is None:
        base = tmp_path_factory.getbasetemp()
        _STORE = Shared((base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared")
    return _STORE


def store_in_use() -> Shared | None:
    """The run's ``Shared`` if a test has used it in this process."""
    return _STORE


def writable_copy(directory: Path, destination: Path) -> Path:
    """A copy of a shared ``directory`` at ``destination`` that a test may change (links copied as links: an
    artifact's relative link to its version directory stays one)."""
    shutil.copytree(directory, destination, symlinks=True)
    return destination
