"""The bench tests' shared build: the quick mixtral-shape subject (its model, passthrough and int4 artifacts),
built once per run and copied into each test's bench output, where ``mixtral_shape_subject`` reuses what is current
instead of preparing it again (``prep/studies/bench/subjects.py``). What a test then measures is its own.

``forked_worker``: the bench's worker runs forked from a process that imported it, without a Python start-up each."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
from pathlib import Path

import prep.studies.bench.measure as _bench_measure
from tests.helpers.shared import shared_store, writable_copy

REAL_RUN_WORKER = _bench_measure._run_worker  # before any test patches it
REPO = Path(__file__).resolve().parents[2]

QUICK_HOME = "mixtral-shape-quick"


def seed_quick_shape(tmp_path_factory, output: Path) -> Path:
    """``output`` holding a copy of the shared quick mixtral-shape subject; returns ``output``."""
    from prep.studies.bench.subjects import mixtral_shape_subject

    def build(directory: Path) -> None:
        mixtral_shape_subject(directory, None, True, 4, 4)  # no traces: nothing beside the model and artifacts

    built = shared_store(tmp_path_factory).get("bench-quick-shape", build)
    output.mkdir(parents=True, exist_ok=True)
    writable_copy(built / QUICK_HOME, output / QUICK_HOME)
    return output



# One long-lived process per test process imports what a worker imports and forks a fresh process for each run
# (as tests/prep/pipeline/test_prepare_kill.py's child): it never computes, so no thread pool exists when it forks.
ZYGOTE = r"""
import json, os, sys, traceback

import torch, transformers, accelerate  # noqa: F401,E401
import transformers.models.mixtral.modeling_mixtral  # noqa: F401
import prep.studies.bench.worker as worker

print("ready", flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.chdir(job["cwd"])
            os.environ.clear()
            os.environ.update(job["env"])
            out = os.open(job["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(log, 2)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            worker.main([job["spec"]])
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    print("exit", os.waitstatus_to_exitcode(status), flush=True)
"""
_zygote: subprocess.Popen | None = None


def _started_zygote() -> subprocess.Popen:
    global _zygote
    if _zygote is None or _zygote.poll() is not None:
        _zygote = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   text=True, env=os.environ | {"PYTHONPATH": str(REPO)})
        atexit.register(_zygote.stdin.close)
        assert _zygote.stdout.readline().split() == ["ready"]
    return _zygote


def forked_worker(spec: dict, work: Path) -> dict:
    """``prep.studies.bench.measure._run_worker`` with the worker forked from a process that has imported it
    instead of started as a fresh interpreter: the same spec file, log file and result line, the worker's own
    ``main`` on the spec, in the caller's directory and environment; what goes is the start-up (torch,
    transformers and the loader imported, ~10 s a run on 2 cores). A llama.cpp run (it joins a cgroup) keeps a
    process of its own. ``test_bench_quick_writes_every_system`` runs its first resident candidate as a real
    worker process."""
    import prep.studies.bench.measure as bench_measure

    if spec.get("system") == bench_measure.LLAMA or spec.get("cgroup"):
        return REAL_RUN_WORKER(spec, work)
    tag = spec.get("tag") or f"{spec['subject']}-{spec['system']}-{spec['budget'].replace('%', 'pct')}"
    spec_path, log_path, out_path = work / f"{tag}.json", work / f"{tag}.log", work / f"{tag}.out"
    spec_path.write_text(json.dumps(spec, indent=2))
    os.sync()  # as _run_worker: the previous system's writes flushed before this one times its reads
    zygote = _started_zygote()
    zygote.stdin.write(json.dumps({"spec": str(spec_path), "log": str(log_path), "out": str(out_path),
                                   "cwd": os.getcwd(), "env": dict(os.environ)}) + "\n")
    zygote.stdin.flush()
    words = zygote.stdout.readline().split()
    assert words[:1] == ["exit"], words
    returncode = int(words[1])
    lines = [line for line in out_path.read_text().splitlines() if line.startswith("{")]
    if returncode != 0 or not lines:
        tail = log_path.read_text().strip().splitlines()[-3:]
        return {"error": f"exit {returncode}: {' | '.join(tail)} (log: {log_path})"}
    return json.loads(lines[-1])
