"""``make gpu-check`` (prep/studies/bench/gpu_check.py) without a GPU: it stops at "no CUDA" with status 2 and says so in
gpu-check.md; its summary of a bench (complete or cut off) and its goal lines follow the numbers."""

from __future__ import annotations

import json
import sys

from prep.studies.bench import gpu_check


def test_without_cuda_the_check_says_so_and_exits_2(tmp_path):
    fake_python = tmp_path / "python"
    fake_python.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.exit(1)'\n")
    fake_python.chmod(0o755)
    status = gpu_check.main(["--out", str(tmp_path / "out"), "--python", str(fake_python), "--seconds", "60"])
    assert status == 2
    md = (tmp_path / "out" / "gpu-check.md").read_text()
    assert "no CUDA" in md
    assert json.loads((tmp_path / "out" / "gpu-check.json").read_text())["cuda"] is False


def test_a_cut_off_bench_is_summarized_from_its_runs_so_far(tmp_path):
    raw = [{"system": "moeprep", "budget": "25%", "decode_tokens_per_s": v, "stall_fraction": 0.1,
            "bytes_read_per_token": 2e6} for v in (4.0, 6.0, 5.0)]
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    summary = gpu_check.summarize(tmp_path)
    assert not summary["complete"]
    assert summary["rows"] == [{"system": "moeprep", "budget": "25%", "tok_s": 5.0, "of_bound": None, "stall": 0.1,
                                "mb_per_token": 2.0, "miss_costs": None}]


def test_the_goals_follow_the_measured_rows():
    def row(system, budget, tok_s, of_bound=None):
        return {"system": system, "budget": budget, "tok_s": tok_s, "of_bound": of_bound, "stall": 0.0,
                "mb_per_token": 0.0, "miss_costs": None}

    state = {"cuda": "GPU", "tests": None, "steps": [], "bench": {
        "host": {"complete": True, "rows": [row("resident", "100%", 20.0), row("moeprep", "100%", 19.5),
                                            row("moeprep", "25%", 8.0, 0.5), row("accelerate", "25%", 0.5)]},
        "disk": {"complete": True, "rows": [row("moeprep", "25%", 3.0, 0.85)]}}}
    lines = gpu_check.goals(state)
    assert lines[0] == "100%, host store: moeprep / resident: 0.97 (goal >= 0.95) met"
    assert lines[1] == "25%, host store: moeprep's fraction of its bound: 0.50 (goal >= 0.8) MISSED"
    assert lines[2] == "25%, host store: moeprep / accelerate: 16.00 (goal >= 10) met"
    assert lines[3] == "25%, disk store: moeprep's fraction of its bound: 0.85 (goal >= 0.8) met"
    assert lines[4] == "4bit-25%, disk store: moeprep's fraction of its bound: not measured"
    md = gpu_check.render(state)
    assert "| 25% | moeprep | 8 | 0.50 |" in md and "## Goals" in md
