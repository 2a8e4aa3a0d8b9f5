"""The README's How fast block (``prep/studies/bench/readme.py``, ``make how-fast``) from a small synthetic
bench.json: the headline rows and their ratios, the run's command, machine, date and commit, the plot copied
beside the README, everything outside the block byte for byte, "not measured" for what the run lacks, and a
clear refusal of a file that is not a bench's report. No bench runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import prep.studies.bench.run as bench_run
from prep.errors import MoeprepError
from prep.studies.bench.readme import MARKERS, bench_command, main, render

PNG = b"\x89PNG\r\n\x1a\n a plot"
BEFORE = "# project\n\nSome text, with trailing spaces   \n\n## How fast\n\n"
AFTER = "\n\n## Commands\n\n| a | b |\n| --- | --- |\n\nno newline at the end"
LLAMA_NOTE = "llama.cpp skipped: llama_cpp is not installed (pip install -e '.[llama]')"


def _row(subject: str, system: str, budget: str, speed: float | None, **extra) -> dict:
    return {"subject": subject, "system": system, "budget": budget, "repeats": 2, "decode_tokens_per_s": speed,
            "decode_tokens_per_s_min": speed, "decode_tokens_per_s_max": speed} | extra


def synthetic_report() -> dict:
    """mixtral-shape with resident, accelerate and moeprep at 100%, 25% and 4bit-25% (accelerate failed at
    4bit-25%); mixtral-shape-own without llama.cpp (the extra absent) and without moeprep at 4bit-25%."""
    budgets = ["100%", "25%", "4bit-25%"]
    rows = [_row("mixtral-shape", "resident", b, 8.0, measured_once=True) for b in budgets]
    rows += [_row("mixtral-shape", "accelerate", "100%", 6.0), _row("mixtral-shape", "accelerate", "25%", 0.4),
             _row("mixtral-shape", "accelerate", "4bit-25%", None, error="exit 1: MemoryError")]
    rows += [_row("mixtral-shape", "moeprep", "100%", 12.0), _row("mixtral-shape", "moeprep", "25%", 9.6),
             _row("mixtral-shape", "moeprep", "4bit-25%", 3.2)]
    rows += [_row("mixtral-shape-own", "resident", b, 10.0, measured_once=True) for b in budgets]
    rows += [_row("mixtral-shape-own", "moeprep", "100%", 15.0), _row("mixtral-shape-own", "moeprep", "25%", 11.0)]
    shape = {"num_hidden_layers": 32, "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_size": 768,
             "dtype": "float32"}
    facts = {"shape": shape, "precision": "int4", "store_bytes": 6e8, "lossless": {"store_bytes": 4.2e9},
             "prompt_tokens": 16, "decode_tokens": 24}
    return {
        "machine": {"cpu": "Test CPU @ 1GHz", "cores": 2, "ram_gb": 25.3, "torch": "2.13.0+cpu", "device": "cpu"},
        "results": rows,
        "subjects": {"mixtral-shape": facts | {"routing": "replayed from the real Mixtral-8x7B GSM8K decode traces"},
                     "mixtral-shape-own": facts | {"routing": "the model's own routers"}},
        "budgets": budgets, "repeats": 2, "quick": False, "decode": True, "notes": ["mixtral-shape runs no "
                                                                                     "prefetch predictor", LLAMA_NOTE],
        "wall_seconds": 1260.0, "created": "2026-11-27T07:10:33Z", "commit": "0123456789abcdef" * 2 + "01234567",
        "options": {"subject": "mixtral-shape,mixtral-shape-own", "budgets": "100%,25%,4bit-25%", "repeats": 2,
                    "quick": False, "device": "cpu", "store": "auto", "systems": "resident,accelerate,moeprep,llama.cpp",
                    "prefill": None, "decode": True, "output": "artifacts/how-fast", "traces": "../shared/data/traces"},
    }


@pytest.fixture
def site(tmp_path):
    """(bench output folder with bench.json and bench.png, a README with an old block)."""
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "bench.json").write_text(json.dumps(synthetic_report()))
    (bench / "bench.png").write_bytes(PNG)
    readme = tmp_path / "repo" / "README.md"
    readme.parent.mkdir()
    readme.write_text(f"{BEFORE}{MARKERS[0]}\nold figures\n{MARKERS[1]}{AFTER}")
    return bench, readme


def block(readme: Path) -> str:
    text = readme.read_text()
    return text.split(MARKERS[0], 1)[1].split(MARKERS[1], 1)[0]


def test_the_block_shows_the_headline_rows_and_leaves_the_rest_byte_identical(site):
    bench, readme = site
    result = CliRunner().invoke(main, ["--bench", str(bench), "--readme", str(readme)])
    assert result.exit_code == 0, result.output
    assert "how-fast block updated" in result.output
    text = readme.read_text()
    assert text.startswith(BEFORE + MARKERS[0] + "\n") and text.endswith(MARKERS[1] + AFTER)
    lines = block(readme).splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert table == [
        "| system | subject | 100% | 25% | 4bit-25% |",
        "| --- | --- | ---: | ---: | ---: |",
        "| resident (every weight in memory, budget-free) | `mixtral-shape` | 8 | 8 | 8 |",
        "| accelerate (offloads to disk) | `mixtral-shape` | 6 (0.75x) | 0.4 (0.05x) | failed (bench.md says why) |",
        "| **moeprep** | `mixtral-shape` | 12 (1.50x) | 9.6 (1.20x) | 3.2 (0.40x) |",
        "| resident (budget-free) | `mixtral-shape-own` | 10 | 10 | 10 |",
        "| llama.cpp | `mixtral-shape-own` | not measured | not measured | not measured |",
        "| **moeprep** | `mixtral-shape-own` | 15 (1.50x) | 11 (1.10x) | not measured |",
    ]
    prose = " ".join(line for line in lines if not line.startswith("|"))
    assert f"Not measured: {LLAMA_NOTE}." in prose
    assert "the median of 2 interleaved rounds" in prose
    assert ("`moeprep bench --subject mixtral-shape,mixtral-shape-own --budgets 100%,25%,4bit-25% --repeats 2 "
            "--systems resident,accelerate,moeprep,llama.cpp --output artifacts/how-fast`") in prose
    assert "Test CPU @ 1GHz (2 cores, 25.3 GB RAM; torch 2.13.0+cpu, device `cpu`)" in prose
    assert "2026-11-27 07:10 UTC, commit `0123456789ab`; the bench took 21 minutes" in prose
    assert "![decode tokens/s against the memory budget, per subject and system](docs/bench.png)" in lines
    assert (readme.parent / "docs" / "bench.png").read_bytes() == PNG
    assert all(len(line) <= 110 for line in lines if not line.startswith("|"))
    # a second run changes nothing
    result = CliRunner().invoke(main, ["--bench", str(bench / "bench.json"), "--readme", str(readme)])
    assert result.exit_code == 0 and "already current" in result.output
    assert readme.read_text() == text


def test_a_run_without_a_subject_says_so_and_a_dirty_or_unknown_commit_is_named(site):
    bench, readme = site
    report = synthetic_report()
    report["results"] = [r for r in report["results"] if r["subject"] != "mixtral-shape"]
    del report["subjects"]["mixtral-shape"]
    report["notes"] = ["mixtral-shape skipped: the real Mixtral traces are not in x"]
    report["commit"] = "f" * 40 + "-dirty"
    (bench / "bench.json").write_text(json.dumps(report))
    render(bench, readme, png="img/plot.png")
    text = " ".join(block(readme).splitlines())
    assert "| accelerate (offloads to disk) | `mixtral-shape` | not measured | not measured | not measured |" in text
    assert "Not measured: mixtral-shape skipped: the real Mixtral traces are not in x." in text
    assert "commit `ffffffffffff` with uncommitted changes to prep/ or loader/" in text
    assert "](img/plot.png)" in text and (readme.parent / "img" / "plot.png").is_file()
    del report["subjects"]["mixtral-shape-own"], report["commit"]
    report["notes"] = []
    (bench / "bench.json").write_text(json.dumps(report))
    render(bench, readme)
    text = " ".join(block(readme).splitlines())
    assert ("Not measured: mixtral-shape was not in this run; mixtral-shape-own was not in this run." in text
            and "commit not recorded" in text)


@pytest.mark.parametrize("content, why", [
    ("{not json", "not JSON"),
    (json.dumps([1, 2]), "it has no results, machine"),
    (json.dumps({"eval": {}, "machine": {}}), "it has no results, created, budgets, subjects, repeats"),
    (json.dumps(synthetic_report() | {"results": [{"subject": "x"}]}), "not rows of subject, system and budget"),
    (json.dumps(synthetic_report() | {"decode": False}), "has no decode rows"),
])
def test_a_file_that_is_not_a_bench_report_is_refused_by_name(site, content, why):
    bench, readme = site
    file = bench / "bench.json"
    file.write_text(content)
    old = readme.read_text()
    result = CliRunner().invoke(main, ["--bench", str(bench), "--readme", str(readme)])
    assert result.exit_code == 1
    assert result.output.startswith(f"error: {file}") and why in result.output, result.output
    assert "Traceback" not in result.output
    assert readme.read_text() == old and not (readme.parent / "docs").exists()


def test_a_missing_bench_plot_or_block_is_a_clear_error(site, tmp_path):
    bench, readme = site
    with pytest.raises(MoeprepError, match=f"{tmp_path / 'nowhere' / 'bench.json'} not found"):
        render(tmp_path / "nowhere" / "bench.json", readme)
    readme.write_text("# no block\n")
    with pytest.raises(MoeprepError, match="has no block between '<!-- how-fast:start"):
        render(bench, readme)
    (bench / "bench.png").unlink()
    with pytest.raises(MoeprepError, match="bench.png not found beside"):
        render(bench, readme)


def test_the_command_comes_from_the_recorded_options_and_the_commit_from_git(monkeypatch):
    report = synthetic_report()
    report["options"] |= {"device": "cuda", "store": "host", "quick": True, "systems": None, "repeats": None,
                          "traces": "/data/traces", "prefill": "512", "decode": False}
    assert bench_command(report) == ("moeprep bench --subject mixtral-shape,mixtral-shape-own --budgets "
                                     "100%,25%,4bit-25% --device cuda --store host --prefill 512 --output "
                                     "artifacts/how-fast --traces /data/traces --quick --no-decode")
    del report["options"]  # a bench.json from before the options were recorded: rebuilt from what it holds
    assert bench_command(report) == ("moeprep bench --subject mixtral-shape,mixtral-shape-own --budgets "
                                     "100%,25%,4bit-25% --repeats 2")
    commit = bench_run.source_commit()  # this checkout (tests run from one), or unknown in an exported tree
    assert commit == "unknown" or len(commit.removesuffix("-dirty")) == 40

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(bench_run.subprocess, "run", no_git)
    assert bench_run.source_commit() == "unknown"
