"""``moeload verify``: the full check of an artifact, without loading a weight.

Every check ``loader.format.open_artifact`` runs, every sha256 and every record's xxh3_64 (``loader/format.py``),
then every check ``load`` runs when it binds the plan and the tokenizer (``loader.runtime.check_bindings``), so
``verify`` refuses what ``load`` would. It lives above both modules: the format knows nothing of the runtime.
"""

from __future__ import annotations

import os
from pathlib import Path

from loader.errors import ArtifactError, MoeError
from loader.format import (
    MANIFEST,
    _check_contents,
    _file_problem,
    _hash_store,
    read_manifest,
    resolve_artifact,
)
from loader.io import hold_for_reading
from loader.plan import PLAN_FILE
from loader.runtime import check_bindings


def verify(artifact: str | Path) -> list[str]:
    """Full check: every ``open_artifact`` check plus every sha256 and every record's xxh3_64.

    Returns one line ``<file>: <problem>`` per bad file (empty when sound); never raises for a bad artifact.
    It holds the version it reads (``hold_for_reading``), so a ``prepare`` that swaps in a new one meanwhile
    leaves these files in place until it is done.
    """
    try:
        root = resolve_artifact(artifact)
        held = hold_for_reading(root)
    except (ArtifactError, OSError) as e:
        return [f"{MANIFEST}: {e}"]
    try:
        return _verify(root)
    finally:
        os.close(held)


def _verify(artifact: Path) -> list[str]:
    try:
        manifest = read_manifest(artifact)
    except ArtifactError as e:
        return [f"{MANIFEST}: {e}"]
    stores = {s.file: p for p, s in manifest.stores.items()}
    bad = {}
    for name in sorted(manifest.files):
        problem = _file_problem(manifest, name, hash_it=name not in stores)
        if problem is None and name in stores:
            problem = _hash_store(manifest, stores[name])
        if problem:
            bad[name] = problem
    if not bad:
        try:
            checked = _check_contents(manifest, informational=True)
            check_bindings(checked)  # what load would refuse when it binds the plan and the tokenizer
        except MoeError as e:
            bad[getattr(e, "file", None) or PLAN_FILE] = str(e)
    return [f"{name}: {problem}" for name, problem in bad.items()]
