"""`moeload`: the device team's command line (generate, verify, info arrive with the loader)."""

from __future__ import annotations

import click

from loader import __version__


@click.group(help="Run and check moeprep artifacts on a device. "
                  "The generate, verify and info commands arrive with the loader; none exist yet.")
@click.version_option(__version__, prog_name="moeload")
def main() -> None:
    """Entry point of the `moeload` console script."""


if __name__ == "__main__":
    main()
