"""Doing less per token: AdapMoE's Fisher sensitivity against an independent autograd pass,
the adaptive-gating rule (the digest's worked numbers, a dropped expert never read, the loader equal to
the same policy on plain transformers), HOBBIT's unimportance score and precision split (the real Mixtral
traces' 64.8 / 32.1 / 3.1), and the dynamic-precision miss policy in the loader."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from loader.plan import PolicySpec, read_plan
from loader.routing import (
    SKIP,
    AdaptiveGating,
    DynamicPrecision,
    MissPolicy,
    RoutingError,
    install_routing,
    unimportance,
)
from loader.runtime import load, minimum_budget, renormalized
from prep.adapters import get_adapter
from prep.methods.fisher import fisher_sensitivity
from prep.methods.routing_stats import gating_share, precision_split, split_thresholds
from tests.helpers.tiny_models import (
    build_tiny_model,
    mixed_precision_artifact,
    random_sequences,
    tiny_artifact,
)

TRACES = Path(__file__).resolve().parents[4] / "shared" / "data" / "traces"


# ------------------------------------------------------------------------------------------- Fisher


def _autograd_sensitivity(model, adapter, sequences, scale=1.0):
    """The same quantity computed independently: torch.autograd.grad of the summed loss w.r.t. each MoE
    block output, squared norms summed over predicted positions, divided by their count."""
    blocks = [adapter.moe_block(model, layer) for layer in adapter.moe_layers]
    totals, positions = torch.zeros(len(blocks), dtype=torch.float64), 0
    for seq in sequences:
        outs = [None] * len(blocks)
        handles = [b.register_forward_hook(lambda _m, _a, o, i=i, outs=outs: outs.__setitem__(i, adapter.block_output(o)))
                   for i, b in enumerate(blocks)]
        try:
            ids = seq.view(1, -1)
            with torch.enable_grad():
                embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
                logits = model(inputs_embeds=embeds, use_cache=False).logits[0, :-1]
                loss = scale * F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")
                grads = torch.autograd.grad(loss, outs)
        finally:
            for h in handles:
                h.remove()
        for i, g in enumerate(grads):
            totals[i] += g.double().square().sum()
        positions += seq.numel() - 1
    return (totals / positions).tolist()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "deepseek_v2", "gpt_oss"])
def test_fisher_sensitivity_equals_an_independent_autograd_pass_and_scales_with_the_loss_squared(arch):
    model = build_tiny_model(arch).eval()
    adapter = get_adapter(model)
    seqs = random_sequences(3, 12, seed=1)
    got = fisher_sensitivity(model, adapter, seqs)
    expected = _autograd_sensitivity(model, adapter, seqs)
    assert got.positions == sum(s.numel() - 1 for s in seqs)
    assert got.sensitivity == pytest.approx(expected, rel=1e-6)
    assert all(v > 0 for v in got.sensitivity)
    scaled = fisher_sensitivity(model, adapter, seqs, loss_scale=3.0)
    assert scaled.sensitivity == pytest.approx([9 * v for v in got.sensitivity], rel=1e-6)
    assert [p.requires_grad for p in model.parameters()] == [p.requires_grad for p in build_tiny_model(arch).parameters()]


# ------------------------------------------------------------------------------------ adaptive gating


def test_the_gating_rule_matches_the_digests_worked_numbers():
    # S = 46.69, T = 0.005: tau = sqrt(T / S) = 0.01035; (0.99, 0.01) -> one expert; (0.98, 0.02) -> both
    policy = AdaptiveGating(0.005, [46.69])
    weights = torch.tensor([[0.99, 0.01], [0.98, 0.02], [0.5, 0.5]])
    new, idx = policy.route(0, None, weights, torch.tensor([[3, 1], [2, 5], [0, 4]]))
    assert new.tolist() == [pytest.approx([1.0, 0.0]), pytest.approx([0.98, 0.02]), pytest.approx([0.5, 0.5])]
    assert idx.tolist() == [[3, 1], [2, 5], [0, 4]]
    stats = policy.stats()
    assert stats["single"] == 1 and stats["decisions"] == 3 and stats["runs_after"] == 5
    assert stats["single_ratio"] == pytest.approx(1 / 3) and stats["runs_saved"] == pytest.approx(1 / 6)
    # top-k > 2 (the extension): the lightest contiguous tail whose mass m has m^2 * S <= T goes, never the top-1
    wide = AdaptiveGating(0.011, [1.0])
    kept = wide.route(0, None, torch.tensor([[0.6, 0.05, 0.3, 0.05]]), torch.tensor([[0, 1, 2, 3]]))[0]
    assert kept[0].tolist() == pytest.approx([0.6 / 0.9, 0.0, 0.3 / 0.9, 0.0])  # 0.1^2 <= 0.011 < 0.4^2
    # a router that does not renormalize keeps its total
    raw = AdaptiveGating(1.0, [1.0]).route(0, None, torch.tensor([[0.3, 0.1]]), torch.tensor([[0, 1]]))[0]
    assert raw[0].tolist() == pytest.approx([0.4, 0.0])
    assert AdaptiveGating(0.0, [5.0]).route(0, None, weights, torch.zeros(3, 2, dtype=torch.long))[0].equal(weights)
    with pytest.raises(RoutingError, match="threshold"):
        AdaptiveGating(-1, [1.0])


def test_gating_share_from_recorded_weights_counts_decisions_and_runs():
    weights = torch.tensor([[[0.99, 0.01], [0.6, 0.4]], [[0.7, 0.3], [0.95, 0.05]]])  # [N=2, L=2, K=2]
    share = gating_share(weights, [1.0, 1.0], threshold=0.01)  # drop when w2 <= 0.1
    assert [r["single"] for r in share["layers"]] == [0.5, 0.5]
    assert share["single"] == 0.5 and share["runs_saved"] == 0.25


class _Recording(AdaptiveGating):
    def route(self, layer, logits, weights, indices, view=None):
        new, idx = super().route(layer, logits, weights, indices, view)
        self.kept = getattr(self, "kept", set()) | {(layer, int(e)) for e, w in zip(idx.flatten(), new.flatten(), strict=True)
                                                    if float(w) != 0}
        self.dropped = getattr(self, "dropped", set()) | {(layer, int(e)) for e, w in zip(idx.flatten(), new.flatten(), strict=True)
                                                          if float(w) == 0}
        return new, idx


def test_the_loader_with_gating_equals_plain_transformers_with_it_and_never_reads_a_dropped_expert(tmp_path_factory):
    model, artifact = tiny_artifact(tmp_path_factory, "mixtral")
    n_layers = len(json.loads((artifact / "manifest.json").read_text())["moe"]["layers"])
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(4))
    policy = _Recording(0.02, [1.0] * n_layers)
    loaded = load(artifact, memory_budget=minimum_budget(artifact), routing=policy)
    reads = []
    submit = loaded.runtime.reader.submit
    loaded.runtime.reader.submit = lambda job: reads.append(job.key) or submit(job)
    with torch.no_grad():
        got = loaded.model(input_ids=ids).logits
    stats = loaded.stats()
    layer_ids = loaded.runtime.layer_ids
    loaded.close()
    plain = type(model)(model.config).eval()
    plain.load_state_dict(model.state_dict())
    paths = json.loads((artifact / "manifest.json").read_text())["moe"]["experts_modules"]
    install_routing(plain, paths, AdaptiveGating(0.02, [1.0] * n_layers))
    with torch.no_grad():
        expected = plain(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert stats["routing"]["single"] > 0
    only_dropped = policy.dropped - policy.kept
    assert only_dropped  # some expert was chosen by the router only to be dropped
    read = {(layer_ids.index(int(k.split(".")[1])), int(k.split(".")[3])) for k in reads}
    assert not read & only_dropped  # a dropped expert is never read
    assert read <= policy.kept


# ---------------------------------------------------------------------------------- dynamic precision


def test_unimportance_is_the_normalized_weight_of_the_more_important_selections():
    w = torch.tensor([[0.5, 0.3, 0.2], [1.0, 2.0, 1.0], [0.2, 0.8, 0.0]])
    expected = [[0.0, 0.5, 0.8], [0.5, 0.0, 0.75], [0.8, 0.0, 1.0]]
    assert [pytest.approx(row) for row in expected] == unimportance(w).tolist()


def test_hobbits_split_on_the_real_mixtral_traces():
    if not (TRACES / "mixtral-8x7b").is_dir():
        pytest.skip(f"the real Mixtral traces are not at {TRACES}")
    from prep.methods.trace import read_mixtral_traces

    weights = torch.cat([t.expert_weights.reshape(-1, 2) for t in read_mixtral_traces(TRACES)])
    split = precision_split(weights, 0.6, 0.9)
    assert (round(split["high"] * 100, 1), round(split["low"] * 100, 1), round(split["skip"] * 100, 1)) == (64.8, 32.1, 3.1)
    t1, t2 = split_thresholds(weights, split["high"], split["skip"])
    again = precision_split(weights, t1, t2)
    assert again["high"] == pytest.approx(split["high"], abs=0.002) and again["skip"] == pytest.approx(split["skip"], abs=0.002)


def test_split_thresholds_hit_the_target_split_on_synthetic_weights():
    gen = torch.Generator().manual_seed(0)
    w1 = 0.5 + 0.5 * torch.rand(4000, generator=gen)
    weights = torch.stack([w1, 1 - w1], -1)
    t1, t2 = split_thresholds(weights, high=0.7, skip=0.05)
    split = precision_split(weights, t1, t2)
    assert split["high"] == pytest.approx(0.7, abs=0.002) and split["skip"] == pytest.approx(0.05, abs=0.002)
    assert split_thresholds(weights, 0.5) == (0.0, 1.0)  # only the top-1s high, nothing skipped


def test_dynamic_precision_decides_by_the_most_demanding_token_and_keeps_the_top1_high():
    policy = DynamicPrecision(0.6, 0.9, "int2")
    idx = torch.tensor([[0, 1], [2, 1], [3, 4]])
    w = torch.tensor([[0.95, 0.05], [0.7, 0.3], [0.55, 0.45]])
    assert policy.decide(0, 0, "int4", idx, w) == "int4"  # a top-1
    assert policy.decide(0, 1, "int4", idx, w) == "int2"  # scores 0.95 and 0.7: the lower decides, low
    assert policy.decide(0, 4, "int4", idx, w) == "int4"  # score 0.55 <= t1
    assert DynamicPrecision(0.6, 0.9, "int2").decide(0, 1, "int4", idx[:1], w[:1]) == SKIP  # 0.95 > t2
    assert policy.stats()["high"] == 2 and policy.stats()["low"] == 1


def test_renormalized_rescales_each_tokens_rest_to_its_former_total():
    w = torch.tensor([[0.6, 0.4], [0.7, 0.3], [1.0, 0.0]])
    idx = torch.tensor([[0, 1], [2, 3], [1, 5]])
    got = renormalized(w, idx, [1])
    assert [pytest.approx(row) for row in ([1.0, 0.0], [0.7, 0.3], [0.0, 0.0])] == got.tolist()


def test_dynamic_precision_in_the_loader_reads_low_copies_and_skips(tmp_path_factory, tmp_path):
    """A passthrough + int4 artifact: t1 = 0, t2 = 1 reads every non-top-1 miss at int4; t2 = 0 skips them
    (with renormalize, the top-1 carries the token alone). Outputs stay finite and the stores read agree."""
    _model, art, _full, _low = mixed_precision_artifact(tmp_path_factory, tmp_path)
    plan = json.loads((art / "plan.json").read_text())
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    results = {}
    for name, policy in (("low", DynamicPrecision(0.0, 1.0, "int4")),
                         ("skip", DynamicPrecision(0.0, 0.0, "int4", renormalize=True)),
                         ("off", None)):
        loaded = load(art, memory_budget="unlimited", miss_policy=policy)
        with torch.no_grad():
            logits = loaded.model(input_ids=ids).logits
        results[name] = (logits, loaded.stats())
        loaded.close()
    assert plan["pools"]
    low_stats = results["low"][1]["miss_policy"]
    assert low_stats["low"] > 0 and low_stats["skip"] == 0
    skip_stats = results["skip"][1]["miss_policy"]
    assert skip_stats["skip"] > 0 and results["skip"][1]["skipped"] == skip_stats["skip"]
    assert results["skip"][1]["bytes_read"] < results["off"][1]["bytes_read"]
    for logits, _ in results.values():
        assert torch.isfinite(logits).all()
    assert not torch.allclose(results["skip"][0], results["off"][0])


# ------------------------------------------------------------------------------- recipe switches, e2e


def _recipe(**sections):
    from tests.helpers.tiny_models import tiny_recipe

    return tiny_recipe("passthrough", calibration={"num_sequences": 4, "sequence_length": 24}, **sections)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v2"])
def test_gating_from_the_recipe_runs_in_the_loader_exactly_as_on_plain_transformers(tmp_path, arch):
    from prep.stages.gating import threshold_for_share
    from tests.helpers.tiny_models import prepare_tiny_artifact

    model, artifact = prepare_tiny_artifact(tmp_path, arch, recipe=_recipe(gating={"enabled": True, "target_single": 0.3,
                                                                                    "num_sequences": 2}))
    plan = json.loads((artifact / "plan.json").read_text())
    report = json.loads((artifact / "report.json").read_text())["gating"]
    assert plan["routing"]["name"] == "adaptive_gating" and plan["miss"]["name"] == "plan"
    params = plan["routing"]["params"]
    assert params["threshold"] > 0 and len(params["sensitivity"]) == len(plan["expert_precision"])
    assert report["single"] >= 0.3 and report["threshold"] == params["threshold"]
    assert threshold_for_share(torch.tensor([[[0.9, 0.1]]]), [1.0], 0.0) == 0.0
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    loaded = load(artifact, memory_budget="unlimited")
    with torch.no_grad():
        got = loaded.model(input_ids=ids).logits
    stats = loaded.stats()["routing"]
    loaded.close()
    manifest = json.loads((artifact / "manifest.json").read_text())["moe"]
    install_routing(model, manifest["experts_modules"], AdaptiveGating(**params), router_paths=manifest["router_modules"])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert stats["policy"] == "adaptive_gating" and stats["decisions"] > 0


def test_gating_with_a_tolerance_keeps_the_kl_within_it(tmp_path):
    from tests.helpers.tiny_models import prepare_tiny_artifact

    tolerance = 1e-4
    _, artifact = prepare_tiny_artifact(tmp_path, "mixtral", recipe=_recipe(gating={
        "enabled": True, "target_single": 0.9, "tolerance": tolerance, "num_sequences": 2}))
    details = json.loads((artifact / "report.json").read_text())["gating"]["details"]
    assert details["trail"][0][1] > tolerance  # 90% single decisions is too much for the tiny model
    assert details["loss"] is not None and details["loss"] <= tolerance
    assert all(t <= details["trail"][0][0] for t, _ in details["trail"])


def test_dynamic_precision_from_the_recipe_ships_low_copies_and_no_pool_of_their_own(tmp_path):
    from tests.helpers.tiny_models import prepare_tiny_artifact

    recipe = _recipe(quantize={"precision": "int4", "also": ["int2"]},
                     dynamic_precision={"enabled": True, "low": "int2", "high_share": 0.6, "skip_share": 0.1})
    model, artifact = prepare_tiny_artifact(tmp_path, "olmoe", recipe=recipe)
    plan = json.loads((artifact / "plan.json").read_text())
    manifest = json.loads((artifact / "manifest.json").read_text())
    report = json.loads((artifact / "report.json").read_text())["dynamic_precision"]
    assert plan["miss"]["name"] == "dynamic_precision" and plan["miss"]["params"]["low"] == "int2"
    assert [(p["precision"], p["share"]) for p in plan["pools"]] == [("int4", 1.0)]  # low copies take its slots
    n = len(manifest["moe"]["layers"]) * manifest["moe"]["num_experts"]
    assert len(manifest["stores"]["int2"]["xxh3"]) == len(manifest["stores"]["int4"]["xxh3"]) == n
    assert report["split"]["high"] == pytest.approx(0.6, abs=0.05) and report["split"]["skip"] == pytest.approx(0.1, abs=0.05)
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(3))
    outs = {}
    for name, policy in (("plan", None), ("all high", DynamicPrecision(1.0, 1.0, "int2")), ("off", [])):
        loaded = load(artifact, memory_budget="unlimited",
                      miss_policy=policy if policy != [] else MissPolicy())
        with torch.no_grad():
            outs[name] = loaded.model(input_ids=ids).logits
        stats = loaded.stats()
        loaded.close()
        if name == "plan":
            assert stats["miss_policy"]["policy"] == "dynamic_precision"
            assert stats["miss_policy"]["low"] + stats["miss_policy"]["skip"] > 0
    assert torch.equal(outs["all high"], outs["off"])  # every knob at "high": exactly the planned reads
    assert not torch.allclose(outs["plan"], outs["off"])


def test_every_technique_is_off_by_default_and_bad_knobs_name_the_fix(tmp_path):
    from prep.errors import MoeprepError

    recipe = _recipe()
    assert not recipe.gating.enabled and not recipe.dynamic_precision.enabled
    with pytest.raises(MoeprepError, match="quantize.also"):
        _recipe(dynamic_precision={"enabled": True, "low": "int2"})
    with pytest.raises(MoeprepError, match="t1 and t2"):
        _recipe(dynamic_precision={"t1": 0.5})
    with pytest.raises(MoeprepError, match="target_single"):
        _recipe(gating={"target_single": 1.5})


def test_the_simulator_and_the_loader_make_identical_gating_and_precision_decisions(tmp_path):
    """One calibration sequence of the project's own trace replayed token by token: through the loader (its
    routers replaced by the recorded decisions, then the plan's gating; the plan's dynamic precision) and
    through the simulator with the same policies. Hits, misses, skips and bytes agree per layer, and so do
    the policies' own counts."""
    from loader.routing import ChainedRouting, ReplayRouting
    from prep.sim.replay import load_replay
    from prep.sim.simulate import artifact_spec, simulate
    from tests.helpers.tiny_models import prepare_tiny_artifact

    recipe = _recipe(quantize={"precision": "int4", "also": ["int2"]}, gating={"enabled": True, "target_single": 0.3},
                     dynamic_precision={"enabled": True, "low": "int2", "high_share": 0.5, "skip_share": 0.15})
    _, artifact = prepare_tiny_artifact(tmp_path, "mixtral", recipe=recipe)
    [trace] = (tmp_path / "artifacts/tiny/stages").glob("trace-*/trace")
    full = load_replay(trace)
    replay = type(full)(full.sequences[:1], full.num_layers, full.num_experts, full.top_k, "first", full.weights[:1])
    plan = json.loads((artifact / "plan.json").read_text())
    gating, dynamic = plan["routing"]["params"], plan["miss"]["params"]
    budget = minimum_budget(artifact) + 3 * 4096

    ids = torch.tensor(replay.sequences[0])  # [T, L, K]
    weights = torch.tensor(replay.weights[0])
    loader_gating, loader_miss = AdaptiveGating(**gating), DynamicPrecision(**dynamic)
    loaded = load(artifact, memory_budget=budget, routing=ChainedRouting(ReplayRouting(ids, weights), loader_gating),
                  miss_policy=loader_miss)
    tokens = torch.zeros(1, ids.shape[0], dtype=torch.long)
    with torch.no_grad():
        out = loaded.model(input_ids=tokens[:, :1], use_cache=True)
        for t in range(1, ids.shape[0]):
            out = loaded.model(input_ids=tokens[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
    stats = loaded.stats()
    loaded.close()

    sim_gating, sim_miss = AdaptiveGating(**gating), DynamicPrecision(**dynamic)
    result = simulate(replay, artifact_spec(artifact, budget), routing=sim_gating, miss=sim_miss).to_json()
    for layer, row in enumerate(result["layers"]):
        mine = stats["layers"][str(layer)]
        assert (row["hits"], row["misses"], row["skipped"], row["bytes_read"]) == (
            mine["hits"], mine["misses"], mine["skipped"], mine["bytes_read"]), layer
    assert sim_gating.stats() == loader_gating.stats() and sim_gating.stats()["single"] > 0
    assert sim_miss.stats() == loader_miss.stats()
    assert sim_miss.stats()["low"] > 0 and sim_miss.stats()["skip"] > 0


# -------------------------------------------------------------------------- cache-conditional routing


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v2", "gpt_oss"])
def test_selection_weights_reproduce_each_routers_own_weights(arch):
    from loader.routing import selection_weights

    model = build_tiny_model(arch).eval()
    adapter = get_adapter(model)
    router = adapter.router(model, adapter.moe_layers[0])
    x = torch.randn(16, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, weights, indices = router(x)
    got = selection_weights(adapter.routing_weights(), logits, indices.long())
    assert torch.allclose(got, weights.float(), atol=1e-6), arch


class _View:
    """A stand-in for a layer's cache view: resident experts (oldest first) and a capacity in records."""

    def __init__(self, resident, capacity):
        self._resident, self._capacity = list(resident), capacity

    def resident(self):
        return dict.fromkeys(self._resident, "int4")

    def in_flight(self):
        return {}

    def capacity_records(self):
        return self._capacity


SOFTMAX = {"function": "softmax", "renormalize": True, "scale": 1.0, "jitter_eps": 0.0}


def _logits_ranked(order, n=8):
    z = torch.zeros(1, n)
    for rank, e in enumerate(order):
        z[0, e] = 10.0 - rank
    return z


def test_max_rank_promotes_cached_experts_within_the_top_m_and_keeps_the_top_j():
    from loader.routing import CacheConditionalRouting, selection_weights

    # the digest's example: r = (3, 5, 1, 7, ...), cached {0, 1, 2, 7}, K = 2, J = 1, m = 4 -> {3, 1}
    z = _logits_ranked([3, 5, 1, 7, 0, 2, 4, 6])
    exact_w, exact_i = torch.tensor([[0.7, 0.3]]), torch.tensor([[3, 5]])
    policy = CacheConditionalRouting("max_rank", SOFTMAX, m=4, top_j=1)
    w, i = policy.route(0, z, exact_w, exact_i, _View([0, 1, 2, 7], 4))
    assert sorted(i[0].tolist()) == [1, 3]
    assert torch.allclose(w, selection_weights(SOFTMAX, z, i))  # the router's own weights for the new choice
    # m = K is exact routing; without a view (a plain model) nothing changes
    same = CacheConditionalRouting("max_rank", SOFTMAX, m=2, top_j=1).route(0, z, exact_w, exact_i, _View([0, 1, 2, 7], 4))
    assert same[1].equal(exact_i) and same[0].equal(exact_w)
    assert policy.route(0, z, exact_w, exact_i, None)[1].equal(exact_i)
    # threshold: a tau the top-1 alone reaches gives m = 1 <= K, exact
    confident = CacheConditionalRouting("threshold", SOFTMAX, tau=0.5, top_j=1)
    assert confident.route(0, z, exact_w, exact_i, _View([0, 1, 2, 7], 4))[1].equal(exact_i)


def test_the_cache_prior_is_exact_at_zero_and_prefers_resident_experts_as_lambda_grows():
    from loader.routing import CacheConditionalRouting

    z = _logits_ranked([3, 5, 1, 7, 0, 2, 4, 6])
    exact_w, exact_i = torch.tensor([[0.7, 0.3]]), torch.tensor([[3, 5]])
    view = _View([0, 6], 4)
    zero = CacheConditionalRouting("prior", SOFTMAX, lam=0.0)
    assert zero.route(0, z, exact_w, exact_i, view)[1].equal(exact_i)
    strong = CacheConditionalRouting("prior", SOFTMAX, lam=5.0, top_j=1)
    _, i = strong.route(0, z, exact_w, exact_i, view)
    assert i[0, 0] == 3 or 3 in i[0].tolist()  # the top-1 stays (J = 1)
    assert sorted(i[0].tolist()) == [0, 3]  # the best resident expert replaces the uncached rank-2 one
    greedy = CacheConditionalRouting("prior", SOFTMAX, lam=5.0, top_j=0)
    assert sorted(greedy.route(0, z, exact_w, exact_i, view)[1][0].tolist()) == [0, 6]  # J = 0: only cached
    assert strong.stats()["changed"] == 1


def test_the_tokens_of_one_call_see_the_cache_as_decode_would():
    """Routing T tokens in one call equals routing them one by one with the view updated in between by
    least-recently-used admission of each token's experts (heaviest first) at the layer's capacity."""
    from loader.routing import CacheConditionalRouting

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(12, 8, generator=gen)
    probs = logits.softmax(-1)
    w, i = probs.topk(2, -1)
    w = w / w.sum(-1, keepdim=True)
    together = CacheConditionalRouting("prior", SOFTMAX, lam=0.8, top_j=1)
    all_w, all_i = together.route(0, logits, w, i, _View([1, 4, 6], 3))
    alone = CacheConditionalRouting("prior", SOFTMAX, lam=0.8, top_j=1)
    resident = [1, 4, 6]
    for t in range(12):
        one_w, one_i = alone.route(0, logits[t:t + 1], w[t:t + 1], i[t:t + 1], _View(resident, 3))
        assert one_i.equal(all_i[t:t + 1]) and torch.allclose(one_w, all_w[t:t + 1]), t
        for slot in sorted(range(2), key=lambda s: -float(one_w[0, s])):
            e = int(one_i[0, slot])
            if e in resident:
                resident.remove(e)
            resident.append(e)
        resident = resident[-3:]
    assert together.stats()["changed"] > 0


def test_cache_routing_from_the_recipe_is_exact_at_zero_and_the_simulator_agrees_with_the_loader(tmp_path,
                                                                                                    one_thread):
    """The logits at lam 0 equal top-k's bit for bit: one thread, so both loads add in one order on any CPU."""
    from prep.methods.trace import RoutingRecorder
    from prep.sim.replay import Replay
    from prep.sim.simulate import artifact_spec, simulate
    from tests.helpers.tiny_models import prepare_tiny_artifact

    recipe = _recipe(cache_routing={"enabled": True, "method": "prior", "lam": 0.0})
    model, artifact = prepare_tiny_artifact(tmp_path, "qwen3_moe", recipe=recipe)
    plan = json.loads((artifact / "plan.json").read_text())
    manifest = json.loads((artifact / "manifest.json").read_text())["moe"]
    assert plan["routing"]["name"] == "cache_routing"
    # outputs depend on what is resident: the divergence is measured at the plan's budget too, not only unlimited
    divergence = json.loads((artifact / "report.json").read_text())["divergence"]
    assert divergence["memory_budget"] == "unlimited" and len(divergence["points"]) == 1
    assert plan["routing"]["params"]["weights"] == manifest["routing_weights"] == get_adapter(model).routing_weights()
    assert len(plan["routing"]["params"]["logit_range"]) == len(manifest["layers"])
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(6))
    budget = minimum_budget(artifact) + 2 * 4096
    exact = load(artifact, memory_budget=budget, plan=dataclasses.replace(read_plan(artifact), routing=PolicySpec("topk")))
    at_zero = load(artifact, memory_budget=budget)
    with torch.no_grad():
        assert torch.equal(exact.model(input_ids=ids).logits, at_zero.model(input_ids=ids).logits)
    exact.close()
    at_zero.close()

    params = plan["routing"]["params"] | {"lam": 2.0}
    strong = dataclasses.replace(read_plan(artifact), routing=PolicySpec("cache_routing", params))
    loaded = load(artifact, memory_budget=budget, plan=strong)
    with RoutingRecorder(loaded.model, get_adapter(loaded.model), record_hidden=False) as recorder, torch.no_grad():
        out = loaded.model(input_ids=ids[:, :1], use_cache=True)
        for t in range(1, ids.shape[1]):
            out = loaded.model(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
        captured = recorder.pop()
    stats = loaded.stats()
    loaded.close()
    layers = manifest["layers"]
    chosen = torch.stack([captured[f"layers.{layer}.expert_ids"] for layer in layers], 1)  # [T, L, K]
    weights = torch.stack([captured[f"layers.{layer}.expert_weights"] for layer in layers], 1)
    logits = torch.stack([captured[f"layers.{layer}.router_logits"] for layer in layers], 1)
    replay = Replay((tuple(tuple(tuple(e) for e in tok) for tok in chosen.tolist()),), len(layers),
                    manifest["num_experts"], manifest["top_k"], "loader", (tuple(tuple(tuple(x) for x in tok)
                                                                                for tok in weights.tolist()),), (logits,))
    result = simulate(replay, artifact_spec(artifact, budget, plan=strong)).to_json()
    assert stats["routing"]["changed"] > 0
    for layer, row in enumerate(result["layers"]):
        mine = stats["layers"][str(layer)]
        assert (row["hits"], row["misses"]) == (mine["hits"], mine["misses"]), layer


def test_the_routing_study_measures_every_method_and_lands_in_report_json(tmp_path):
    import yaml

    from loader.verify import verify
    from prep.studies.routing import merge_into, run_study
    from tests.helpers.tiny_models import save_tiny_model, write_tiny_suites

    save_tiny_model("mixtral", tmp_path / "model")
    write_tiny_suites(tmp_path / "suites")
    recipe = _recipe(quantize={"precision": "passthrough", "also": ["int4"]}, dynamic_precision={"low": "int4"})
    recipe_path = tmp_path / "tiny.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe.to_dict()))
    knobs = {"gating": (0.3,), "dynamic_precision": ((0.6, 0.1),), "cache_prior": (1.0,), "max_rank": (3,)}
    run = dict(budgets=("unlimited",), knobs=knobs, suites=("mmlu", "truthfulqa"), limit=3, data=tmp_path / "suites",
               sequences=2, echo=lambda m: None)  # loglikelihood suites only: no generation, seconds not minutes
    study = run_study(recipe_path, tmp_path / "study", tmp_path, **run)
    methods = [p["method"] for p in study["points"]]
    assert methods == ["exact", "gating", "dynamic_precision", "cache_prior", "max_rank"]
    exact = study["points"][0]
    assert all(abs(s["delta"]) == 0 for s in exact["suites"].values())  # lossless, exact routing
    assert study["points"][1]["routing"]["single_ratio"] > 0
    assert study["points"][2]["miss_policy"]["policy"] == "dynamic_precision"
    assert set(study["goals"]["unlimited"]) == {"cache_prior", "gating", "dynamic_precision"}
    again = run_study(recipe_path, tmp_path / "study", tmp_path, **run)
    assert again["points"] == study["points"]  # kept, not measured again
    artifact = tmp_path / "study" / "artifact"
    merge_into(artifact, study, (tmp_path / "study" / "study.png").read_bytes())
    assert verify(artifact) == []
    curves = json.loads((artifact / "report.json").read_text())["routing_curves"]
    assert set(curves) == set(methods) and {"miss_rate", "bytes_per_token", "deltas", "knob"} <= set(curves["gating"][0])
    assert "## Routing study" in (artifact / "report.md").read_text()


@pytest.mark.parametrize("method, knob", [("prior", {"lam": 4.0}), ("max_rank", {"m": 8})])
def test_cache_routing_with_a_tolerance_lowers_its_knob_until_the_kl_is_within(tmp_path, method, knob):
    from tests.helpers.tiny_models import prepare_tiny_artifact

    tolerance = 1e-3
    recipe = _recipe(cache_routing={"enabled": True, "method": method, "tolerance": tolerance, "cache_share": 0.25,
                                    "num_sequences": 2, **knob})
    _, artifact = prepare_tiny_artifact(tmp_path, "mixtral", recipe=recipe)
    report = json.loads((artifact / "report.json").read_text())["cache_routing"]
    params = json.loads((artifact / "plan.json").read_text())["routing"]["params"]
    details = report["details"]
    name = details["knob"]
    assert details["trail"][0] == [next(iter(knob.values())), pytest.approx(details["trail"][0][1])]
    assert details["trail"][0][1] > tolerance  # the recipe's value is too aggressive for the tiny model
    assert details["loss"] <= tolerance and params[name] == report["knobs"][name] < next(iter(knob.values()))


def test_latency_first_uses_a_held_low_copy_where_strict_reads_the_planned_precision():
    class Held:
        def has(self, expert, precision=None):
            return expert == 1 and precision == "int2"

    idx, w = torch.tensor([[1, 0]]), torch.tensor([[0.9, 0.1]])
    strict, fast = DynamicPrecision(0.6, 0.9, "int2"), DynamicPrecision(0.6, 0.9, "int2", strict=False)
    for policy in (strict, fast):
        policy.view = lambda layer: Held()
    assert strict.decide(0, 1, "int4", idx, w) == "int4"  # the top-1 wants high; a low copy does not do
    assert fast.decide(0, 1, "int4", idx, w) == "int2" and fast.stats()["low_copy_used"] == 1
    assert fast.decide(0, 3, "int4", torch.tensor([[3, 0]]), w) == "int4"  # nothing held: read high


def test_moeload_generate_switches_the_plans_routing_and_miss_policies_off(tmp_path):
    from click.testing import CliRunner

    from loader.cli import main as moeload
    from tests.helpers.tiny_models import prepare_tiny_artifact

    recipe = _recipe(quantize={"precision": "int4", "also": ["int2"]}, gating={"enabled": True, "target_single": 0.3},
                     dynamic_precision={"enabled": True, "low": "int2"})
    _, artifact = prepare_tiny_artifact(tmp_path, "qwen2_moe", recipe=recipe)
    runs = {}
    for flags in ((), ("--exact-routing", "--planned-precision")):
        result = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "ABCDE", "--max-new-tokens", "4",
                                              "--memory-budget", "unlimited", "--json", *flags])
        assert result.exit_code == 0, result.output
        runs[flags] = json.loads(result.output)["stats"]
    assert runs[()]["routing"]["policy"] == "adaptive_gating" and runs[()]["miss_policy"]["policy"] == "dynamic_precision"
    off = runs[("--exact-routing", "--planned-precision")]
    assert off["routing"] is None and off["miss_policy"] is None
