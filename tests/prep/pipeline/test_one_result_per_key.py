"""One stage key, one result: a stage run in the driver computes at the units' thread count, so its bytes
do not depend on the machine's cores or on the executor; and ``moeprep prepare`` run as two processes, locally
and on a local Ray instance, writes the same stage files and the same plan."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import subprocess
import sys
import traceback
import types
from pathlib import Path

import pytest
import torch

import prep.pipeline as pipeline
import prep.stages.quantize as quantize_stage
from prep.executor import UNIT_THREADS
from prep.pipeline import prepare
from tests.helpers.interrupt import uninterrupted
from tests.helpers.tiny_models import save_tiny_model, sweep_recipe, tiny_recipe

REAL_QUANTIZE_LAYER = quantize_stage.quantize_layer

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


# --- the Ray path, without Ray: every byte of the artifact ------------------------------------------------------


class _Task:
    """A Ray task run on get(): in a forked process (a worker: it loads the model from its directory), tried again
    when the process dies, up to Ray's ``max_retries``."""

    def __init__(self, fn, args, retries: int) -> None:
        self.fn, self.args, self.retries = fn, args, retries

    def result(self):
        fork = multiprocessing.get_context("fork")
        for _ in range(self.retries + 1):
            reader, writer = fork.Pipe(duplex=False)
            worker = fork.Process(target=_worker, args=(self.fn, self.args, writer))
            worker.start()
            writer.close()
            try:
                answer = reader.recv() if reader.poll(300) else None
            except EOFError:  # the worker died before it answered
                answer = None
            worker.join()
            if worker.exitcode == 0 and answer is not None:
                return answer
        raise FakeRay.exceptions.RayError(f"the worker died {self.retries + 1} times")


def _worker(fn, args, writer) -> None:
    code = 1
    try:
        writer.send(fn(*args))
        code = 0
    except BaseException:  # noqa: BLE001 (a worker's traceback, then its death, as on Ray)
        traceback.print_exc()
    finally:
        os._exit(code)


class FakeRay(types.ModuleType):
    """What ``prep.executor.RayExecutor`` uses of Ray: tasks in forked worker processes, handed back last first."""

    exceptions = types.SimpleNamespace(RayError=RuntimeError)

    def __init__(self) -> None:
        super().__init__("ray")
        self.up, self.fn, self.retries = False, None, 0

    def is_initialized(self) -> bool:
        return self.up

    def init(self, **_) -> None:
        self.up = True

    def shutdown(self) -> None:
        self.up = False

    def remote(self, fn):
        self.fn = fn
        return self

    def options(self, max_retries: int = 0, **_):
        self.retries = max_retries
        return types.SimpleNamespace(remote=lambda *args: _Task(self.fn, args, self.retries))

    def wait(self, refs, num_returns=1):
        return refs[-num_returns:], refs[:-num_returns]  # not the order they were sent in

    def get(self, ref):
        return ref.result()

    def cancel(self, ref) -> None:
        pass


KILLED = {"marker": ""}


def _killed_mid_write(context, out, **args) -> None:
    """A quantize unit whose worker writes half of layer 1's int2 file and dies, on its first try."""
    marker = Path(KILLED["marker"])
    if args["layer"] == 1 and args["precision"] == "int2" and not marker.exists():
        marker.write_text("killed")
        REAL_QUANTIZE_LAYER(context, out, **args)
        data = Path(out).read_bytes()
        Path(out).write_bytes(data[: len(data) // 2])
        os._exit(1)
    REAL_QUANTIZE_LAYER(context, out, **args)


def _artifact(root: Path) -> dict[str, bytes]:
    artifact = (root / "artifacts/tiny/artifact").resolve()
    return {p.relative_to(artifact).as_posix(): p.read_bytes() for p in sorted(artifact.rglob("*")) if p.is_file()}


def test_a_local_and_a_ray_path_run_write_the_same_bytes_for_every_artifact_file(tmp_path_factory, tmp_path,
                                                                                   monkeypatch):
    """The sweep recipe (trace, quantize, sensitivity and bit-width units) prepared locally and through
    ``RayExecutor`` (Ray itself replaced by forked worker processes that load the model from its directory, units
    handed back in another order, one worker killed halfway through writing its unit): report.json, manifest.json
    and every other file of the artifact are the same bytes, and no stage directory holds the killed unit's
    partial file or seals it."""
    local, _ = uninterrupted(tmp_path_factory, sweep_recipe())
    monkeypatch.setitem(sys.modules, "ray", FakeRay())
    monkeypatch.setitem(KILLED, "marker", str(tmp_path / "killed"))
    monkeypatch.setattr(quantize_stage, "quantize_layer", _killed_mid_write)
    save_tiny_model("qwen3_moe", tmp_path / "model")
    ran = prepare(sweep_recipe(kind="ray"), root=tmp_path)
    assert (tmp_path / "killed").exists() and ran["quantize"]["units"]["ran"] == 4
    assert _artifact(tmp_path) == _artifact(local)
    stages = tmp_path / "artifacts/tiny/stages"
    assert not [p for p in stages.rglob("*") if ".unit" in p.name or p.name.startswith(".work-")]
    for seal in stages.glob("*/.seal.json"):
        assert not [name for name in json.loads(seal.read_text())["files"] if ".unit" in name]
