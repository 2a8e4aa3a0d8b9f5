"""The one error root of the project: every mistake a user can cause raises a subclass of ``MoeError``.

``loader`` owns it because ``prep`` may import ``loader`` but never the reverse; both command lines
catch ``MoeError`` and print its message without a traceback. The message says what was wrong and
what to do.
"""


class MoeError(Exception):
    """A user-facing error: bad input, a damaged artifact, an impossible request."""
