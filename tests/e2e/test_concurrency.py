"""Readers keep what they read: ``load`` and ``verify`` hold the artifact version they resolved
(``loader.io.hold_for_reading``), and ``prepare`` removes a version it swapped out only once no reader holds it.
Eight ``moeload generate`` processes on one artifact while ``prepare`` swaps it twice: each finishes with the
output of one whole version or fails with a clear error; none hangs and none mixes versions."""

from __future__ import annotations

import json
import multiprocessing
import os
import runpy
import sys
from pathlib import Path

import pytest

from loader.io import hold_for_reading, unread
from loader.runtime import load
from loader.verify import verify
from prep.pipeline import prepare
from tests.helpers.tiny_models import save_tiny_model, tiny_recipe

REPO = Path(__file__).resolve().parents[2]
PROMPT = "the cat sat on"


def _generate_args(artifact: Path) -> list[str]:
    return ["generate", str(artifact), "--prompt", PROMPT, "--max-new-tokens", "6", "--json"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), MOEPREP_EXPERT_DTYPE="float32")


def _run_loader_cli(args: list[str], env: dict, out: str, err: str) -> None:
    """``python -m loader.cli ARGS`` in this process (a forkserver child): stdout and stderr to files, the exit
    status the command's own."""
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        opened = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 (multiprocessing flushes both at exit)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.argv = ["moeload", *args]
    runpy.run_module("loader.cli", run_name="__main__", alter_sys=True)


class Generate:
    """One ``moeload generate`` process on ``artifact``: forked from a forkserver that imported the loader (and
    never computed), so each costs a fork, not a Python start-up (~5 s of imports on 2 cores); its own process,
    files and locks, as ``python -m loader.cli`` started afresh."""

    def __init__(self, artifact: Path, logs: Path) -> None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["tests.e2e.test_concurrency", "loader.cli",
                                        "transformers.models.mixtral.modeling_mixtral"])
        logs.mkdir(parents=True, exist_ok=True)
        self.out, self.err = logs / "stdout", logs / "stderr"
        self.process = context.Process(target=_run_loader_cli, args=(_generate_args(artifact), _env(), str(self.out),
                                                                     str(self.err)))
        self.process.start()

    def communicate(self, timeout: float) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once it ends; a process still running after ``timeout`` s fails the test."""
        self.process.join(timeout)
        assert self.process.exitcode is not None, f"moeload generate still running after {timeout} s (hangs)"
        return self.process.exitcode, self.out.read_text(), self.err.read_text()


def test_a_loaded_version_survives_a_swap_until_it_is_closed(tmp_path):
    save_tiny_model("mixtral", tmp_path / "model")
    output = tmp_path / "artifact"
    prepare(tiny_recipe("int4"), root=tmp_path, output=output)
    loaded = load(output)
    version = output.resolve()
    prepare(tiny_recipe("int8"), root=tmp_path, output=output)  # a new version is published
    assert output.resolve() != version and version.is_dir() and not unread(version)
    ids = loaded.tokenizer(PROMPT, return_tensors="pt")
    loaded.model(**ids)  # the old version still decodes from its own files
    loaded.close()
    assert unread(version)
    prepare(tiny_recipe("int8"), root=tmp_path, output=output)  # its tidy removes what nobody holds
    assert not version.exists() and verify(output) == []


def test_verify_holds_the_version_it_reads(tmp_path):
    save_tiny_model("mixtral", tmp_path / "model")
    output = tmp_path / "artifact"
    prepare(tiny_recipe("int4"), root=tmp_path, output=output)
    version = output.resolve()
    fd = hold_for_reading(version)  # as verify does while it hashes
    try:
        prepare(tiny_recipe("int8"), root=tmp_path, output=output)
        assert version.is_dir() and verify(version) == []
    finally:
        os.close(fd)


@pytest.mark.slow
def test_eight_generates_while_prepare_swaps_twice(tmp_path):
    save_tiny_model("mixtral", tmp_path / "model")
    recipes = [tiny_recipe("int4"), tiny_recipe("int8"), tiny_recipe("int4", group_size=8)]
    expected = set()
    for i, recipe in enumerate(recipes):  # each version's own output, on its own copy
        own = tmp_path / f"alone-{i}"
        prepare(recipe, root=tmp_path, output=own)
        returncode, out, err = Generate(own, tmp_path / f"logs-alone-{i}").communicate(timeout=300)
        assert returncode == 0, err
        expected.add(tuple(json.loads(out.strip().splitlines()[-1])["token_ids"]))
    output = tmp_path / "artifact"
    prepare(recipes[0], root=tmp_path, output=output)
    readers = [Generate(output, tmp_path / f"logs-reader-{i}") for i in range(8)]
    for recipe in recipes[1:]:  # two swaps while the readers load and decode
        prepare(recipe, root=tmp_path, output=output)
    outcomes = []
    for reader in readers:
        returncode, out, err = reader.communicate(timeout=600)  # none hangs
        if returncode == 0:
            outcomes.append(tuple(json.loads(out.strip().splitlines()[-1])["token_ids"]))
        else:
            assert returncode == 1 and err.startswith("error: ") and "Traceback" not in err, err
            outcomes.append("clear error")
    finished = [o for o in outcomes if o != "clear error"]
    assert finished and all(o in expected for o in finished), (outcomes, expected)  # never a mix of versions
    print(f"\n8 generates across two swaps: {len(finished)} finished with one version's output, "
          f"{len(outcomes) - len(finished)} failed with a clear error")
