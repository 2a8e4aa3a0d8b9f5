"""Every option has a type and a bound, checked before any work, and the dry run refuses what the run refuses:
each row gives both command lines one out-of-range value and expects one clear error, no traceback,
the same from ``moeprep prepare --dry-run`` as from ``moeprep prepare``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from loader.cli import main as moeload
from prep.cli import main as moeprep
from tests.helpers.tiny_models import save_tiny_model, tiny_artifact

RECIPE = """name: tiny
model: {path: model}
calibration: {num_sequences: 2, sequence_length: 16}
quantize: {precision: int4, group_size: 16}
"""

# (arguments, what the one error says)
PREPARE_ROWS = [
    (["--set", "plan.tune.enabled=true", "--set", "plan.tune.workers=1000000000"], "plan.tune.workers must be from 1"),
    (["--set", "plan.tune.trials=1000000000"], "plan.tune.trials must be at most"),
    (["--set", "plan.tune.enabled=true", "--set", 'plan.tune.storage=""'], "plan.tune.storage '' is empty"),
    (["--set", "plan.tune.enabled=true", "--set", "plan.tune.storage=foo://db"], "unknown database scheme 'foo'"),
    (["--set", "plan.tune.enabled=true", "--set", "plan.tune.storage=/no/such/dir/study.journal"],
     "directory /no/such/dir does not exist"),
    (["--set", "plan.tune.enabled=true", "--set", "plan.tune.storage=."], "is a directory"),
    (["--expert-memory", "lots"], "--expert-memory"),
    (["--device", "tpu"], "--device 'tpu'"),
    (["--ray-address", "local"], "is for the ray executor"),
    (["--executor", "ray", "--ray-address", "http://head"], "is not a Ray address"),
    (["--set", "executor.max_retries=1000"], "executor.max_retries must be from 0 to 100"),
    (["--set", "executor.num_cpus_per_task=2000.0"], "executor.num_cpus_per_task must be in"),
    (["--set", "divergence.num_sequences=2"], "divergence.num_sequences must be from 4"),
    (["--set", "divergence.sequence_length=1"], "divergence.sequence_length must be from 2"),
    (["--set", "divergence.resamples=5"], "divergence.resamples must be from 100"),
    (["--set", "divergence.text.source=nowhere"], "divergence.text.source 'nowhere' unknown"),
    # every key the divergence stage reads, refused before the artifact it runs on is published, naming the key
    (["--set", "divergence.memory_budget=lots"], "divergence.memory_budget: memory budget 'lots' not understood"),
    (["--set", "divergence.memory_budget=-5%"], "divergence.memory_budget: memory budget '-5%': a percentage"),
    (["--set", "divergence.memory_budget=1e400"], "divergence.memory_budget: memory budget '1e400'"),
    (["--set", "divergence.seed=-1"], "divergence.seed must be from 0"),
    (["--set", "divergence.seed=99999999999999999999"], "divergence.seed must be from 0"),
    (["--set", "divergence.sequence_length=1000"], "divergence.sequence_length 1000 is longer than the model's "
                                                   "context"),
    (["--set", "divergence.text.source=files"], "divergence.text.source is 'files' but divergence.text.files is "
                                                "empty"),
    (["--set", "divergence.text.source=dataset"], "divergence.text.source is 'dataset' but divergence.text.dataset"),
    (["--set", "divergence.text={source: files, files: [nope.txt]}"],
     "nope.txt, which the recipe names for stage divergence, is not there"),
    (["--set", "divergence.text.num_sequences=0"], "divergence.text needs num_sequences >= 1"),
    (["--set", "divergence.text.sequence_length=1000000"], "divergence.text asks for 16 sequences"),
    (["--set", "calibration.source=files"], "calibration.source is 'files' but calibration.files is empty"),
    (["--set", "divergence.text.files=[held-out.txt]"], "divergence.text.files is set but divergence.text.source is "
                                                         "'reference', so the files would not be read"),
    (["--until", "nope"], "--until 'nope' is not a stage"),
    (["--force", "nope"], "--force 'nope' is not a stage"),
    (["--set", "nope.key=1"], "nope"),
    (["--set", "evaluate.suites=[]"], "evaluate.suites must name each suite once"),
    (["--set", "evaluate.num_fewshot=1000"], "evaluate.num_fewshot must be from 0 to 64"),
]
if not torch.cuda.is_available():
    PREPARE_ROWS.append((["--device", "cuda"], "torch sees no CUDA GPU"))


@pytest.fixture
def project(tmp_path, monkeypatch):
    save_tiny_model("mixtral", tmp_path / "model")
    (tmp_path / "tiny.yaml").write_text(RECIPE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _one_clear_error(result, says: str) -> str:
    assert result.exit_code != 0, result.output
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), \
        f"a traceback: {result.exception!r}"
    assert says in result.output, result.output
    return next(line for line in result.output.splitlines() if says in line)


@pytest.mark.parametrize(("args", "says"), PREPARE_ROWS, ids=[" ".join(a) for a, _ in PREPARE_ROWS])
def test_prepare_and_its_dry_run_refuse_each_out_of_range_option_alike(project, args, says):
    runner = CliRunner()
    dry = runner.invoke(moeprep, ["prepare", "--recipe", "tiny.yaml", "--dry-run", *args])
    run = runner.invoke(moeprep, ["prepare", "--recipe", "tiny.yaml", *args])
    assert _one_clear_error(dry, says).removeprefix("error: ") == _one_clear_error(run, says).removeprefix("error: ")
    assert not (Path(project) / "artifacts/tiny/artifact").exists()  # refused before any work


GENERATE_ROWS = [
    (["--threads", "99999"], "--threads '99999': use"),
    (["--threads", "\u0663"], "--threads"),  # ARABIC-INDIC DIGIT THREE: isdigit(), and int() takes it
    (["--threads", "1" * 31], "--threads"),
    (["--threads", "0"], "--threads '0'"),
    (["--threads", "-2"], "--threads '-2'"),
    (["--workers", "0"], "--workers '0'"),
    (["--workers", "65"], "from 1 to 64"),
    (["--workers", "\u00b2"], "--workers"),  # SUPERSCRIPT TWO: isdigit(), and int() refuses it
    (["--max-new-tokens", "0"], "--max-new-tokens must be from 1"),
    (["--max-new-tokens", "9" * 31], "--max-new-tokens must be from 1"),
    (["--memory-budget", "lots"], "memory budget 'lots' not understood"),
    (["--memory-budget", "1e400"], "memory budget '1e400' not understood"),
    (["--memory-budget", "-5%"], "a percentage must be above 0"),
    (["--predictors", "bogus"], "predictor 'bogus' unknown"),
    (["--theta", "nan"], "neuron.theta must be a finite number"),
    (["--theta", "-1"], "neuron.theta must be a finite number"),
    (["--device", "tpu"], "--device 'tpu' is not supported"),
    (["--neuron", "maybe"], "'maybe' is not one of"),
    (["--expert-dtype", "int9"], "'int9' is not one of"),
]


@pytest.mark.parametrize(("args", "says"), GENERATE_ROWS, ids=[" ".join(a) for a, _ in GENERATE_ROWS])
def test_generate_refuses_each_out_of_range_option_before_loading(tmp_path_factory, args, says):
    _, artifact = tiny_artifact(tmp_path_factory)
    result = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "HI", *args])
    _one_clear_error(result, says)


@pytest.mark.parametrize("name", ["latin1.txt", "latin1.jsonl"])
def test_a_calibration_file_that_is_not_utf8_is_one_clear_error_naming_it(project, name):
    """A Latin-1 calibration file (``.txt`` or ``.jsonl``): one error naming the file and the key, no traceback,
    before any stage runs."""
    text = "caf\u00e9 cr\u00e8me " * 40
    (Path(project) / name).write_bytes((text if name.endswith(".txt") else f'{{"text": "{text}"}}\n').encode("latin-1"))
    run = CliRunner().invoke(moeprep, ["prepare", "--recipe", "tiny.yaml", "--set", "calibration.source=files",
                                       "--set", f"calibration.files=[{name}]"])
    line = _one_clear_error(run, "is not UTF-8 text")
    assert name in line and "calibration.files" in line
    assert not (Path(project) / "artifacts/tiny/artifact").exists()


# the studies' (and eval's) number options: a value that would only hang, overflow or never end is refused by the
# option parser, naming the option, before any work
HUGE = "9" * 30
STUDY_ROWS = [
    (["eval", "--artifact", "a", "--limit", HUGE], "--limit"),
    (["eval", "--artifact", "a", "--num-fewshot", "1000"], "--num-fewshot"),
    (["accuracy", "--seed", HUGE], "--seed"),
    (["bitwidth-study", "--limit", HUGE], "--limit"),
    (["bitwidth-study", "--tolerances", "0.002,nan"], "--tolerances"),
    (["bitwidth-study", "--shares", "0.5,1e308"], "--shares"),
    (["routing-study", "--max-rank", HUGE], "--max-rank"),
    (["routing-study", "--lambdas", "inf"], "--lambdas"),
    (["routing-study", "--gating", "0.1,7"], "--gating"),
    (["routing-study", "--dynamic", "0.5/nan"], "--dynamic"),
    (["neuron-study", "--thetas", "0,1e400"], "--thetas"),
    (["neuron-study", "--trust-theta", "nan"], "--trust-theta"),
    (["neuron-study", "--trust-theta", "inf"], "--trust-theta"),
    (["prediction-study", "--seed", HUGE], "--seed"),
    (["policy-study", "--trace", "t", "--seed", "-1"], "--seed"),
    (["policy-study", "--trace", "t", "--seed", HUGE], "--seed"),
    (["reference-suites", "--seed", HUGE], "--seed"),
    (["bench", "--repeats", HUGE], "--repeats"),
    (["kernel-study", "--hidden", HUGE], "--hidden"),
    (["kernel-study", "--intermediate", "10000000"], "--intermediate"),
    (["kernel-study", "--prefill-tokens", HUGE], "--prefill-tokens"),
    (["kernel-study", "--repeats", HUGE], "--repeats"),
]


@pytest.mark.parametrize(("args", "says"), STUDY_ROWS, ids=[" ".join(a) for a, _ in STUDY_ROWS])
def test_the_studies_refuse_each_unbounded_number_before_any_work(tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(moeprep, args)
    _one_clear_error(result, says)
    assert list(tmp_path.iterdir()) == []  # nothing written: refused before the study started


@pytest.mark.parametrize(("args", "says"), [(["--seconds", "nan"], "--seconds"), (["--seconds", "1e400"], "--seconds"),
                                            (["--repeats", HUGE], "--repeats")])
def test_the_gpu_check_refuses_unbounded_numbers(tmp_path, capsys, args, says):
    from prep.studies.bench import gpu_check

    with pytest.raises(SystemExit) as exit_:
        gpu_check.main(["--out", str(tmp_path / "out"), *args])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("threads", [HUGE, "0", "1,x"])
def test_the_threads_study_refuses_a_thread_count_out_of_range(tmp_path, capsys, threads):
    from prep.studies import threads as study

    with pytest.raises(SystemExit) as exit_:
        study.main(["--dir", str(tmp_path), "--threads", threads])
    assert exit_.value.code == 2 and "--threads" in capsys.readouterr().err
