"""``moeload verify``: the full check of an artifact, without loading a weight.

Every check ``loader.artifact.open_artifact`` runs, every sha256 and every record's and block's xxh3_64
(``loader/hashing.py``), then every check ``load`` runs when it binds the plan and the tokenizer
(``loader.runtime.check_bindings``), so ``verify`` refuses what ``load`` would. It lives above both: the format
knows nothing of the runtime.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from xxhash import xxh3_64

from loader.artifact import check_contents, file_problem, read_report, store_offsets
from loader.errors import ArtifactError, MoeError
from loader.format import MANIFEST, REPORT, Manifest, read_manifest, resolve_artifact
from loader.hashing import BLOCK, block_hashes, read_block_table
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
        problem = file_problem(manifest, name, hash_it=name not in stores)
        if problem is None and name in stores:
            problem = _hash_store(manifest, stores[name])
        if problem:
            bad[name] = problem
    if not bad:
        try:
            checked = check_contents(manifest, informational=True)
            check_bindings(checked)  # what load would refuse when it binds the plan and the tokenizer
        except MoeError as e:
            bad[getattr(e, "file", None) or PLAN_FILE] = str(e)
    if not bad:
        bad |= _read_each(manifest)
    return [f"{name}: {problem}" for name, problem in bad.items()]


def _read_each(manifest: Manifest) -> dict[str, str]:
    """Each file ``moeload plan``, ``info`` and ``generate``'s prediction read, through the reader they call (the
    device profile, the routing sample, the report), so ``verify`` refuses what they refuse, with their message."""
    from loader.device import DEVICE_FILE, read_artifact_profile
    from loader.simulate import ROUTING_SAMPLE, read_routing_sample

    bad = {}
    for name, read in ((DEVICE_FILE, read_artifact_profile), (ROUTING_SAMPLE, read_routing_sample),
                       (REPORT, read_report)):
        if name in manifest.files:
            try:
                read(manifest)
            except MoeError as e:
                bad[name] = str(e)
    return bad


def _hash_store(manifest: Manifest, precision: str, chunk: int = 1 << 24) -> str | None:
    """One pass over a store: its sha256 and every record's xxh3_64; the first problem, or None."""
    info = manifest.stores[precision]
    try:
        offsets = store_offsets(manifest, precision)
    except ArtifactError as e:
        return str(e)
    digest = hashlib.sha256()
    hashes = {}
    blocks = None
    if info.blocks is not None:
        try:
            rows, blocks = read_block_table(manifest, precision)
        except ArtifactError as e:
            return str(e)
    chunk = -(-chunk // BLOCK) * BLOCK  # whole blocks per read, so each block's hash is one call
    bad_blocks = []
    try:
        with open(manifest.path(info.file), "rb") as f:
            start = min(offsets.values())
            digest.update(f.read(start))
            for key in manifest.store_keys(precision):  # records lie in this order, one stride apart
                record, left, useful_left, done = xxh3_64(), info.stride, info.record_bytes, 0
                while left:
                    block = f.read(min(chunk, left))
                    if not block:
                        return "truncated"
                    digest.update(block)
                    if useful_left:
                        useful = memoryview(block)[:useful_left]
                        record.update(useful)
                        if blocks is not None:
                            got = block_hashes(useful)
                            first = done // BLOCK
                            if got != blocks[rows[key], first:first + len(got)].tolist():
                                bad_blocks.append(key)
                        useful_left -= len(useful)
                        done += len(useful)
                    left -= len(block)
                hashes[key] = record.intdigest()
            digest.update(f.read())
    except OSError as e:  # e.g. removed by a concurrent prepare that swapped in a new version
        return f"cannot be read ({e.strerror or e})"
    if bad := [k for k, v in hashes.items() if v != info.xxh3[k]]:  # first: it names the damaged records
        return f"xxh3_64 of records {bad[:4]} differ from the manifest (the manifest or the records changed)"
    if digest.hexdigest() != manifest.files[info.file]["sha256"]:
        return "sha256 mismatch (content changed)"
    if bad_blocks:
        return (f"block hashes of records {sorted(set(bad_blocks))[:4]} differ from {info.blocks} (the records or "
                "the block table changed)")
    return None
