"""The error type of ``prep``: every mistake a user can cause; the CLI prints it without a traceback.

It subclasses ``loader.errors.MoeError``, the one root of both packages, so a caller (and both command
lines) can catch every project error, from preparation or from the loader, with one ``except``.
"""

from loader.errors import MoeError


class MoeprepError(MoeError):
    """A user-facing error: the message says what was wrong and what to do about it."""
