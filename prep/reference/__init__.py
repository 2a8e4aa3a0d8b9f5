"""The reference model: its world (``world.py``), data and suites (``data.py``), training (``train.py``)
and measurement (``metrics.py``). ``calibration_texts`` is the ``reference`` calibration source
(registered by name in ``prep/calibration.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def calibration_texts(section, root: Path) -> Iterator[str]:
    """Fresh documents from the reference generator, all domains, seeded by ``section.seed`` (endless)."""
    from prep.reference import data as D

    empty = D.Split(frozenset(), frozenset(), frozenset())
    round_ = 0
    while True:
        docs = D.training_documents(section.seed * 1000 + round_, empty, {d: 8 for d in D.DOMAINS})
        yield from (text for _, text in docs)
        round_ += 1
