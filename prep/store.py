"""Content-addressed stage results under ``artifacts/<name>/stages/``.

A stage result lives in ``<stage>-<key16>/``: its own files, then ``result.json`` written last, so a
directory with ``result.json`` is complete. Work in progress goes to ``.work-<stage>-<key16>/``, which
survives an interruption: a stage that writes its units there one by one (atomically) resumes where it
stopped. The key is the sha256 of the stage name and version, its resolved config, the keys of the
stages it reads, and the model and data fingerprints.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

RESULT = "result.json"


def stage_key(stage: str, version: int, config: dict, upstream: dict[str, str], fingerprints: dict) -> str:
    blob = json.dumps({"stage": stage, "version": version, "config": config, "upstream": upstream,
                       "fingerprints": fingerprints}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON to a temporary file and rename it over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


class StageStore:
    """The stage cache of one recipe."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def final_dir(self, stage: str, key: str) -> Path:
        return self.root / f"{stage}-{key[:16]}"

    def work_dir(self, stage: str, key: str) -> Path:
        """The resumable scratch directory of a stage run (created if absent)."""
        path = self.root / f".work-{stage}-{key[:16]}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def is_complete(self, stage: str, key: str) -> bool:
        return (self.final_dir(stage, key) / RESULT).is_file()

    def commit(self, stage: str, key: str, work: Path, result: dict) -> Path:
        """Write ``result.json`` last into ``work`` and rename it to the final directory."""
        write_json_atomic(work / RESULT, result | {"stage": stage, "key": key})
        final = self.final_dir(stage, key)
        if final.exists():
            shutil.rmtree(final)
        os.replace(work, final)
        return final

    def discard(self, stage: str, key: str) -> None:
        """Forget a stage result and its scratch work (``--force``)."""
        shutil.rmtree(self.final_dir(stage, key), ignore_errors=True)
        shutil.rmtree(self.root / f".work-{stage}-{key[:16]}", ignore_errors=True)

    def result(self, stage: str, key: str) -> dict:
        return json.loads((self.final_dir(stage, key) / RESULT).read_text())
