"""One stage key, one result: a stage run in the driver computes at the units' thread count, so its bytes
do not depend on the machine's cores or on the executor; and ``moeprep prepare`` run as two processes, locally
and on a local Ray instance, writes the same stage files and the same plan."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import prep.pipeline as pipeline
from prep.executor import UNIT_THREADS
from prep.pipeline import prepare
from tests.helpers.tiny_models import save_tiny_model, tiny_recipe

GATING = {"gating": {"enabled": True, "num_sequences": 2}}  # Fisher sensitivities: a backward in the driver


def test_a_stage_run_in_the_driver_computes_at_the_units_thread_count(tmp_path, monkeypatch):
    seen = {}
    stages = []
    for stage in pipeline.STAGES:
        def recording(inputs, run=stage.run, name=stage.name):
            seen[name] = torch.get_num_threads()
            return run(inputs)
        stages.append(dataclasses.replace(stage, run=recording))
    monkeypatch.setattr(pipeline, "STAGES", tuple(stages))
    save_tiny_model("mixtral", tmp_path / "model")
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prepare(tiny_recipe(**GATING), root=tmp_path)
        assert torch.get_num_threads() == 2  # the caller's count is given back
    finally:
        torch.set_num_threads(before)
    assert {"gating", "package"} <= set(seen) and set(seen.values()) == {UNIT_THREADS}


RECIPE = """name: tiny
model: {path: model}
calibration: {num_sequences: 2, sequence_length: 16}
quantize: {precision: int4, group_size: 16}
gating: {enabled: true, num_sequences: 2}
"""


def _files(root: Path) -> dict[str, bytes]:
    """Every stage file and the plan, by path without the key suffix (no hidden seals: they hold file hashes)."""
    stages = root / "artifacts/tiny/stages"
    out = {str(p.relative_to(stages)): p.read_bytes() for p in sorted(stages.rglob("*"))
           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(stages).parts)}
    return out | {"plan.json": (root / "artifacts/tiny/artifact/plan.json").read_bytes()}


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # one Ray instance at a time on the machine
def test_two_prepare_processes_locally_and_on_ray_write_the_same_bytes(tmp_path):
    pytest.importorskip("ray")
    save_tiny_model("mixtral", tmp_path / "model")
    (tmp_path / "tiny.yaml").write_text(RECIPE)
    command = [sys.executable, "-m", "prep.cli", "prepare", "--recipe", "tiny.yaml"]
    local = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert local.returncode == 0, local.stderr[-3000:]
    first = _files(tmp_path)
    gating = next(k for k in first if k.startswith("gating-") and k.endswith("result.json"))
    assert json.loads(first[gating])["result"]["sensitivity"]  # the Fisher sensitivities are there to compare
    on_ray = subprocess.run([*command, "--executor", "ray", "--ray-address", "local", "--force", "trace"],
                            cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert on_ray.returncode == 0, on_ray.stderr[-3000:]
    assert _files(tmp_path) == first
