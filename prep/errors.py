"""The one error type for mistakes a user can cause; the CLI prints it without a traceback."""


class MoeprepError(Exception):
    """A user-facing error: the message says what was wrong and what to do about it."""
