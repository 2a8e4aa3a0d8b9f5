"""The bench's prefill rows (``moeprep bench --prefill``, prep/studies/bench/prefill.py): the arithmetic of the bound
and the summaries by hand, the tiled replay against the recorded decisions, and the rows end to end on the quick
subject (the real worker, forked from a pre-imported process: tests/helpers/bench_builds.py; no timing assertions; llama.cpp's rows only where the optional extra is installed)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import prep.studies.bench.measure as bench_measure
import prep.studies.bench.run as bench_run
from prep.errors import MoeprepError
from prep.methods.trace import read_mixtral_traces
from prep.studies.bench import llama
from prep.studies.bench.prefill import add_bounds, add_memory_verdicts, parse_prompts, summarize_prefill
from prep.studies.bench.report import prefill_goals
from prep.studies.bench.subjects import tiled_replay
from tests.helpers.mixtral_traces import synthetic_traces

HAVE_LLAMA = llama.missing() is None


def test_prompt_lengths_are_parsed_and_checked():
    assert parse_prompts("2048, 512,512") == [512, 2048]
    assert parse_prompts(None) == [] and parse_prompts("") == []
    for bad in ("512,abc", "0", "-4", ",", "1e3"):
        with pytest.raises(MoeprepError, match="--prefill"):
            parse_prompts(bad)


def test_the_bound_is_the_slower_of_the_floor_and_the_reads():
    rows = [{"subject": "s", "prompt_tokens": 512, "system": "moeprep@unlimited", "ttft_s": 4.0},
            # reads: 1e9 bytes at 1e9 B/s = 1 s < the 4 s floor: compute binds
            {"subject": "s", "prompt_tokens": 512, "system": "moeprep", "ttft_s": 5.0, "prefill_tokens_per_s": 102.4,
             "bytes_read": 10 ** 9},
            # 8e9 bytes = 8 s > 4 s: the reads bind
            {"subject": "s", "prompt_tokens": 512, "system": "moeprep", "ttft_s": 10.0, "prefill_tokens_per_s": 51.2,
             "bytes_read": 8 * 10 ** 9},
            # another prompt without a floor: no bound, and why
            {"subject": "s", "prompt_tokens": 2048, "system": "moeprep", "ttft_s": 1.0, "prefill_tokens_per_s": 2048.0,
             "bytes_read": 0}]
    add_bounds(rows, 1e9)
    compute, reads, unbound = rows[1:]
    assert compute["bound_tokens_per_s"] == pytest.approx(512 / 4.0) and compute["bound_by"] == "compute"
    assert compute["fraction_of_bound"] == pytest.approx(4.0 / 5.0)
    assert reads["bound_tokens_per_s"] == pytest.approx(512 / 8.0) and reads["bound_by"] == "reads"
    assert reads["fraction_of_bound"] == pytest.approx(0.8) and reads["io_floor_s"] == pytest.approx(8.0)
    assert unbound["fraction_of_bound"] is None and "moeprep@unlimited" in unbound["bound_error"]


def test_memory_verdicts_and_summaries():
    rows = [{"system": "moeprep", "prefill_memory_bytes": 90, "budget_bytes": 100},
            {"system": "moeprep", "prefill_memory_bytes": 110, "budget_bytes": 100},
            {"system": "resident", "prefill_memory_bytes": 110, "budget_bytes": 100},
            {"system": "naive", "error": "does not fit", "budget_bytes": 100}]
    add_memory_verdicts(rows)
    assert [r["within_budget"] for r in rows] == [True, False, None, None]
    runs = [{"prefill_tokens_per_s": 10.0, "ttft_s": 5.0}, {"error": "exit 1"},
            {"prefill_tokens_per_s": 30.0, "ttft_s": 1.0}, {"prefill_tokens_per_s": 20.0, "ttft_s": 2.0}]
    row = summarize_prefill(runs)
    assert (row["repeats"], row["failed_repeats"], row["prefill_tokens_per_s"], row["ttft_s"]) == (3, 1, 20.0, 2.0)
    assert (row["prefill_tokens_per_s_min"], row["prefill_tokens_per_s_max"]) == (10.0, 30.0)
    assert summarize_prefill([{"error": "exit 1: x"}]) == {"repeats": 0, "error": "exit 1: x"}


def test_the_tiled_replay_is_the_recorded_decisions_one_after_another(tmp_path):
    root = synthetic_traces(tmp_path / "traces", tokens=(5, 3), layers=6)
    path, how = tiled_replay(root, 4, 19, tmp_path / "replay.safetensors")
    got = load_file(str(path))
    recorded = read_mixtral_traces(root)
    once = torch.cat([r.expert_ids[:, :4] for r in recorded])  # 8 tokens
    assert got["expert_ids"].shape == (19, 4, 2) and got["weights"].shape == (19, 4, 2)
    assert torch.equal(got["expert_ids"], torch.cat([once, once, once])[:19])
    assert "8 recorded tokens of its 2 problems" in how and "repeated 3 times" in how
    with pytest.raises(MoeprepError, match="6 layers"):
        tiled_replay(root, 7, 4, tmp_path / "r.safetensors")


def test_prefill_goals_say_met_or_why_not():
    rows = [{"subject": "mixtral-shape-own", "prompt_tokens": 2048, "system": s, "budget": b, "ttft_s": t,
             "prefill_tokens_per_s": 2048 / t, "within_budget": w} | extra
            for s, b, t, w, extra in [
                ("moeprep", "4bit-25%", 10.0, True, {"fraction_of_bound": 0.9, "bound_tokens_per_s": 227.6,
                                                     "bound_by": "compute"}),
                ("llama.cpp", "4bit-25%", 12.0, False, {}),
                ("moeprep", "100%", 10.0, True, {}), ("resident", "100%", 9.0, None, {})]]
    lines = prefill_goals({"prefill": {"prompts": [2048], "rows": rows}})
    text = "\n".join(lines)
    assert "prefill of 2048 tokens at 4bit-25% (mixtral-shape-own): moeprep >= 0.8 of its bound: MET, 0.90" in text
    assert "at 25% (mixtral-shape-own): moeprep >= 0.8 of its bound: not measured" in text
    assert "moeprep <= llama.cpp Q4: MET, 10 s against 12 s" in text
    assert "moeprep <= 1.2x resident: MET, 10 s against 9 s = 1.11x" in text
    assert "moeprep's memory within the budget during prefill: MET, 2 of 2 rows" in text
    assert prefill_goals({"prefill": None}) == []


@pytest.fixture
def one_resident_candidate(monkeypatch):
    monkeypatch.setattr(bench_measure, "RESIDENT_DTYPES", ("float32",))
    monkeypatch.setattr(bench_measure, "EXPERTS_IMPLEMENTATIONS", ("grouped_mm",))


@pytest.mark.slow
def test_the_bench_measures_prefill_rows_of_every_system(tmp_path, quick_shape_built, one_resident_candidate,
                                                         forked_workers):
    """The quick subject, its own routers (no traces needed), a 300-token prompt at 100% and 4bit-25%: a row for
    every system and budget, the bound of each moeprep row, and reads that add up."""
    budgets = ["100%", "4bit-25%"]
    report = bench_run.run_bench("mixtral-shape", ",".join(budgets), quick=True, output=tmp_path,
                                 traces=tmp_path / "no-traces", echo=lambda m: None, prefill="300", decode=False)
    assert report["results"] == [] and report["decode"] is False
    prefill = report["prefill"]
    assert prefill["prompts"] == [300] and prefill["budgets"] == budgets
    rows = {(r["system"], r["budget"]): r for r in prefill["rows"]}
    expected = {(s, b) for b in budgets for s in ("resident", "moeprep@unlimited", "accelerate", "naive", "moeprep")}
    assert set(rows) == expected
    for (system, budget), r in rows.items():
        assert r["prompt_tokens"] == 300 and r["subject"] == "mixtral-shape"
        if (system, budget) == ("naive", "4bit-25%"):  # the passthrough store's minimum is above a 4-bit budget
            assert "below the minimum" in r["error"]
            continue
        assert not r.get("error"), r
        assert r["ttft_s"] > 0 and r["prefill_tokens_per_s"] == pytest.approx(300 / r["ttft_s"])
        assert r["peak_rss_mb"] > 0 and r["prefill_memory_bytes"] is not None
        assert r["repeats"] == 1
        assert (r["within_budget"] is None) == (system in ("resident", "moeprep@unlimited"))
    layers, experts = 4, 8
    record_bytes = report["subjects"]["mixtral-shape"]["record_bytes"]  # one precision: every record this size
    floor = rows[("moeprep@unlimited", "100%")]
    # the floor's timed prompt is the second: every expert held since the first, nothing read
    assert floor["bytes_read"] == 0 and floor["records_read"] == 0 and floor["misses"] == 0
    full, low = rows[("moeprep", "100%")], rows[("moeprep", "4bit-25%")]
    for r in (full, low):  # each expert read at most once per layer per chunk, and the counters agree
        assert r["prefill_timing"]["most_reads_per_layer_step"] == 1
        assert 0 < r["records_read"] <= r["chunks"] * layers * experts
        assert r["bytes_read"] == r["records_read"] * record_bytes
        assert r["prefill_timing"]["tokens"] == 300 and r["prefill_timing"]["forwards"] == r["chunks"]
    if sum(full["loader_budget"]["cache_slots"].values()) >= layers * experts:  # all fit: one read each
        assert full["records_read"] <= layers * experts
    # at 4bit-25% the cache holds a few experts: the chunks read some of them again
    assert low["records_read"] > full["records_read"] and low["chunks"] > 1
    for r in (full, low):
        assert r["floor_s"] == floor["ttft_s"]
        assert r["bound_tokens_per_s"] == pytest.approx(300 / max(r["floor_s"], r["io_floor_s"]))
        assert r["fraction_of_bound"] > 0
    assert rows[("accelerate", "4bit-25%")]["disk_read_bytes"] is not None
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["prefill"]["rows"] == json.loads(json.dumps(prefill["rows"]))
    md = (tmp_path / "bench.md").read_text()
    assert "## Prefill" in md and "### mixtral-shape" in md and "| 300 | 4bit-25% | moeprep |" in md
    assert "Decode rows not run" in md and "moeprep's memory within the budget during prefill" in md
    assert all(r["kv_cache_bytes"] == 2 * 4 * 300 * 1 * 32 * 4 for r in prefill["rows"])  # the quick shape


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_LLAMA, reason=llama.missing() or "")
def test_llama_cpp_evaluates_the_prompt_in_its_cgroup(tmp_path, quick_shape_built, one_resident_candidate):
    report = bench_run.run_bench("mixtral-shape-own", "4bit-25%", quick=True, output=tmp_path, echo=lambda m: None,
                                 prefill="300", decode=False, only="llama.cpp,moeprep")
    rows = {r["system"]: r for r in report["prefill"]["rows"]}
    assert set(rows) == {"moeprep@unlimited", "moeprep", "llama.cpp"}
    row = rows["llama.cpp"]
    assert not row.get("error"), row
    assert row["ttft_s"] > 0 and row["chunks"] == 1 and row["cgroup_peak_is_prefill"]
    assert 0 < row["prefill_memory_bytes"] <= row["cgroup_limit_bytes"]
    assert not list(llama.CGROUP_ROOT.glob("moeprep-bench-*"))  # the cgroup went with the run


def test_prefill_rows_choose_resident_by_prompt_speed_without_batched_mm(tmp_path, quick_shape_built, monkeypatch):
    """The orchestration with a stand-in worker: resident's candidates are timed on the shortest prompt and the
    fastest by prompt tokens/s runs every prompt; batched_mm (every token's experts' weights copied) is not a
    candidate; every configuration once per round; the budget-free rows repeated at each budget."""
    monkeypatch.setattr(bench_measure, "CUDA_RESIDENT_DTYPES", ())
    calls = []
    speed = {("float32", "eager"): 50.0, ("float32", "grouped_mm"): 70.0, ("bfloat16", "eager"): 90.0,
             ("bfloat16", "grouped_mm"): 60.0}

    def fake_worker(spec: dict, work) -> dict:
        calls.append(spec)
        assert spec["mode"] == "prefill" and spec["decode_ids"] == []
        tokens = len(spec["prompt_ids"])
        key = (spec.get("dtype"), spec.get("experts_implementation"))
        rate = speed.get(key, 40.0) if spec["system"] == "resident" else {"moeprep@unlimited": 100.0}.get(
            spec["system"], 20.0)
        out = {"prefill_tokens": tokens, "ttft_s": tokens / rate, "prefill_tokens_per_s": rate, "chunks": 1,
               "largest_chunk": tokens, "peak_rss_mb": 1.0, "prefill_memory_bytes": 10,
               "budget_bytes": spec["budget_bytes"]}
        if spec["system"].startswith("moeprep"):
            out |= {"bytes_read": 0}
        return out

    monkeypatch.setattr(bench_measure, "_run_worker", fake_worker)
    report = bench_run.run_bench("mixtral-shape", "25%,4bit-25%", quick=True, output=tmp_path,
                                 traces=tmp_path / "no-traces", echo=lambda m: None, prefill="64,32", decode=False,
                                 repeats=2)
    candidates = [c for c in calls if c["tag"].endswith(f"-{c.get('dtype')}-{c.get('experts_implementation')}")]
    assert {(c["dtype"], c["experts_implementation"]) for c in candidates} == set(speed)  # no batched_mm
    assert {len(c["prompt_ids"]) for c in candidates} == {32}  # timed on the shortest prompt
    prefill = report["prefill"]
    assert prefill["resident"]["mixtral-shape"]["chosen"] == {"dtype": "bfloat16", "experts_implementation": "eager",
                                                              "prefill_tokens_per_s": 90.0}
    rows = [c for c in calls if c not in candidates]
    assert all((c["dtype"], c["experts_implementation"]) == ("bfloat16", "eager") for c in rows
               if c["system"] == "resident")
    per_round = len(rows) // 2
    assert [(c["system"], c["budget"], len(c["prompt_ids"])) for c in rows[:per_round]] == \
        [(c["system"], c["budget"], len(c["prompt_ids"])) for c in rows[per_round:]]
    assert len(prefill["rows"]) == 2 * 2 * 5  # prompts x budgets x (resident, floor, accelerate, naive, moeprep)
    moeprep = [r for r in prefill["rows"] if r["system"] == "moeprep"]
    assert all(r["fraction_of_bound"] == pytest.approx(0.2) and r["repeats"] == 2 for r in moeprep)
    assert any("batched_mm" in note for note in report["notes"])
