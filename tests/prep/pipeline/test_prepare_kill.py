"""SIGKILL during prepare, at seeded points spread over trace, quantize, package and the artifact swap:
after every kill the previous artifact (or the new one, once swapped in) is loadable,
it stays loadable at every moment a watcher looks, and a rerun produces an artifact whose files hash
the same as an uninterrupted run.

One long-lived child process imports torch, transformers and moeprep once and forks a fresh process for
each run, which this test kills with SIGKILL; so each kill point costs a fork, not a Python start-up. In
the forked process each phase is stretched a little (a few ms per sequence, expert and hashed file) and
announces its start, so the seeded kill times land inside the phase they are drawn for. The swap takes
microseconds, so those points are hit exactly: the forked process SIGKILLs itself right after the new
version is renamed into place, right before the symlink is renamed over the artifact, and right after.
"""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loader.format import read_manifest
from loader.verify import verify
from prep.pipeline import prepare
from prep.recipe import recipe_from_dict
from tests.helpers.interrupt import sigkill, uninterrupted
from tests.helpers.tiny_models import file_hashes, save_tiny_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
SEED = 20250214
PHASES = ("load", "trace", "quantize", "package")  # load: fingerprint, calibration data, model

CHILD = r"""
import dataclasses, json, os, signal, sys, time
from pathlib import Path

import prep.adapters
import prep.calibration, prep.quant.hqq_codec, prep.reference.data, prep.methods.trace  # noqa: F401,E401 (before fork)
import prep.pipeline as pipeline
import prep.stages.package as package_stage
import prep.stages.quantize as quantize_stage
from prep.recipe import recipe_from_dict
import transformers  # noqa: F401  (imported before fork, once)


def say(*parts):
    print(*parts, flush=True)


def stretch():
    real_load, real_encode, real_sha = prep.adapters.load_model, quantize_stage.encode_expert, package_stage.sha256_file

    def load_model(*a, **k):
        model = real_load(*a, **k)
        model.register_forward_pre_hook(lambda module, args: time.sleep(0.01))
        return model

    def encode(*a, **k):
        time.sleep(0.008)
        return real_encode(*a, **k)

    def sha(*a, **k):
        time.sleep(0.03)
        return real_sha(*a, **k)

    prep.adapters.load_model, quantize_stage.encode_expert, package_stage.sha256_file = load_model, encode, sha

    def marked(stage):
        def run(inputs):
            say("start", stage.name)
            result = stage.run(inputs)
            say("end", stage.name)
            return result
        return dataclasses.replace(stage, run=run)

    pipeline.STAGES = tuple(marked(s) for s in pipeline.STAGES)


def die_at(point):
    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    real_rename, real_replace = os.rename, os.replace

    def rename(src, dst, *a, **k):
        real_rename(src, dst, *a, **k)
        if point == "after-version-rename" and ".artifact.v-" in str(dst):
            kill()

    def replace(src, dst, *a, **k):
        swap = Path(dst).name == "artifact"
        if swap and point == "before-swap":
            kill()
        real_replace(src, dst, *a, **k)
        if swap and point == "after-swap":
            kill()

    os.rename, os.replace = rename, replace


say("ready")
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            stretch()
            if job["die_at"]:
                die_at(job["die_at"])
            pipeline.prepare(recipe_from_dict(job["recipe"]), root=job["root"])
            say("done")
            os._exit(0)
        except BaseException as e:
            say("error", repr(e))
            os._exit(1)
    say("forked", pid)
    _, status = os.waitpid(pid, 0)
    say("exit", pid, status)
"""


def _recipe_dict(precision: str, group_size: int, seed: int) -> dict:
    """The divergence is off: it merges into the artifact after the swap these kills aim at, and a kill inside a
    merge is tested on its own (tests/prep/evals/test_eval.py)."""
    return {"name": "tiny", "model": {"path": "model"},
            "calibration": {"num_sequences": 8, "sequence_length": 16, "seed": seed},
            "quantize": {"precision": precision, "group_size": group_size}, "divergence": {"enabled": False}}




class Child:
    """The forking child: ``run(job)`` forks a prepare; lines it prints arrive with their receipt time."""

    def __init__(self, log: Path) -> None:
        self.err = open(log, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=log.parent, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err, text=True,
                                     env=os.environ | {"PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
        self.lines: queue.Queue = queue.Queue()
        self.pending: list[list[str]] = []  # lines of the current run read by wait_for, for finish
        threading.Thread(target=self._read, daemon=True).start()
        assert self.next(120)[0] == ["ready"]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put((line.split(), time.perf_counter()))

    def next(self, timeout: float = 60) -> tuple[list[str], float]:
        return self.lines.get(timeout=timeout)

    def start(self, root: Path, recipe: dict, die_at: str | None = None) -> tuple[int, float]:
        self.proc.stdin.write(json.dumps({"root": str(root), "recipe": recipe, "die_at": die_at}) + "\n")
        self.proc.stdin.flush()
        words, at = self.next()
        assert words[0] == "forked", words
        return int(words[1]), at

    def wait_for(self, stage: str) -> float | None:
        """Receipt time of the current run's ``start <stage>``; None when the run ended first."""
        while True:
            words, at = self.next()
            self.pending.append(words)
            if words == ["start", stage]:
                return at
            if words[0] in ("done", "error", "exit"):
                return None

    def finish(self) -> tuple[list[list[str]], int]:
        """Lines of the current run until it exits, and its wait status."""
        seen, self.pending = self.pending, []
        while not seen or seen[-1][0] != "exit":
            seen.append(self.next()[0])
        return seen[:-1], int(seen[-1][2])

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        self.err.close()


class Watcher:
    """Checks the artifact over and over while runs are killed and rerun."""

    def __init__(self, artifact: Path) -> None:
        self.artifact, self.looks, self.raced, self.failures = artifact, 0, 0, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _ok(self) -> str | None:
        try:
            read_manifest(self.artifact)
            bad = verify(self.artifact)
        except Exception as e:  # noqa: BLE001 (any failure to load is what we count)
            return repr(e)
        return "; ".join(bad) or None

    def _watch(self) -> None:
        while not self.stop.is_set():
            self.looks += 1
            if self._ok() is not None:
                # a look that began on the previous version may find it removed after the swap; the
                # artifact itself must then load at once
                self.raced += 1
                if (problem := self._ok()) is not None:
                    self.failures.append(problem)
            time.sleep(0.002)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


def test_sigkill_at_seeded_points_never_loses_the_artifact_and_resumes_identically(tmp_path_factory):
    rng = random.Random(SEED)
    # every kill point gets a setting of its own, so that its run has every stage to do
    settings = [(p, g) for p in ("int8", "int4", "int3", "int2") for g in (4, 8, 16) if (p, g) != ("int4", 16)]
    rng.shuffle(settings)
    clean_cache: dict = {}

    def clean(recipe: dict) -> dict[str, str]:  # an uninterrupted run in a fresh root
        key = json.dumps(recipe, sort_keys=True)
        if key not in clean_cache:
            _, summary = uninterrupted(tmp_path_factory, recipe_from_dict(recipe))
            clean_cache[key] = file_hashes(Path(summary["artifact"]))
        return clean_cache[key]

    child = Child(tmp_path_factory.mktemp("log") / "child.stderr")
    try:
        # 1. one uninterrupted run in the child: how long each phase takes, and subprocess == in-process output
        first = _recipe_dict("int4", 16, seed=0)
        home = tmp_path_factory.mktemp("timing")
        save_tiny_model("qwen3_moe", home / "model")
        _, forked = child.start(home, first)
        seen = {("start", "load"): forked}
        while (line := child.next())[0][0] != "exit":
            seen[tuple(line[0][:2])] = line[1]
        assert ("done",) in seen and file_hashes(home / "artifacts/tiny/artifact") == clean(first), seen
        durations = {"load": seen[("start", "trace")] - forked}
        durations |= {p: seen[("end", p)] - seen[("start", p)] for p in PHASES[1:]}

        # 2. the work root with a previous artifact, watched from now on
        work = tmp_path_factory.mktemp("work")
        save_tiny_model("qwen3_moe", work / "model")
        artifact = Path(prepare(recipe_from_dict(first), root=work)["artifact"])
        previous = file_hashes(artifact)
        watcher = Watcher(artifact)
        schedule = (["load"] + ["trace"] * 2 + ["quantize"] * 2 + ["package"] * 2
                    + ["after-version-rename", "before-swap", "after-swap"])
        outcomes = []
        try:
            for i, point in enumerate(schedule):
                precision, group = settings[i]
                recipe = _recipe_dict(precision, group, seed=i + 1)
                delay = None
                if point in PHASES:  # a seeded moment inside that phase, timed from its start
                    delay = rng.uniform(0.05, 0.6) * durations[point]
                    pid, forked = child.start(work, recipe)
                    began = forked if point == "load" else child.wait_for(point)
                    if began is not None:
                        time.sleep(max(0.0, began + delay - time.perf_counter()))
                    sigkill(pid)  # when it finished first, it is reported as not killed
                else:
                    child.start(work, recipe, die_at=point)
                lines, status = child.finish()
                killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
                reached = [w[1] for w in lines if w[0] == "start"]
                # right after the kill: the previous artifact, or the new one if it was swapped in
                assert read_manifest(artifact) and verify(artifact) == [], point
                after_kill = file_hashes(artifact)
                assert after_kill in (previous, clean(recipe)), point
                rerun = prepare(recipe_from_dict(recipe), root=work)
                identical = file_hashes(artifact) == clean(recipe)
                outcomes.append({"point": point, "delay_s": delay and round(delay, 4), "killed": killed,
                                 "stages_started": reached, "swapped_before_kill": after_kill != previous,
                                 "rerun_cached": [s for s in ("trace", "quantize", "package") if rerun[s]["cached"]],
                                 "identical": identical})
                previous = file_hashes(artifact)
        finally:
            watcher.close()
    finally:
        child.close()

    print(json.dumps({"phase_seconds": {k: round(v, 3) for k, v in durations.items()},
                      "watcher_looks": watcher.looks, "watcher_raced": watcher.raced, "outcomes": outcomes},
                     indent=1))
    assert all(o["identical"] for o in outcomes), outcomes
    assert all(o["killed"] for o in outcomes if o["point"] not in PHASES), outcomes
    # timed kills on a busy machine may land a little late, but every phase must have been hit
    for phase in PHASES:
        hits = [o for o in outcomes if o["point"] == phase and o["killed"]
                and (o["stages_started"] or ["load"])[-1] == phase]
        assert hits, (phase, outcomes)
    assert watcher.failures == [] and watcher.looks > 100, (watcher.failures[:3], watcher.looks)
    # leftovers of the killed runs were tidied: one version beside the artifact (a version the watcher's verify
    # held at the last swap stays until a run tidies with nobody reading it: this cached rerun)
    prepare(recipe_from_dict(recipe), root=work)
    assert sorted(p.name for p in artifact.parent.iterdir() if p.name not in ("stages", ".lock")) == sorted(
        [artifact.name, os.readlink(artifact)])
