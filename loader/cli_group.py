"""The click group of both command lines (``moeload`` and ``moeprep``): kept apart from ``loader/cli.py`` so that
``moeprep`` starts without importing the runtime."""

from __future__ import annotations

import click

from loader.errors import MoeError, user_error


class LoaderGroup(click.Group):
    """A click group that turns a project error (MoeError) or a disk error from any subcommand into one line on
    stderr and exit 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (MoeError, OSError) as e:  # a project error, or a full, read-only or forbidden disk anywhere
            if (error := user_error(e)) is None:
                raise
            click.echo(f"error: {error}", err=True)
            ctx.exit(1)
