"""The simulator (prep/sim): it replays routing through the loader's own cache and policies.

- On the real Mixtral-8x7B GSM8K traces (``../shared/data/traces``, skipped when absent): the reference
  figures of SOURCES.md (per-layer caches of 2/4/6 of 8, cold start per problem, a token's experts
  inserted together) within half a point: LRU 65.9/40.1/19.5, sequence LFU 65.9/38.7/18.2, Belady
  65.9/27.3/11.1 (``read_mixtral_traces`` trims each problem's layers to the shortest).
- Belady is the floor: it equals a brute-force optimum on small sequences, and no policy beats it on
  any trace used here.
- The loader and the simulator count identical hits, misses and bytes for every policy on the same
  replayed routing (a tiny model, two budgets, a per-layer and a global pool).
- The cost model, warm and cold starts, the CLI's --json keys and its errors.
"""

from __future__ import annotations

import dataclasses
import json
import random
from functools import cache
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from loader.errors import MoeError
from loader.policies import POLICIES, Clock
from prep.cli import main
from prep.sim import (
    DEFAULT_RECORD_BYTES,
    POLICY_NAMES,
    DeviceProfile,
    FutureUses,
    Replay,
    capacity_spec,
    load_replay,
    mixtral_record_bytes,
    simulate,
)

pytestmark = pytest.mark.xdist_group("test_sim")  # one worker builds the module-scoped fixtures, not both

TRACES = Path(__file__).resolve().parents[4] / "shared" / "data" / "traces"
MIXTRAL = TRACES / "mixtral-8x7b" / "gsm8k_routing.jsonl"
needs_traces = pytest.mark.skipif(not MIXTRAL.is_file(), reason=f"the real Mixtral traces are not at {MIXTRAL}")

# SOURCES.md: miss rate (%) per policy at 2 / 4 / 6 of 8 experts per layer.
REFERENCE = {"lru": (65.9, 40.1, 19.5), "lfu": (65.9, 38.7, 18.2), "belady": (65.9, 27.3, 11.1)}


@pytest.fixture(scope="module")
def mixtral() -> Replay:
    return load_replay(MIXTRAL)


def random_replay(seed: int, sequences: int = 2, tokens: int = 40, layers: int = 3, experts: int = 8,
                  top_k: int = 2) -> Replay:
    """Skewed random routing (a few popular experts per layer), so policies differ."""
    rng = random.Random(seed)
    weights = [[rng.random() ** 3 for _ in range(experts)] for _ in range(layers)]
    seqs = []
    for _ in range(sequences):
        seq = []
        for _ in range(tokens):
            token = []
            for layer in range(layers):
                chosen: dict[int, None] = {}
                while len(chosen) < top_k:
                    chosen[rng.choices(range(experts), weights[layer])[0]] = None
                token.append(tuple(chosen))
            seq.append(tuple(token))
        seqs.append(tuple(seq))
    return Replay(tuple(seqs), layers, experts, top_k, f"random-{seed}")


# ------------------------------------------------------------------------------ real Mixtral traces


@needs_traces
def test_mixtral_trace_shape(mixtral):
    assert (mixtral.num_layers, mixtral.num_experts, mixtral.top_k, len(mixtral.sequences)) == (32, 8, 2, 2)
    assert [len(s) for s in mixtral.sequences] == [166, 78]  # 167 and 79 generated, trimmed to the shortest layer


@needs_traces
@pytest.mark.parametrize("policy", sorted(REFERENCE))
@pytest.mark.parametrize("slot", [0, 1, 2])
def test_reference_figures_of_sources_md(mixtral, policy, slot):
    capacity, expected = (2, 4, 6)[slot], REFERENCE[policy][slot]
    result = simulate(mixtral, capacity_spec(32, 8, capacity), policy)
    assert result.requests == mixtral.requests == 2 * 32 * (166 + 78)
    assert abs(100 * result.miss_rate - expected) <= 0.5, (policy, capacity, 100 * result.miss_rate)


@needs_traces
@pytest.mark.parametrize("group", ["layer", "global"])
def test_no_policy_beats_belady_on_mixtral(mixtral, group):
    spec = capacity_spec(32, 8, 4, group)
    floor = simulate(mixtral, spec, "belady").misses
    for policy in POLICIES:
        assert simulate(mixtral, spec, policy).misses >= floor, policy


# ----------------------------------------------------------------------------------- Belady, the floor


def _optimal_misses(sequence, capacity: int) -> int:
    """Brute force over every eviction choice (one layer, a token's experts protected, a miss is cached
    whenever something can be evicted): the fewest misses any policy can get."""

    @cache
    def go(t: int, i: int, resident: frozenset) -> int:
        if t == len(sequence):
            return 0
        token = sequence[t]
        if i == len(token):
            return go(t + 1, 0, resident)
        expert = token[i]
        if expert in resident:
            return go(t, i + 1, resident)
        if len(resident) < capacity:
            return 1 + go(t, i + 1, resident | {expert})
        victims = [r for r in resident if r not in token]
        if not victims:
            return 1 + go(t, i + 1, resident)
        return 1 + min(go(t, i + 1, (resident - {v}) | {expert}) for v in victims)

    return go(0, 0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_the_brute_force_optimum(seed):
    replay = random_replay(seed, sequences=1, tokens=14, layers=1, experts=6, top_k=1 + seed % 2)
    for capacity in (2, 3, 4):
        got = simulate(replay, capacity_spec(1, 6, capacity), "belady").misses
        assert got == _optimal_misses(tuple(t[0] for t in replay.sequences[0]), capacity)


@pytest.mark.parametrize("seed", range(3))
def test_no_policy_beats_belady_on_random_traces(seed):
    replay = random_replay(seed, experts=8, layers=3)
    for group in ("layer", "global"):
        for capacity in (2, 3, 5):
            spec = capacity_spec(3, 8, capacity, group)
            floor = simulate(replay, spec, "belady").misses
            for policy in POLICIES:
                assert simulate(replay, spec, policy).misses >= floor, (policy, group, capacity)


def test_future_uses_next_step():
    future = FutureUses()
    future.start([[(0,), (1,)], [(2,), (0,)], [(0,), (1,)]])  # 3 tokens x 2 layers
    clock = Clock(2, token=0, layer=1)
    assert future.next_step(0, 0, clock) == 2 * 2 + 0  # used at token 0 (past) and token 2
    assert future.next_step(1, 0, clock) == 1 * 2 + 1  # layer 1 of token 1
    assert future.next_step(0, 2, clock) == 1 * 2 + 0  # layer 0 of the next token
    assert future.next_step(1, 1, clock) == 2 * 2 + 1  # this step's own use is not "next"
    assert future.next_step(1, 3, clock) == float("inf")


# ------------------------------------------------------------------------------------- the machinery


def test_default_record_bytes_is_one_int4_mixtral_expert():
    weights = 3 * 4096 * 14336
    assert DEFAULT_RECORD_BYTES == mixtral_record_bytes("int4") == weights // 2 + 2 * 2 * weights // 64
    assert mixtral_record_bytes("passthrough") == 2 * weights


def test_cost_model_adds_reads_and_compute():
    replay = random_replay(1)
    profile = DeviceProfile(read_bandwidth=1e9, read_latency=1e-4, compute_seconds={"int4": 2e-3})
    result = simulate(replay, capacity_spec(3, 8, 3, record_bytes=5_000_000), "lru", profile=profile)
    expected = result.misses * (1e-4 + 5_000_000 / 1e9) + result.requests * 2e-3
    assert result.seconds == pytest.approx(expected)
    assert result.bytes_read == result.misses * 5_000_000
    out = result.to_json()
    assert out["seconds"]["per_token"] == pytest.approx(expected / replay.num_tokens)
    assert sum(layer["seconds"] for layer in out["layers"]) == pytest.approx(expected)


def test_a_miss_also_pays_for_making_its_held_form():
    replay = random_replay(1)
    profile = DeviceProfile(1e9, 1e-4, {"int4": 2e-3}, make_seconds={"int4": 5e-3})
    result = simulate(replay, capacity_spec(3, 8, 3, record_bytes=5_000_000), "lru", profile=profile)
    expected = result.misses * (1e-4 + 5_000_000 / 1e9 + 5e-3) + result.requests * 2e-3
    assert result.seconds == pytest.approx(expected)
    assert DeviceProfile.from_json(profile.to_json()) == profile
    assert DeviceProfile(1e9, 0, {"int4": 1.0}).make("int4") == 0.0  # a profile from before held forms


def test_cold_start_per_sequence_or_warm():
    seq = random_replay(2, sequences=1).sequences[0]
    replay = Replay((seq, seq), 3, 8, 2)
    spec = capacity_spec(3, 8, 8)  # every expert fits: only first uses miss
    cold, warm = simulate(replay, spec, "lru"), simulate(replay, spec, "lru", cold_start=False)
    assert cold.misses == 2 * warm.misses > 0


def test_errors_name_the_fix():
    replay = random_replay(0)
    with pytest.raises(MoeError, match="from 1 to 8"):
        capacity_spec(3, 8, 0)
    with pytest.raises(MoeError, match="from 1 to 8"):
        capacity_spec(3, 8, 9)
    with pytest.raises(MoeError, match="unknown; use one of"):
        simulate(replay, capacity_spec(3, 8, 2), "random")
    with pytest.raises(MoeError, match="3 MoE layers x 8 experts"):
        simulate(replay, capacity_spec(2, 8, 2), "lru")
    with pytest.raises(MoeError, match="does not exist"):
        load_replay("/nonexistent/trace")


def test_project_trace_directory(tmp_path, one_thread):
    from prep.methods.trace import open_trace, record_traces
    from tests.helpers.tiny_models import build_tiny_model, random_sequences

    model = build_tiny_model("qwen2_moe")  # MoE layers 0 and 2: positions 0 and 1
    out = record_traces(model, random_sequences(2, 9, seed=4), tmp_path / "trace", record_hidden=False)
    replay = load_replay(out)
    routing = open_trace(out).routing()
    assert (replay.num_layers, replay.num_experts, len(replay.sequences)) == (2, model.config.num_experts, 2)
    assert [list(map(list, token)) for token in replay.sequences[1]] == routing[1].expert_ids.tolist()
    floor = simulate(replay, capacity_spec(2, replay.num_experts, 2), "belady").misses
    for policy in POLICIES:
        assert simulate(replay, capacity_spec(2, replay.num_experts, 2), policy).misses >= floor


# ---------------------------------------------------------------------------------------------- CLI


@needs_traces
def test_cli_json_has_the_interface_keys():
    result = CliRunner().invoke(main, ["simulate", "--trace", str(MIXTRAL), "--policy", "lru", "--capacity", "4",
                                       "--group", "layer", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert {"policy", "capacity", "requests", "misses", "miss_rate", "layers"} <= set(out)
    assert (out["policy"], out["capacity"], out["requests"]) == ("lru", 4, 15616)
    assert out["miss_rate"] == pytest.approx(out["misses"] / out["requests"])
    assert len(out["layers"]) == 32 and sum(layer["misses"] for layer in out["layers"]) == out["misses"]


def test_cli_sweep_plot_and_table(tmp_path):
    trace = tmp_path / "routing.jsonl"  # a small trace in the real Mixtral format
    rng = random.Random(0)
    lines = [json.dumps({"dataset": "x", "problem_id": 0, "layer": layer, "experts": rng.sample(range(8), 2),
                         "gating_probs": [0.6, 0.4], "token_idx": t}) for t in range(30) for layer in range(2)]
    trace.write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    result = runner.invoke(main, ["simulate", "--trace", str(trace), "--policy", "all", "--capacity", "2,4",
                                  "--group", "both", "--json", "--plot", str(tmp_path / "sweep.png")])
    assert result.exit_code == 0, result.output
    runs = json.loads(result.stdout)["runs"]
    assert len(runs) == 2 * 2 * len(POLICY_NAMES)
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    table = runner.invoke(main, ["simulate", "--trace", str(trace), "--policy", "lru,belady", "--capacity", "2,4"])
    assert table.exit_code == 0 and "| belady |" in table.stdout and "2/8 per layer" in table.stdout
    single = runner.invoke(main, ["simulate", "--trace", str(trace), "--policy", "hobbit", "--capacity", "3",
                                  "--param", "w_fld=0.7", "--param", "w_lru=0.1", "--param", "w_lfu=0.1",
                                  "--param", "w_lhu=0.1"])
    assert single.exit_code == 0 and "policy       hobbit" in single.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--trace", "/nonexistent", "--policy", "lru", "--capacity", "4"], "does not exist"),
    (["--policy", "nope", "--capacity", "4"], "unknown"),
    (["--policy", "lru", "--capacity", "0"], "from 1 to 8"),
    (["--policy", "lru", "--capacity", "9"], "from 1 to 8"),
    (["--policy", "lru", "--capacity", "four"], "comma-separated list"),
    (["--policy", "lru"], "--capacity"),
    (["--policy", "lru", "--capacity", "4", "--profile", "/nonexistent.json"], "profile-device"),
])
def test_cli_errors_are_clean(tmp_path, args, message):
    trace = tmp_path / "routing.jsonl"
    trace.write_text("".join(json.dumps({"problem_id": 0, "layer": 0, "experts": [e % 8, (e + 1) % 8],
                                         "gating_probs": [0.5, 0.5], "token_idx": e}) + "\n" for e in range(5)))
    if "--trace" not in args:
        args = ["--trace", str(trace), *args]
    result = CliRunner().invoke(main, ["simulate", *args])
    assert result.exit_code == 1 and "error:" in result.stderr and message in result.stderr, result.output
    assert "Traceback" not in result.output


# ---------------------------------------------------------------------------------- loader vs simulator


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory):
    """A tiny passthrough Mixtral artifact (2 MoE layers x 4 experts, top-2), as tests/loader/test_routing.py builds it."""
    from tests.helpers.tiny_models import prepare_tiny_artifact

    return prepare_tiny_artifact(tmp_path_factory.mktemp("sim-loader"), until="package")[1]


def test_simulator_matches_loader(tiny_artifact, one_thread):
    """Same replayed routing, two sequences decoded one token at a time on one loaded model (the loader
    resets per sequence and keeps contents: the simulator's warm start), for every loader policy, two
    budgets, per-layer and global pools: identical hits, misses and bytes read per layer."""
    from loader.plan import Pool, read_plan
    from loader.routing import ReplayRouting
    from loader.runtime import load, minimum_budget
    from prep.sim import artifact_spec

    tokens, layers, experts = 10, 2, 4
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(2 * tokens * layers)])
    ids = ids.view(2 * tokens, layers, 2)  # sequence A = rows 0..9, B = rows 10..19
    weights = torch.full(ids.shape, 0.5)
    replay = Replay(tuple(tuple(tuple(tuple(e) for e in tok) for tok in ids[s * tokens:(s + 1) * tokens].tolist())
                          for s in range(2)), layers, experts, 2)
    token_ids = torch.randint(4, 60, (2, tokens), generator=gen)

    class Stream(ReplayRouting):
        def reset(self):  # the records run on across sequences: sequence B gets B's rows
            pass

    base = read_plan(tiny_artifact)
    plans = {"layer": base, "global": dataclasses.replace(base, pools=(Pool("main", base.pools[0].precision, 1.0,
                                                                            "global"),))}
    checked = 0
    for group, plan in plans.items():
        low = minimum_budget(tiny_artifact, plan=plan)
        spec_low = artifact_spec(tiny_artifact, low, plan=plan)
        record = spec_low.slot_bytes[plan.pools[0].precision]
        for budget in (low, low + 2 * layers * record):  # 1 and 3 records per layer (or 2 and 6 in all)
            spec = artifact_spec(tiny_artifact, budget, plan=plan)
            for policy in POLICIES:
                loaded = load(tiny_artifact, memory_budget=budget, policy=policy, plan=plan,
                              routing=Stream(ids, weights))
                try:
                    with torch.no_grad():
                        for s in range(2):
                            past = None
                            for t in range(tokens):
                                out = loaded.model(input_ids=token_ids[s:s + 1, t:t + 1], past_key_values=past,
                                                   use_cache=True)
                                past = out.past_key_values
                    stats = loaded.stats()
                finally:
                    loaded.close()
                sim = simulate(replay, spec, policy, cold_start=False)
                keys = ("hits", "misses", "joins", "skipped", "prefetches", "bytes_read")
                got = [{k: stats["layers"][str(layer)][k] for k in keys} for layer in range(layers)]
                want = [{k: getattr(r, k) for k in keys} for r in sim.layers]
                assert got == want, (group, budget, policy)
                checked += 1
    assert checked == 2 * 2 * len(POLICIES)


@pytest.fixture(scope="module")
def mixed_artifact(tmp_path_factory):
    """A tiny Mixtral artifact with experts at int4 and at int2 (random halves), both stores."""
    from tests.helpers.tiny_models import prepare_tiny_artifact, tiny_recipe

    recipe = tiny_recipe("int4", quantize={"also": ["int2"]}, bitwidth={"method": "random", "share": 0.5, "low": "int2"})
    return prepare_tiny_artifact(tmp_path_factory.mktemp("sim-mixed"), recipe=recipe)[1]


@pytest.mark.parametrize("rule", ["always", "int2"])
def test_a_cpu_computed_miss_replays_identically_in_the_simulator(mixed_artifact, one_thread, monkeypatch, rule):
    """The replay gate: the loader (the accelerated path on ``FakeLink``, the store in host RAM) decoding one
    token at a time under a CPU rule, and the simulator given the same rule on the same routing, take the same
    decisions in the same order per layer: which experts were served on the CPU, read, or hit. The CPU-served
    misses compute the same logits as reading them, and every count agrees."""
    from loader.routing import ReplayRouting
    from loader.runtime import load, minimum_budget
    from loader.schedule import CPU, LayerSchedule
    from prep.sim import artifact_spec
    from prep.sim.simulate import cpu_miss_rule
    from tests.helpers.loader_fakes import FakeLink

    tokens, layers, experts = 12, 2, 4
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens * layers)]).view(tokens, layers, 2)
    weights = torch.full(ids.shape, 0.5)
    replay = Replay((tuple(tuple(tuple(e) for e in tok) for tok in ids.tolist()),), layers, experts, 2)
    token_ids = torch.randint(4, 60, (1, tokens), generator=gen)
    budget = minimum_budget(mixed_artifact, store="host") + 2 * 4096
    monkeypatch.setattr("loader.runtime.link_for", lambda device: FakeLink())

    seen: list = []
    begin = LayerSchedule.begin

    def recording(self, layer, rows, *args, **kwargs):
        decisions, skipped = begin(self, layer, rows, *args, **kwargs)
        seen.append((layer, [(d.expert, d.precision, "cpu" if d.served == CPU else "read" if d.entry is None
                              else "join" if d.entry.in_flight else "hit") for d in decisions]))
        return decisions, skipped

    monkeypatch.setattr(LayerSchedule, "begin", recording)

    def decode(cpu_misses):
        loaded = load(mixed_artifact, memory_budget=budget, store="host", routing=ReplayRouting(ids, weights),
                      cpu_misses="always" if cpu_misses == "always" else "never")
        if cpu_misses not in ("always", "never"):
            loaded.runtime.schedule.cpu_rule = cpu_miss_rule(cpu_misses)  # what auto would measure
        try:
            with torch.no_grad():
                past, logits = None, []
                for t in range(tokens):
                    out = loaded.model(input_ids=token_ids[:, t:t + 1], past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    logits.append(out.logits[0, -1])
            return torch.stack(logits), loaded.stats()
        finally:
            loaded.close()

    expected, _ = decode("never")
    seen.clear()
    got, stats = decode(rule)
    loader_seen, seen[:] = list(seen), []
    sim = simulate(replay, artifact_spec(mixed_artifact, budget, store="host"), cold_start=False,
                   cpu_misses=cpu_miss_rule(rule))
    assert seen == loader_seen
    kinds = {kind for _, ds in seen for *_, kind in ds}
    assert kinds == ({"cpu"} if rule == "always" else {"cpu", "read", "hit"}), kinds
    assert (got - expected).abs().max() <= 1e-5  # served on the CPU or read: the same experts' outputs
    keys = ("hits", "misses", "joins", "skipped", "cpu_computed", "bytes_read")
    assert [{k: stats["layers"][str(layer)][k] for k in keys} for layer in range(layers)] == \
        [{k: getattr(r, k) for k in keys} for r in sim.layers]
    assert stats["compute"]["cpu_computed"] == sim.cpu_computed == sum(kind == "cpu" for _, ds in seen
                                                                       for *_, kind in ds)
    assert stats["compute"]["cpu_misses"] == ("always" if rule == "always" else "auto")
    assert sim.to_json()["cpu_computed"] == sim.cpu_computed > 0

def test_cli_plan_from_an_artifact(tiny_artifact):
    """--plan takes an artifact (or its plan.json): capacities as the loader builds them, the plan's policy."""
    from loader.runtime import minimum_budget

    trace = next(tiny_artifact.parent.rglob("index.json")).parent  # the pipeline's own trace stage
    budget = str(minimum_budget(tiny_artifact))
    runner = CliRunner()
    result = runner.invoke(main, ["simulate", "--trace", str(trace), "--plan", str(tiny_artifact), "--budget", budget,
                                  "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["policy"] == "lru" and out["group"] == "plan" and set(out["capacity"]) == {"main"}
    assert out["requests"] == sum(layer["requests"] for layer in out["layers"]) > 0
    sweep = runner.invoke(main, ["simulate", "--trace", str(trace), "--plan", str(tiny_artifact / "plan.json"),
                                 "--budget", budget, "--policy", "all", "--json"])
    runs = {r["policy"]: r["misses"] for r in json.loads(sweep.stdout)["runs"]}
    assert runs["lru"] == out["misses"] and min(runs.values()) == runs["belady"]
    low = runner.invoke(main, ["simulate", "--trace", str(trace), "--plan", str(tiny_artifact), "--budget", "1KB"])
    assert low.exit_code == 1 and "raise the budget" in low.stderr
    cpu = runner.invoke(main, ["simulate", "--trace", str(trace), "--plan", str(tiny_artifact), "--budget", budget,
                               "--cpu-misses", "always", "--json"])
    on_cpu = json.loads(cpu.stdout)
    assert on_cpu["cpu_computed"] == on_cpu["misses"] > 0 and on_cpu["bytes_read"] == 0
    assert on_cpu["cpu_misses"] == {"mode": "always", "prefer": []}
    bad = runner.invoke(main, ["simulate", "--trace", str(trace), "--plan", str(tiny_artifact), "--cpu-misses", "auto"])
    assert bad.exit_code == 1 and "precisions computed on the CPU" in bad.stderr


def test_a_calibrated_profile_models_the_loaders_step():
    """Hits compute while the layer's reads run; the layer stalls for the rest; each layer call costs the
    loader's overhead. Computed by hand on a two-layer, two-token replay."""
    from loader.device import calibrated

    replay = Replay(((((0, 1), (2, 3)), ((0, 2), (2, 3))),), 2, 4, 2)  # token 2: layer 0 one hit, layer 1 two hits
    spec = capacity_spec(2, 4, 4, record_bytes=1000)
    plain = DeviceProfile(1e6, 0.0, {"int4": 4e-4}, make_seconds={"int4": 1e-4})  # a read: 1 ms + 0.1 ms made
    profile = calibrated(plain, 5e-5)
    got = simulate(replay, spec, "lru", profile=profile)
    # token 1: 2 misses per layer, no hit: 2.2 ms stall + 0.8 ms compute + overhead, twice
    # token 2, layer 0: one hit (0.4 ms) against one read (1.1 ms): 0.7 ms stall + 0.8 ms compute + overhead
    # token 2, layer 1: two hits, no read: 0.8 ms compute + overhead
    want = 2 * (2.2e-3 + 0.8e-3) + (0.7e-3 + 0.8e-3) + 0.8e-3 + 4 * 5e-5
    assert got.seconds == pytest.approx(want)
    assert simulate(replay, spec, "lru", profile=plain).seconds == pytest.approx(2 * 3.0e-3 + 1.9e-3 + 0.8e-3)
    assert DeviceProfile.from_json(profile.to_json()) == profile
    outside = simulate(replay, spec, "lru", profile=calibrated(plain, 5e-5, 2e-3))  # + 2 ms a token outside
    assert outside.seconds == pytest.approx(want + 2 * 2e-3)
    with pytest.raises(MoeError, match="calibration"):
        DeviceProfile.from_json(profile.to_json() | {"calibration": {"overlap": "yes"}})


def test_a_cpu_computed_miss_is_counted_and_modelled_at_the_profiles_compute_time():
    """A miss the CPU rule serves reads nothing and is never cached: with the profile's compute time and no
    read, it is done while the layer's reads run. Computed by hand on a one-layer, two-token replay."""
    from loader.device import calibrated
    from loader.schedule import CpuMissRule
    from prep.sim.simulate import cpu_miss_rule

    replay = Replay(((((0, 1),), ((0, 2),)),), 1, 4, 2)
    spec = capacity_spec(1, 4, 4, record_bytes=1000)
    plain = DeviceProfile(1e6, 0.0, {"int4": 4e-4}, make_seconds={"int4": 1e-4})  # a read: 1 ms + 0.1 ms made
    off = simulate(replay, spec, "lru", profile=plain)
    assert (off.cpu_computed, off.bytes_read) == (0, 3000) and off.seconds == pytest.approx(3 * 1.1e-3 + 4 * 4e-4)
    on = simulate(replay, spec, "lru", profile=plain, cpu_misses=CpuMissRule("always"))
    assert (on.misses, on.cpu_computed, on.bytes_read, on.hits) == (4, 4, 0, 0)  # expert 0 missed again
    assert on.seconds == pytest.approx(4 * 4e-4)
    assert on.to_json()["layers"][0]["cpu_computed"] == 4
    elsewhere = simulate(replay, spec, "lru", profile=plain, cpu_misses=cpu_miss_rule("int2"))  # not int4's
    assert elsewhere.to_json() == off.to_json() | {"cpu_misses": {"mode": "auto", "prefer": ["int2"]}}
    assert simulate(replay, spec, "lru", profile=calibrated(plain, 5e-5),
                    cpu_misses=CpuMissRule("always")).seconds == pytest.approx(4 * 4e-4 + 2 * 5e-5)
    assert cpu_miss_rule("never") == CpuMissRule("never") and cpu_miss_rule(None) is None
    assert cpu_miss_rule("int4, int2") == CpuMissRule("auto", frozenset({"int4", "int2"}))
    for bad in ("auto", "", "always,int4"):
        with pytest.raises(MoeError, match="--cpu-misses"):
            cpu_miss_rule(bad)

def test_a_calibrated_profile_charges_wasted_prefetches_where_the_disk_is_the_bottleneck():
    """One disk: a token takes at least the time of all its reads. A predictor that always prefetches an
    expert nobody uses adds its reads to each token once reads exceed the layers' path."""
    from loader.device import calibrated
    from loader.predict import Predictor, PrefetchRequest
    from prep.sim.simulate import PredictionFeed

    class Wrong(Predictor):
        name = "wrong"

        def after_router(self, layer, router_input, indices):
            return [PrefetchRequest(1, 3)] if layer == 0 else []

    replay = Replay(((((0, 1), (0, 1)), ((0, 1), (0, 1))),), 2, 4, 2)  # token 2: every expert a hit
    spec = capacity_spec(2, 4, 4, record_bytes=1000)
    profile = calibrated(DeviceProfile(1e6, 0.0, {"int4": 4e-4}), 0.0)  # a read: 1 ms; an expert: 0.4 ms
    feed = PredictionFeed([torch.zeros(2, 2, 8)], None, [(torch.zeros(4, 8), None)] * 2, {})
    off = simulate(replay, spec, "lru", profile=profile)
    on = simulate(replay, spec, "lru", profile=profile, predictors=[Wrong()], feed=feed)
    assert off.io_bound_seconds == 0.0 and off.seconds == pytest.approx(2 * 2e-3 + 4 * 0.8e-3)
    # token 1: 4 demand reads + the wasted prefetch = 5 ms of reads against a 4 + 1.6 ms path: no excess;
    # token 2: all hits (1.6 ms path) against one prefetch read: held already (expert 3 of layer 1 was read
    # in token 1), so nothing more is read
    assert on.layers[1].prefetches == 1 and on.layers[1].prefetch_wasted == 1
    assert on.seconds == pytest.approx(off.seconds)
    hungry = Replay(((((0, 1), (0, 1)),),), 2, 4, 2)
    tight = capacity_spec(2, 4, 3, record_bytes=1000)
    slow_disk = calibrated(DeviceProfile(1e5, 0.0, {"int4": 1e-6}), 0.0)  # a read: 10 ms; compute ~0
    base = simulate(hungry, tight, "lru", profile=slow_disk)
    wasted = simulate(hungry, tight, "lru", profile=slow_disk, predictors=[Wrong()], feed=feed)
    # 5 reads (50 ms) against a path of 4 stalls (40 ms) and 4 products (4 us)
    assert wasted.io_bound_seconds == pytest.approx(10e-3 - 4e-6)
    assert wasted.seconds == pytest.approx(base.seconds + 10e-3 - 4e-6)


def test_the_simulator_stops_prefetching_where_the_loader_does():
    """The prefetch gate runs in the schedule the simulator shares with the loader: a predictor that is always
    wrong is read until 64 prefetches have been decided (all wasted), then never again, and no longer asked."""
    from loader.predict import Predictor, PrefetchRequest
    from loader.schedule import PrefetchGate
    from prep.sim.simulate import PredictionFeed

    class Wrong(Predictor):
        name = "wrong"
        calls = 0

        def after_router(self, layer, router_input, indices):
            Wrong.calls += 1
            if layer:
                return []
            return [PrefetchRequest(1, 2 + Wrong.calls // 2 % 2)]  # 2, 3, 2, ...: layer 1 uses only 0 and 1

    tokens = 100
    replay = Replay(((((0, 1), (0, 1)),) * tokens,), 2, 4, 2)
    spec = capacity_spec(2, 4, 3, record_bytes=1000)  # 0, 1 and the last prediction: each new one is read
    feed = PredictionFeed([torch.zeros(tokens, 2, 8)], None, [(torch.zeros(4, 8), None)] * 2, {})
    result = simulate(replay, spec, "lru", predictors=[Wrong()], feed=feed)
    warmup = PrefetchGate().warmup
    assert result.layers[1].prefetches == result.layers[1].prefetch_wasted == warmup
    assert Wrong.calls == 2 * warmup  # both layers' routers of the tokens before the gate closed
