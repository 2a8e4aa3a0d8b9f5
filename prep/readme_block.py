"""The README's generated blocks: text a command computed, kept between two marker lines that name the command.

``moeprep inspect-model --table ... --readme README.md`` (``prep/inspect.py``: the supported-models table and
eval's wall times) and ``make how-fast`` (``prep/studies/bench/readme.py``: the bench's headline rows) rewrite
their block in place; everything outside it stays byte for byte.
"""

from __future__ import annotations

from pathlib import Path

from loader.io import write_text_atomic
from prep.errors import MoeprepError


def update_readme(readme: str | Path, table: str, markers: tuple[str, str]) -> bool:
    """Replace the block between ``markers`` in ``readme`` with ``table``; returns whether it changed."""

    path = Path(readme)
    text = path.read_text()
    start, end = markers
    if start not in text or end not in text:
        raise MoeprepError(f"{path} has no block between {start!r} and {end!r}; add those two lines where it goes")
    before, rest = text.split(start, 1)
    _, after = rest.split(end, 1)
    new = f"{before}{start}\n{table}{end}{after}"
    if new != text:
        write_text_atomic(path, new)
    return new != text
