"""``moeprep bench --quick``: every system measured, the three outputs written (no timing assertions).

Each measurement is a worker process, about 5 s of imports on 2 cores, so the end-to-end test runs one round and
cuts the resident candidates down (two timed, two this transformers does not know, failed without a process); the
reference tests run one candidate (not timed). ``moeprep bench --quick`` itself times all of them. Past the
end-to-end test's first resident candidate (a fresh process, as the bench starts it), the worker runs forked from
a process that imported it (``tests.helpers.bench_builds.forked_worker``): the same measurement, no start-up.
``test_bench_interleaves_repeats_and_chooses_the_fastest_resident`` checks the orchestration (interleaved rounds,
medians, the resident choice, the bound's arithmetic) with a stand-in worker on the real quick subject.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

import prep.studies.bench.measure as bench_measure
import prep.studies.bench.run as bench_run
from prep.cli import main
from prep.errors import MoeprepError
from prep.studies.bench.measure import choose_resident
from prep.studies.bench.plan import parse_budgets
from prep.studies.bench.worker import overhead, runs_loader
from tests.helpers.bench_builds import REAL_RUN_WORKER, forked_worker

TRACES_ROOT = Path(__file__).resolve().parents[3] / "shared" / "data" / "traces"
LOADER = ("naive", "moeprep", "naive@unlimited", "moeprep@unlimited")


@pytest.fixture
def one_resident_candidate(monkeypatch):
    monkeypatch.setattr(bench_measure, "RESIDENT_DTYPES", ("float32",))
    monkeypatch.setattr(bench_measure, "EXPERTS_IMPLEMENTATIONS", ("grouped_mm",))


def test_bench_quick_writes_every_system(tmp_path, quick_shape_built, monkeypatch):
    # Without the real traces the quick run routes with the model's own routers and says so.
    monkeypatch.setattr(bench_measure, "EXPERTS_IMPLEMENTATIONS", ("grouped_mm", "no_such_implementation"))
    # the first resident candidate runs as the bench runs it, a fresh worker process (the launch, its log and its
    # result line); the other measurements, the same worker forked from a pre-imported process (forked_worker)
    fresh = []

    def first_fresh(spec: dict, work: Path) -> dict:
        fresh.append(bool(spec.get("tag")) and not fresh)
        return (REAL_RUN_WORKER if fresh[-1] else forked_worker)(spec, work)

    monkeypatch.setattr(bench_measure, "_run_worker", first_fresh)
    monkeypatch.setattr(bench_measure, "CUDA_RESIDENT_DTYPES", ())
    result = CliRunner().invoke(main, ["bench", "--quick", "--subject", "mixtral-shape", "--output",
                                       str(tmp_path), "--traces", str(TRACES_ROOT)])
    assert result.exit_code == 0, result.output
    assert fresh[0] and not any(fresh[1:])  # one fresh process, then forked ones
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {"cpu", "cores", "ram_gb", "torch", "device"} <= set(report["machine"])
    assert report["read_bandwidth_mb_s"] > 0
    rows = report["results"]
    assert {r["system"] for r in rows} == {"resident", "accelerate", "naive", "moeprep", "naive@unlimited",
                                           "moeprep@unlimited"}
    # the resident baseline: every candidate listed, the unknown implementation failed with its reason (not
    # fatal), and resident runs the fastest of those that ran
    resident = report["subjects"]["mixtral-shape"]["resident"]
    candidates = resident["candidates"]
    assert [(c["dtype"], c["experts_implementation"]) for c in candidates] == [
        ("float32", "grouped_mm"), ("float32", "no_such_implementation"),
        ("bfloat16", "grouped_mm"), ("bfloat16", "no_such_implementation")]
    failed = [c for c in candidates if c.get("error")]
    assert len(failed) == 2 and all("no_such_implementation" in c["error"] for c in failed)
    ran = [c for c in candidates if not c.get("error")]
    assert all(c["decode_tokens_per_s"] > 0 for c in ran)
    fastest = max(ran, key=lambda c: c["decode_tokens_per_s"])
    assert resident["chosen"] == {k: fastest[k] for k in ("dtype", "experts_implementation", "decode_tokens_per_s")}
    resident_row = next(r for r in rows if r["system"] == "resident")
    assert (resident_row["dtype"], resident_row["experts_implementation"]) == (fastest["dtype"],
                                                                             fastest["experts_implementation"])
    assert json.loads((tmp_path / "device.json").read_text())["read_bandwidth_bytes_per_s"] > 0
    assert report["device_profile"]["compute_seconds_per_expert"]["int4"] > 0
    for r in rows:
        assert not r.get("error"), r
        assert r["subject"] == "mixtral-shape" and r["budget"] == "25%"
        assert r["decode_tokens_per_s"] > 0 and r["peak_rss_mb"] > 0
        assert 0 <= r["hit_rate"] <= 1 and r["stall_fraction"] >= 0
        assert r["repeats"] == 1 and r["decode_tokens_per_s_runs"] == [r["decode_tokens_per_s"]]
    assert len(report["raw"]) == len(rows)
    speed = {r["system"]: r["decode_tokens_per_s"] for r in rows}
    loader = [r for r in rows if r["system"] in LOADER]
    assert all(r["bytes_read_per_token"] > 0 for r in loader if "@" not in r["system"])  # a 25% cache misses
    # @unlimited ran the sequence once untimed first: every expert it uses is cached when the timing starts
    assert all(r["hit_rate"] == 1 and r["bytes_read_per_token"] == 0 for r in loader if "@" in r["system"])
    for r in loader:  # the simulator's model beside each loader row, and the loader's overhead when it counts it
        assert r["modelled_tokens_per_s"] > 0, r.get("modelled_error")
        assert r["modelled_over_measured"] == pytest.approx(r["modelled_tokens_per_s"] / r["decode_tokens_per_s"])
        assert "overhead_us_per_layer" in r
        assert r["overhead_us_per_layer"] is None or math.isfinite(r["overhead_us_per_layer"])
        if r["overhead_us_per_layer"] is not None:  # the simulator calibrated against the loader of this run
            assert r["modelled_calibrated_tokens_per_s"] > 0
            assert (tmp_path / "device-calibrated.json").is_file()
    # the bounds: the compute floor of each artifact (its @unlimited row), and Belady's decode reads at 25% (some,
    # and never more than every expert each token asks for) over the profile's read bandwidth
    subject = report["subjects"]["mixtral-shape"]
    bound = report["bounds"]["mixtral-shape"]["25%"]
    assert subject["naive_artifact"] != subject["artifact"] and subject["lossless"]["precision"] == "passthrough"
    assert subject["precision"] == "int4"  # moeprep's artifact
    every = subject["moe_layers"] * subject["top_k"] * subject["lossless"]["record_bytes"]
    assert 0 < bound["belady_bytes_per_token"] <= every
    # moeprep's int4 artifact at the same bytes: smaller records, more of them held, fewer bytes to read
    assert 0 <= bound["moeprep"]["belady_bytes_per_token"] < bound["belady_bytes_per_token"]
    bandwidth = report["device_profile"]["read_bandwidth_bytes_per_s"]
    for entry, floor in ((bound, "naive@unlimited"), (bound["moeprep"], "moeprep@unlimited")):
        assert entry["compute_system"] == floor and entry["compute_tokens_per_s"] == speed[floor]
        assert entry["io_floor_s_per_token"] == pytest.approx(entry["belady_bytes_per_token"] / bandwidth)
        assert entry["bound_tokens_per_s"] == pytest.approx(
            1 / max(1 / entry["compute_tokens_per_s"], entry["io_floor_s_per_token"]))
    assert bound["resident_tokens_per_s"] == speed["resident"]
    by_system = {r["system"]: r for r in rows}
    assert by_system["naive"]["fraction_of_bound"] == pytest.approx(speed["naive"] / bound["bound_tokens_per_s"])
    assert by_system["moeprep"]["fraction_of_bound"] == pytest.approx(
        speed["moeprep"] / bound["moeprep"]["bound_tokens_per_s"])
    routing = report["subjects"]["mixtral-shape"]["routing"]
    assert ("replayed" in routing) == TRACES_ROOT.is_dir()
    md = (tmp_path / "bench.md").read_text()
    assert "| 25% | accelerate |" in md and "Physical bounds" in md
    assert "Resident candidates" in md and "| float32 | no_such_implementation | failed: " in md
    assert f"| {fastest['dtype']} | {fastest['experts_implementation']} | " in md and "**resident**" in md
    assert "| modelled tok/s | modelled / measured | calibrated model / measured | overhead us/layer |" in md
    assert "| 25% | moeprep@unlimited (budget-free) |" in md
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_interleaves_repeats_and_chooses_the_fastest_resident(tmp_path, quick_shape_built, monkeypatch):
    """The orchestration with a stand-in for the worker process (the real quick subject, the real simulator):
    the resident candidates run first, the fastest that ran is resident (a failing one is listed, not fatal),
    every configuration once per round, rows are the median of their rounds, ratios and the bound use them."""
    import torch
    from safetensors.torch import save_file

    monkeypatch.setattr(bench_measure, "CUDA_RESIDENT_DTYPES", ())
    calls = []
    speeds = {"resident": 100.0, "accelerate": 10.0, "naive": 40.0, "moeprep": 60.0, "naive@unlimited": 80.0,
              "moeprep@unlimited": 120.0}
    candidate_speed = {("float32", "eager"): 50.0, ("float32", "grouped_mm"): 70.0, ("float32", "batched_mm"): 60.0,
                       ("bfloat16", "eager"): 90.0, ("bfloat16", "batched_mm"): 30.0}

    def fake_worker(spec: dict, work: Path) -> dict:
        calls.append(spec)
        if spec.get("tag"):  # a resident candidate
            speed = candidate_speed.get((spec["dtype"], spec["experts_implementation"]))
            return {"decode_tokens_per_s": speed} if speed else {"error": "exit 1: RuntimeError: no kernel (log: x)"}
        repeat = sum(1 for c in calls if not c.get("tag") and (c["system"], c["budget"]) ==
                     (spec["system"], spec["budget"])) - 1
        out = {"decode_tokens_per_s": speeds[spec["system"]] * (1, 2, 4)[repeat], "prefill_s": 0.01,
               "bytes_read_per_token": 0.0, "hit_rate": 1.0, "stall_fraction": 0.0, "peak_rss_mb": 400.0}
        if runs_loader(spec["system"]):
            out["overhead_us_per_layer"] = 12.5
        if spec.get("record_routing"):  # the model's own routing (the real traces absent): some decisions
            tokens, layers = len(spec["prompt_ids"]) + len(spec["decode_ids"]), len(spec["experts_modules"])
            ids = torch.stack([torch.randperm(8)[:2] for _ in range(tokens * layers)]).reshape(tokens, layers, 2)
            save_file({"expert_ids": ids, "weights": torch.full((tokens, layers, 2), 0.5)}, spec["record_routing"])
            out["routing_file"] = spec["record_routing"]
        return out

    monkeypatch.setattr(bench_measure, "_run_worker", fake_worker)
    report = bench_run.run_bench("mixtral-shape", "25%", quick=True, output=tmp_path, traces=TRACES_ROOT,
                                 echo=lambda m: None, repeats=3)
    tags = [c.get("tag") for c in calls]
    assert all(tags[:6]) and not any(tags[6:])  # the six candidates first (bfloat16 grouped_mm fails in its worker)
    configurations = [(c["system"], c["budget"]) for c in calls[6:]]
    per_round = len(configurations) // 3
    assert configurations == configurations[:per_round] * 3  # interleaved: every configuration once per round
    assert configurations[0] == ("resident", "100%")
    resident = report["subjects"]["mixtral-shape"]["resident"]
    assert resident["chosen"] == {"dtype": "bfloat16", "experts_implementation": "eager", "decode_tokens_per_s": 90.0}
    failed = [c for c in resident["candidates"] if c.get("error")]
    assert [(c["dtype"], c["experts_implementation"]) for c in failed] == [("bfloat16", "grouped_mm")]
    assert all((c["dtype"], c["experts_implementation"]) == ("bfloat16", "eager")
               for c in calls[6:] if c["system"] == "resident")
    rows = {r["system"]: r for r in report["results"]}
    for system, speed in speeds.items():  # runs of x1, x2, x4: the median is the middle one
        r = rows[system]
        assert (r["repeats"], r["decode_tokens_per_s"]) == (3, 2 * speed)
        assert (r["decode_tokens_per_s_min"], r["decode_tokens_per_s_max"]) == (speed, 4 * speed)
    bound = report["bounds"]["mixtral-shape"]["25%"]
    assert bound["compute_tokens_per_s"] == 160.0 and bound["moeprep"]["compute_tokens_per_s"] == 240.0
    assert rows["naive"]["fraction_of_bound"] == pytest.approx(80.0 / bound["bound_tokens_per_s"])
    assert bound["bound_tokens_per_s"] == pytest.approx(1 / max(1 / 160.0, bound["io_floor_s_per_token"]))
    for system in LOADER:
        assert rows[system]["overhead_us_per_layer"] == 12.5
        assert rows[system]["modelled_tokens_per_s"] > 0, rows[system].get("modelled_error")
        assert rows[system]["modelled_calibrated_tokens_per_s"] > 0
    calibration = report["device_profile_calibrated"]["calibration"]
    assert calibration["overlap"] and calibration["layer_overhead_s"] == pytest.approx(12.5e-6)
    md = (tmp_path / "bench.md").read_text()
    assert "| bfloat16 | eager | 90 | **resident** |" in md and "| bfloat16 | grouped_mm | failed: " in md
    assert "| 25% | naive | 80 | 40 - 160 (3) | 0.40x | " in md  # against the chosen resident's median, 200


def test_bench_runs_only_the_systems_asked_for_on_the_store_asked_for(tmp_path, quick_shape_built, monkeypatch):
    """``--systems naive,moeprep --store host`` (what gpu-check's second store runs): no resident candidates, no
    accelerate, ``naive`` selects ``naive@unlimited`` too, and every loader run gets the store; a system that does
    not exist is one clear error before anything runs."""
    calls = []

    def fake_worker(spec: dict, work: Path) -> dict:
        calls.append(spec)
        return {"decode_tokens_per_s": 10.0, "prefill_s": 0.01, "bytes_read_per_token": 0.0, "hit_rate": 1.0,
                "stall_fraction": 0.0, "peak_rss_mb": 1.0}

    monkeypatch.setattr(bench_measure, "_run_worker", fake_worker)
    report = bench_run.run_bench("mixtral-shape", "25%", quick=True, output=tmp_path, traces=TRACES_ROOT,
                                 echo=lambda m: None, store="host", only="naive,moeprep")
    ran = {(c["system"], c["budget"]) for c in calls}
    assert ran == {("naive@unlimited", "unlimited"), ("moeprep@unlimited", "unlimited"), ("naive", "25%"),
                   ("moeprep", "25%")}
    assert {c["store"] for c in calls} == {"host"} and report["store"] == "host"
    assert "Loader expert stores: `host`" in (tmp_path / "bench.md").read_text()
    # the command as given and the code's commit, for the README's How fast block (prep/studies/bench/readme.py)
    assert report["options"] | {"output": None, "traces": None} == {
        "subject": "mixtral-shape", "budgets": "25%", "repeats": None, "quick": True, "device": "cpu", "store": "host",
        "systems": "naive,moeprep", "prefill": None, "decode": True, "output": None, "traces": None}
    assert report["commit"] == bench_run.source_commit() != ""
    with pytest.raises(MoeprepError, match="--systems .*unknown"):
        bench_run.run_bench("mixtral-shape", "25%", quick=True, output=tmp_path, traces=TRACES_ROOT,
                            echo=lambda m: None, only="naive,fast")
    with pytest.raises(MoeprepError, match="--store 'ram' unknown"):
        bench_run.run_bench("mixtral-shape", "25%", quick=True, output=tmp_path, store="ram")


def test_resident_choice_and_overhead_arithmetic():
    """The fastest candidate that ran is chosen (failures listed, never chosen); the loader's overhead per MoE
    layer step is (step - compute - stall) / steps over the decode, None where the loader does not count it."""
    candidates = [{"dtype": "float32", "experts_implementation": "eager", "decode_tokens_per_s": 10.0},
                  {"dtype": "bfloat16", "experts_implementation": "grouped_mm", "error": "exit 1: boom"},
                  {"dtype": "bfloat16", "experts_implementation": "eager", "decode_tokens_per_s": 12.5}]
    assert choose_resident(candidates) is candidates[2]
    assert choose_resident([candidates[1]]) is None
    only = {"dtype": "float32", "experts_implementation": "grouped_mm", "note": "the only candidate, not timed"}
    assert choose_resident([only, candidates[1]]) is only
    assert bench_measure.resident_candidates("cpu") == [(d, i) for d in ("float32", "bfloat16")
                                                    for i in ("eager", "grouped_mm", "batched_mm")]
    assert {d for d, _ in bench_measure.resident_candidates("cuda")} == {"float32", "bfloat16", "float16"}
    before = {"decode_timing": {"layer_steps": 8, "step_seconds": 1.0, "compute_seconds": 0.5, "stall_seconds": 0.1}}
    after = {"decode_timing": {"layer_steps": 24, "step_seconds": 1.4, "compute_seconds": 0.7, "stall_seconds": 0.2}}
    out = overhead(before, after)
    assert out["overhead_us_per_layer"] == pytest.approx((0.4 - 0.2 - 0.1) / 16 * 1e6)
    assert out["decode_timing"]["layer_steps"] == 16
    assert overhead({}, {}) == {"overhead_us_per_layer": None}


def test_bench_refuses_bad_options(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["bench", "--quick", "--budgets", "25", "--output", str(tmp_path)])
    assert result.exit_code == 1 and "share like 25%" in result.output
    result = runner.invoke(main, ["bench", "--quick", "--device", "cuda", "--output", str(tmp_path)])
    import torch

    if not torch.cuda.is_available():
        assert result.exit_code == 1 and "no CUDA GPU" in result.output
    result = runner.invoke(main, ["bench", "--subject", "mixtral-shape", "--traces", str(tmp_path / "none"),
                                  "--output", str(tmp_path)])
    assert result.exit_code == 1 and "traces" in result.output
    assert parse_budgets("12.5%, 25%, 4bit-25%") == ["12.5%", "25%", "4bit-25%"]


def test_bench_runs_each_planned_predictor_against_naive_on_the_lossless_reference(tmp_path, one_resident_candidate,
                                                                                   forked_workers):
    """The reference-lossless plan has all three predictors: naive+<predictor> rows and a prefetch table."""
    import shutil

    from prep.studies.bench.subjects import PREDICTOR_SYSTEMS

    repo = Path(__file__).resolve().parents[2]
    root = tmp_path / "repo"
    (root / "recipes").mkdir(parents=True)
    shutil.copy(repo / "recipes" / "reference-lossless.yaml", root / "recipes")
    (root / "recipes" / "reference").symlink_to(repo / "recipes" / "reference")
    from prep.studies.bench.run import run_bench

    report = run_bench("reference-lossless", "25%", quick=True, output=tmp_path / "bench", root=root, echo=lambda m: None)
    rows = {r["system"]: r for r in report["results"]}
    planned = [f"naive+{name}" for name in ("next_gates", "path_stats", "first_gate")]
    assert set(planned) <= set(rows)
    assert set(rows) - set(planned) <= {"resident", "accelerate", "naive", "moeprep", "moeprep+tuned", *LOADER}
    # the tuned row: the plan with what `moeload tune` kept at this budget (a smoke run of the tune), said in the notes
    assert not rows["moeprep+tuned"].get("error"), rows["moeprep+tuned"]
    assert any(n.startswith("reference-lossless at 25%: `moeload tune` kept") for n in report["notes"])
    assert set(planned) <= set(PREDICTOR_SYSTEMS)
    for system in (*planned, "moeprep"):
        assert not rows[system].get("error"), rows[system]
        assert rows[system]["prefetch"]["issued"] > 0, system
        # the predictors replayed by the simulator on what the resident model's routers saw
        assert rows[system]["modelled_tokens_per_s"] > 0, rows[system].get("modelled_error")
        assert rows[system]["modelled"]["predictors"], system
    assert rows["naive"]["prefetch"]["issued"] == 0
    # one artifact, two plans: a compute floor each
    bound = report["bounds"]["reference-lossless"]["25%"]
    assert (bound["compute_system"], bound["moeprep"]["compute_system"]) == ("naive@unlimited", "moeprep@unlimited")
    assert rows["naive+next_gates"]["fraction_of_bound"] == pytest.approx(
        rows["naive+next_gates"]["decode_tokens_per_s"] / bound["bound_tokens_per_s"])
    assert report["subjects"]["reference-lossless"]["resident"]["chosen"]["experts_implementation"] == "grouped_mm"
    assert "vs naive" in (tmp_path / "bench" / "bench.md").read_text()


def test_bench_runs_neuron_loading_against_whole_expert_reads_of_the_same_records(tmp_path, one_resident_candidate,
                                                                                  forked_workers):
    """reference-neuron: naive (whole reads of the neuron-layout records), naive+neuron, naive+neuron_gates and
    moeprep, and a neuron table; reading only active rows reads fewer bytes per token."""

    from prep.studies.bench.run import run_bench

    repo = Path(__file__).resolve().parents[2]
    root = tmp_path / "repo"
    (root / "recipes").mkdir(parents=True)
    # rows read as named (the measured crossover of this VM's disk reads nearly every expert whole), and a
    # fixed theta instead of the tolerance search: the test checks the mechanics, the recipe the tuning
    text = (repo / "recipes" / "reference-neuron.yaml").read_text()
    text = text.replace("crossover: null", "crossover: 1.0").replace("tolerance: 0.0015", "tolerance: null")
    (root / "recipes" / "reference-neuron.yaml").write_text(text.replace("theta: 0.3", "theta: 0.15"))
    (root / "recipes" / "reference").symlink_to(repo / "recipes" / "reference")
    report = run_bench("reference-neuron", "25%", quick=True, output=tmp_path / "bench", root=root, echo=lambda m: None)
    rows = {r["system"]: r for r in report["results"]}
    assert {"naive", "naive+neuron", "naive+neuron_gates", "moeprep"} <= set(rows)
    for system in ("naive", "naive+neuron", "naive+neuron_gates", "moeprep"):
        assert not rows[system].get("error"), rows[system]
    assert rows["naive+neuron"]["neuron"]["active_share"] < 1 and "neuron" not in rows["naive"]
    # the simulator models whole-expert reads: neuron-level rows say so instead of a number
    assert rows["naive+neuron"]["modelled_tokens_per_s"] is None and "neuron" in rows["naive+neuron"]["modelled_error"]
    assert rows["naive"]["modelled_tokens_per_s"] > 0
    # nor does the whole-expert bound bind it
    assert rows["naive+neuron"]["fraction_of_bound"] is None and "neuron" in rows["naive+neuron"]["fraction_of_bound_error"]
    assert rows["naive"]["fraction_of_bound"] > 0
    assert rows["naive+neuron"]["bytes_read_per_token"] < rows["naive"]["bytes_read_per_token"]
    assert "Neuron-level loading (CORM)" in (tmp_path / "bench" / "bench.md").read_text()
