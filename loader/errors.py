"""The one error root of the project: every mistake a user can cause raises a subclass of ``MoeError``.

``loader`` owns it because ``prep`` may import ``loader`` but never the reverse; both command lines
catch ``MoeError`` and print its message without a traceback. The message says what was wrong and
what to do.
"""

import errno


class MoeError(Exception):
    """A user-facing error: bad input, a damaged artifact, an impossible request."""


PREPARE_AGAIN = "run `moeload verify`, then copy the artifact again or re-run `moeprep prepare`"


class ArtifactError(MoeError):
    """An artifact that cannot be used as it is; the message names the file and what to do.

    ``file`` is the artifact file at fault (a name inside the artifact), when there is one.
    """

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message)
        self.file = file


class LoaderError(MoeError):
    """A request the loader cannot satisfy (no GPU, an unknown option, ...); the message says what to do."""


class BudgetError(LoaderError):
    """A memory budget too small for what must be held, or one that cannot be read; not the artifact's fault."""


class ModelingError(MoeError):
    """A device profile, routing sample or cost-model input that cannot be used; the message names it and the fix."""


class DiskError(MoeError):
    """A write the disk refused (full, read-only, not permitted): the message names the path and the fix."""


_DISK_FIXES = {
    errno.ENOSPC: "the disk is full: free space there, or write somewhere else",
    errno.EDQUOT: "the disk quota is used up: free space there, or write somewhere else",
    errno.EROFS: "the file system is read-only: choose a writable place",
    errno.EACCES: "permission denied: choose a place you can write, or fix its permissions",
    errno.EPERM: "not permitted: choose a place you can write, or fix its permissions",
}


def disk_error(error: OSError, path=None) -> MoeError | None:
    """The ``DiskError`` for an OSError of a full, read-only or forbidden disk (None for any other OSError)."""
    fix = _DISK_FIXES.get(error.errno)
    if fix is None:
        return None
    where = path if path is not None else (error.filename or "a file")
    return DiskError(f"cannot write {where}: {fix}")


def user_error(error: BaseException) -> MoeError | None:
    """What a command line prints for ``error`` instead of a traceback: a MoeError as it is, an OSError of a full,
    read-only or forbidden disk as a DiskError; None for anything else (a bug keeps its traceback)."""
    if isinstance(error, MoeError):
        return error
    return disk_error(error) if isinstance(error, OSError) else None
