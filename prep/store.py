"""Where preparation writes: the stage cache, the artifact output, and the locks that guard both.

``StageStore``: a stage result lives in ``artifacts/<name>/stages/<stage>-<key16>/``: its own files,
then ``result.json`` written last, so a directory with ``result.json`` is complete. Work in progress goes
to ``.work-<stage>-<key16>/``, which survives an interruption: a stage that writes its units there one by
one (atomically) resumes where it stopped. ``stage_key`` is the sha256 of the stage name and version,
its config, the keys of the stages it reads and the fingerprints of what it needs. A cached directory is reused
only when its seal is this stage's and key's, its files are as sealed with finite values, and nothing in it is a
link leaving ``artifacts/<name>/`` (``prep/integrity.py``); a link is removed, never what it points to.

``ArtifactOutput``: ``--output DIR`` is a symlink to a complete versioned sibling ``.DIR.v-<id>/``. A
new artifact is built in ``.DIR.tmp-<pid>/``, renamed to a fresh ``.DIR.v-<id>/`` and published by
creating a new symlink and renaming it over ``DIR``: one rename, so a reader (or a kill at any moment)
sees the old artifact or the new one, never none. A plain artifact directory left by an older moeprep
is swapped for the symlink with ``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+); where the kernel or the
filesystem lacks it, the one-time migration falls back to two renames, and a kill between them is
repaired by the next run (``tidy`` links ``DIR`` to the newest complete version). ``DIR`` is replaced
only when it is empty or holds a moeprep artifact (unless ``overwrite``), and never when it is, or
contains, the model, the working directory, the project root or the stage cache.

``exclusive_lock``: an ``flock`` on a file holding the owner's pid; a second run fails at once and
names that pid.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from loader.errors import disk_error
from loader.format import FORMAT, MANIFEST
from loader.io import replace_directory, unread
from prep.errors import MoeprepError
from prep.integrity import (
    Unreadable,
    drop_temporaries,
    notice,
    read_json,
    stage_damage,
    value_problem,
    walk_entries,
)
from prep.stages import RESULT, Stage, StageResult


def stage_key(stage: str, version: int, config: dict, upstream: dict[str, str], fingerprints: dict) -> str:
    blob = json.dumps({"stage": stage, "version": version, "config": config, "upstream": upstream,
                       "fingerprints": fingerprints}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


class StageStore:
    """The stage cache of one recipe. Nothing it reuses may come from outside ``artifacts/<name>/`` (the root's
    parent): a stage directory, stage file or unit file that is a link leaving it is refused, never hashed through."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.inside = self.root.parent.resolve()
        self._intact: set[tuple[str, str]] = set()

    def final_dir(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key[:16]}"

    def work_dir(self, stage: str, key: str) -> Path:
        """The resumable scratch directory of a stage run (created if absent). A link in it (or it, a link) that
        leaves ``artifacts/<name>/`` is removed first, with a notice: the link only, never what it points to, so
        no unit is reused from there and no stage writes through it."""
        path = self.root / f".work-{stage}-{key[:16]}"
        for entry in ([path] if path.is_symlink() else [p for _, p in walk_entries(path)] if path.is_dir() else []):
            if entry.is_symlink() and not entry.resolve().is_relative_to(self.inside):
                why = f"a link to {entry.resolve()}, outside {self.inside}"
            elif not (entry.is_symlink() or stat.S_ISREG(mode := entry.lstat().st_mode) or stat.S_ISDIR(mode)):
                why = "not a regular file (a FIFO would block the stage that writes or reads it)"
            else:
                continue
            notice(f"stage {stage}: {entry} is {why}; removing it (a link goes, never what it points to) "
                   "and computing what it held again")
            entry.unlink()
        path.mkdir(parents=True, exist_ok=True)
        return path

    def is_complete(self, stage: str, key: str) -> bool:
        return (self.final_dir(stage, key) / RESULT).is_file()

    def damage(self, stage: str, key: str, result: type[StageResult] | None = None) -> str | None:
        """Why the cached result of ``stage`` may not be reused (None: every file is as sealed for this stage and
        key, nothing in it leads outside ``artifacts/<name>/``, and its values are finite and, for ``result``'s type,
        in range); each directory is checked once per store."""
        if (stage, key) in self._intact:
            return None
        problem = stage_damage(self.final_dir(stage, key), {"stage": stage, "key": key}, self.inside)
        if problem is None and result is not None:
            problem = result_problem(self.final_dir(stage, key), result)
        if problem is None:
            self._intact.add((stage, key))
        return problem

    def load(self, stage: Stage, key: str) -> StageResult:
        return stage.result.load(self.final_dir(stage.name, key))

    def commit(self, stage: str, key: str, work: Path, result: StageResult, **meta) -> Path:
        """Write ``result.json`` last into ``work`` and rename it to the final directory. Unit temporaries (a Ray
        worker killed mid-write leaves one) are removed first, so the seal and the stage directory never hold one."""
        drop_temporaries(work)
        result.save(work, stage=stage, key=key, **meta)
        final = self.final_dir(stage, key)
        _unlink_unless_directory(final)
        replace_directory(work, final)
        return final

    def discard(self, stage: str, key: str) -> None:
        """Forget a stage result and its scratch work (``--force``); a link is removed, never what it points to."""
        self._intact.discard((stage, key))
        for path in (self.final_dir(stage, key), self.root / f".work-{stage}-{key[:16]}"):
            _unlink_unless_directory(path)
            shutil.rmtree(path, ignore_errors=True)


def _unlink_unless_directory(path: Path) -> None:
    """Remove ``path`` when it is a link (the link, not what it points to), a file or a FIFO (which ``rmtree``
    would open and block on); a real directory is left for the caller."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()


def result_problem(directory: Path, kind: type[StageResult]) -> str | None:
    """Why the ``result.json`` in ``directory`` may not enter a plan: not a result of type ``kind``, a value that
    is not finite, or out of the range ``kind`` knows (``StageResult.problem``). None: none of those."""
    try:
        raw = read_json(directory / RESULT)["result"]
        if (problem := value_problem(raw)) is not None:
            return f"its {RESULT} holds a value that cannot be trusted: {problem}"
        loaded = kind.from_json(raw)
    except (OSError, Unreadable, KeyError, TypeError, ValueError, AttributeError) as e:
        return f"its {RESULT} cannot be read as a {kind.__name__} ({type(e).__name__}: {e})"
    problem = loaded.problem()
    return None if problem is None else f"its {RESULT} is out of range: {problem}"


# ------------------------------------------------------------------------------------------- locks


@contextmanager
def exclusive_lock(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (its content: the holder's pid) for the ``with`` body.

    The kernel drops the lock when the process ends, however it ends, so a killed run never leaves a
    stale lock behind. Raises MoeprepError at once, naming the holder's pid, when another process holds it.
    """
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only or forbidden place: say where, before any work
        raise (disk_error(e, path.parent) or e) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise MoeprepError(f"{what} is in use by another `moeprep prepare` (pid {holder}, lock {path}); "
                               "wait for it to finish or stop it, then run again") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------- the artifact output

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` in one step (renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):  # not glibc >= 2.28, or not Linux
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):  # kernel or filesystem lacks it
        return False
    raise OSError(err, os.strerror(err), str(b))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in path.iterdir():
        if p.is_file() and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _absolute(path: Path) -> Path:
    """``path`` made absolute with ``..`` folded and its parent's symlinks resolved (not its own)."""
    path = Path(os.path.abspath(path))
    return path.parent.resolve() / path.name if path.name else path


def artifact_files_ok(directory: Path, key: str | None = None) -> bool:
    """Whether ``directory`` holds a complete artifact (of package key ``key``, when given): a moeprep
    manifest listing at least one file, and every listed file a plain file inside it of its recorded size."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return False
    if key is not None and manifest.get("package_key") != key:
        return False
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for name, entry in files.items():
        # a name may hold a folder (reports/report-plan.png) but never leave the artifact
        if not isinstance(name, str) or not isinstance(entry, dict) or any(
                part in ("", ".", "..") for part in name.split("/")):
            return False
        try:
            info = (directory / name).lstat()
        except OSError:
            return False
        if not stat.S_ISREG(info.st_mode) or info.st_size != entry.get("bytes"):
            return False
    return True


class ArtifactOutput:
    """The artifact at ``path``: checked before anything is built, replaced in one atomic rename."""

    def __init__(self, path: str | Path, protected: Iterable[Path], overwrite: bool = False) -> None:
        self.path = Path(path)
        self.overwrite = overwrite
        self._abs = _absolute(self.path)
        self._check_not_protected(protected)
        self.parent, self.name = self._abs.parent, self._abs.name
        self._leftover = re.compile(rf"\.{re.escape(self.name)}\.(tmp|link|v|old)-.+")

    # -- refusing what must never be replaced ------------------------------------------------------
    def _check_not_protected(self, protected: Iterable[Path]) -> None:
        candidates = {self._abs}
        if self.path.exists():
            candidates.add(self.path.resolve())
        for guarded in protected:
            guarded_abs = Path(guarded).resolve()
            for candidate in candidates:
                if candidate == guarded_abs or candidate in guarded_abs.parents:
                    what = "is" if candidate == guarded_abs else "contains"
                    raise MoeprepError(
                        f"refusing --output {self.path}: it {what} {guarded_abs}, which prepare must not replace "
                        "(the model, the working directory, the project root and the stage cache are "
                        "protected, even with --overwrite); choose a new directory such as "
                        "artifacts/<name>/artifact")

    # -- what is at the path now ------------------------------------------------------------------
    def _version(self, name: str) -> bool:
        return name.startswith(f".{self.name}.v-") and "/" not in name

    def target(self) -> str | None:
        """The version directory name ``path`` links to, when it is one of ours."""
        if self.path.is_symlink():
            link = os.readlink(self.path)
            return link if self._version(link) else None
        return None

    def _state(self) -> str:
        if self.path.is_symlink():
            return "ours" if self.target() is not None else "link"
        if not self.path.exists():
            return "absent"
        if self.path.is_dir():
            if not any(self.path.iterdir()):
                return "empty"
            try:
                manifest = json.loads((self.path / MANIFEST).read_text())
            except (OSError, ValueError):
                manifest = None
            return "artifact" if isinstance(manifest, dict) and manifest.get("format") == FORMAT else "foreign"
        return "foreign"

    def check_replaceable(self) -> None:
        """Refuse to replace anything that is not a moeprep artifact, unless ``overwrite``."""
        state = self._state()
        if state in ("ours", "absent", "empty", "artifact") or self.overwrite:
            return
        if state == "link":
            held = f"a symlink to {os.readlink(self.path)} that moeprep did not make"
            fix = "pass --overwrite to replace the link (what it points to is left alone)"
        elif self.path.is_dir():
            names = sorted(p.name for p in self.path.iterdir())
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            held = f"a directory that is not a moeprep artifact (it holds {shown})"
            fix = "pass --overwrite to replace it and delete what it holds"
        else:
            held = "a file, not a moeprep artifact"
            fix = "pass --overwrite to replace it"
        raise MoeprepError(f"--output {self.path} is {held}; prepare replaces the whole directory, so it stops "
                           f"here. Choose another --output, or {fix}")

    @contextmanager
    def lock(self) -> Iterator[None]:
        """An exclusive lock on this output (``.DIR.lock`` beside it)."""
        self.parent.mkdir(parents=True, exist_ok=True)
        with exclusive_lock(self.parent / f".{self.name}.lock", f"artifact output {self.path}"):
            yield

    # -- leftovers of interrupted runs ------------------------------------------------------------
    def tidy(self) -> None:
        """Recover an artifact a kill left unlinked, then remove every leftover (``.tmp-``, ``.link-``,
        ``.old-`` and the versions nothing points to). Call with the lock held."""
        if not self.parent.is_dir():
            return
        leftovers = [p for p in self.parent.iterdir() if self._leftover.fullmatch(p.name)]
        if not self.path.exists():  # absent, or a link whose version is gone: relink the newest complete one
            complete = [p for p in leftovers if p.is_dir() and not p.is_symlink() and artifact_files_ok(p)
                        and p.name.startswith((f".{self.name}.v-", f".{self.name}.old-"))]
            if complete:
                newest = max(complete, key=lambda p: p.stat().st_mtime_ns)
                if self.path.is_symlink():
                    self.path.unlink()
                if self._version(newest.name):
                    self._link(newest.name)
                else:  # an older moeprep's artifact, renamed aside before a kill: put it back
                    os.rename(newest, self.path)
                    _fsync_dir(self.parent)
        keep = self.target()
        for p in leftovers:
            if p.name != keep and unread(p):  # a version a reader still holds goes at a later tidy
                _remove(p)

    # -- building and publishing ------------------------------------------------------------------
    def current(self) -> Path | None:
        """The directory the artifact is read from now, or None."""
        return self.path if self.path.is_dir() else None

    def matches(self, key: str) -> bool:
        """Whether the published artifact is complete and was built with package key ``key``."""
        current = self.current()
        return current is not None and artifact_files_ok(current, key)

    @contextmanager
    def build(self) -> Iterator[Path]:
        """An empty directory to write the new artifact into; published when the body finishes."""
        tmp = self.parent / f".{self.name}.tmp-{os.getpid()}"
        _remove(tmp)
        tmp.mkdir(parents=True)
        yield tmp
        _fsync_tree(tmp)
        version = self.parent / f".{self.name}.v-{secrets.token_hex(6)}"
        os.rename(tmp, version)
        self.publish(version)

    def _link(self, version_name: str) -> None:
        """Point ``path`` at ``version_name`` with one rename of a fresh symlink over it."""
        link = self.parent / f".{self.name}.link-{os.getpid()}"
        _remove(link)
        os.symlink(version_name, link)
        os.replace(link, self.path)
        _fsync_dir(self.parent)

    def publish(self, version: Path) -> None:
        """Make ``path`` the complete artifact directory ``version`` (a sibling) and drop the previous one."""
        previous = self.target()
        if self.path.is_dir() and not self.path.is_symlink():
            # A plain directory (an older moeprep's artifact, an empty directory, or --overwrite): a
            # symlink cannot be renamed over a directory, so exchange the two names in one step.
            link = self.parent / f".{self.name}.link-{os.getpid()}"
            _remove(link)
            os.symlink(version.name, link)
            if not _exchange(link, self.path):
                # Fallback: two renames; a kill between them leaves nothing at path until the next
                # run's tidy() links the newest complete version (this one) again.
                aside = self.parent / f".{self.name}.old-{os.getpid()}"
                os.rename(self.path, aside)
                os.replace(link, self.path)
                link = aside
            _fsync_dir(self.parent)
            if unread(link):  # now the old directory; a reader that holds it keeps it until a later tidy
                _remove(link)
        else:
            self._link(version.name)
        if previous is not None and previous != version.name and unread(self.parent / previous):
            _remove(self.parent / previous)  # else a reader holds it: the next tidy removes it
