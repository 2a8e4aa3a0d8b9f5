"""A real ``moeprep prepare`` process SIGKILLed during the sensitivity sweep: the rerun reuses the units it had
finished (counted in the summary) and writes the same stage files as the stage run again whole.

``tests/prep/pipeline/test_executor.py`` interrupts the driver with a KeyboardInterrupt raised inside a unit; here the
kernel kills the whole process group at a moment the test does not choose inside the code, only by watching
the stage's work directory from outside. The model is a tiny Qwen3-MoE with 4 MoE layers of 32 experts, so
the sweep has 4 units of about half a second each (3 s under load) after the driver's start: the test kills it
once the first unit's file is there, with the other three still to come.

A Ray variant (``--executor ray --ray-address local``) is not here: starting Ray and its two cold workers costs about
25 s on 2 cores, and Ray's workers run in process groups of their own, which a SIGKILL of the driver's group does
not reach. The resume is the same code on Ray (a unit whose file exists is not sent), and ``test_executor.py``
checks a Ray run against a local one file by file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from prep.pipeline import prepare
from prep.recipe import load_recipe
from tests.helpers.interrupt import sigkill, stage_files
from tests.helpers.tiny_models import build_tiny_model, qwen3_moe_config, sweep_recipe, tiny_tokenizer

REPO = Path(__file__).resolve().parents[3]
LAYERS = 4


def save_model(directory: Path) -> None:
    """A tiny Qwen3-MoE with more layers and experts than the suite's: one sweep unit per layer, each longer."""
    config = qwen3_moe_config()
    config.num_hidden_layers, config.num_experts = LAYERS, 32
    build_tiny_model("qwen3_moe", config=config).save_pretrained(directory)
    tiny_tokenizer(config.vocab_size).save_pretrained(directory)


def write_recipe(path: Path) -> Path:
    """``sweep_recipe`` (int4 and int2, bitwidth edgemoe, so the sweep runs) on 4 calibration sequences of 32 tokens."""
    raw = sweep_recipe().to_dict()
    raw["calibration"] |= {"num_sequences": 4, "sequence_length": 32}
    raw["sensitivity"]["num_sequences"] = 4
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_sigkilled_prepare_resumes_with_the_units_it_finished(root, tmp_path_factory):
    recipe_file = write_recipe(tmp_path_factory.mktemp("recipe") / "recipe.yaml")
    save_model(root / "model")
    stages = root / "artifacts/tiny/stages"
    log = root / "prepare.log"
    env = os.environ | {"PYTHONPATH": str(REPO)}  # this checkout's prep; MOEPREP_EXPERT_DTYPE as the suite sets it
    with open(log, "wb") as out:
        driver = subprocess.Popen([sys.executable, "-m", "prep.cli", "prepare", "--recipe", str(recipe_file),
                                   "--until", "sensitivity"], cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)  # its own process group, killed whole
    try:
        deadline = time.monotonic() + 300
        while not list(stages.glob(".work-sensitivity-*/layer-*.json")):
            assert driver.poll() is None, f"prepare ended before a sweep unit finished:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "no sweep unit finished in 300 s"
            time.sleep(0.005)
    finally:
        sigkill(driver.pid, group=True)
        driver.wait()
    assert driver.returncode == -signal.SIGKILL
    (work,) = stages.glob(".work-sensitivity-*")
    finished = len(list(work.glob("layer-*.json")))
    assert 1 <= finished < LAYERS and not list(stages.glob("sensitivity-*"))  # killed inside the stage

    resumed = prepare(load_recipe(recipe_file), root=root, until="sensitivity")
    assert resumed["trace"]["cached"] and resumed["quantize"]["cached"] and not resumed["sensitivity"]["cached"]
    units = resumed["sensitivity"]["units"]
    assert units["reused"] == finished and units["ran"] == LAYERS - finished

    # the same stage run again whole on the same trace and records: the same files, stage keys included
    resumed_files = stage_files(root)
    again = prepare(load_recipe(recipe_file), root=root, until="sensitivity", force="sensitivity")
    assert again["sensitivity"]["units"]["ran"] == LAYERS and again["quantize"]["cached"]
    assert stage_files(root) == resumed_files
