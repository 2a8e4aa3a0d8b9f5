"""Routing policies: replay hands the experts exactly the recorded decisions; the default changes nothing."""

from __future__ import annotations

import json

import pytest
import torch

from loader.routing import (
    CacheConditionalRouting,
    ReplayRouting,
    RoutingError,
    RoutingPolicy,
    install_routing,
)
from loader.runtime import load
from tests.helpers.tiny_models import prepare_tiny_artifact

PROMPT, DECODE = 6, 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(transformers model, artifact dir, experts module paths) of a tiny passthrough Mixtral."""
    model, artifact = prepare_tiny_artifact(tmp_path_factory.mktemp("routing"), until="package")
    paths = json.loads((artifact / "manifest.json").read_text())["moe"]["experts_modules"]
    return model, artifact, paths


def _recorded(tokens: int, layers: int, experts: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(tokens * layers)])
    weights = torch.rand(tokens * layers, 2, generator=gen)
    weights = weights / weights.sum(-1, keepdim=True)
    return ids.view(tokens, layers, 2), weights.view(tokens, layers, 2)


def _run(model, ids):
    """Prefill ``PROMPT`` tokens, then decode the rest one token at a time; returns every step's logits."""
    with torch.no_grad():
        out = model(input_ids=ids[:, :PROMPT], use_cache=True)
        logits = [out.logits]
        for t in range(PROMPT, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, dim=1)


def test_replay_feeds_the_recorded_decisions_to_the_loaders_experts(tiny):
    model, artifact, paths = tiny
    expert_ids, weights = _recorded(PROMPT + DECODE, len(paths), model.config.num_local_experts)
    loaded = load(artifact, memory_budget="unlimited", routing=ReplayRouting(expert_ids, weights))
    seen = {i: [] for i in range(len(paths))}

    def capture(layer):
        def hook(module, args):
            seen[layer].append((args[1].clone(), args[2].clone()))
        return hook

    for i, path in enumerate(paths):
        loaded.model.get_submodule(path).register_forward_pre_hook(capture(i))
    ids = torch.randint(4, 60, (1, PROMPT + DECODE), generator=torch.Generator().manual_seed(1))
    got = _run(loaded.model, ids)
    for layer, calls in seen.items():
        assert [c[0].shape[0] for c in calls] == [PROMPT] + [1] * DECODE  # prefill consumed PROMPT records
        assert torch.equal(torch.cat([c[0] for c in calls]), expert_ids[:, layer])
        assert torch.allclose(torch.cat([c[1] for c in calls]), weights[:, layer])
    stats = loaded.stats()
    assert stats["hits"] + stats["misses"] > 0

    # The same replay installed on plain transformers routes identically: same logits.
    installed = install_routing(model, paths, ReplayRouting(expert_ids, weights))
    try:
        expected = _run(model, ids)
    finally:
        installed.remove()
    assert torch.allclose(got, expected, atol=1e-5)
    loaded.close()


def test_default_policy_leaves_the_logits_unchanged(tiny):
    model, artifact, paths = tiny
    ids = torch.randint(4, 60, (1, PROMPT + DECODE), generator=torch.Generator().manual_seed(2))
    expected = _run(model, ids)
    for routing in (None, RoutingPolicy()):
        loaded = load(artifact, memory_budget="unlimited", routing=routing)
        assert loaded.routing.handles == []  # nothing hooked: the model routes itself
        assert torch.allclose(_run(loaded.model, ids), expected, atol=1e-5)
        loaded.close()


def test_replay_refuses_what_does_not_fit(tiny):
    model, artifact, paths = tiny
    expert_ids, weights = _recorded(PROMPT, len(paths), model.config.num_local_experts)
    with pytest.raises(RoutingError, match="MoE layers"):
        install_routing(model, paths, ReplayRouting(expert_ids[:, :1], weights[:, :1]))
    installed = install_routing(model, paths, ReplayRouting(expert_ids, weights))
    try:
        with pytest.raises(RoutingError, match="exhausted"):
            _run(model, torch.randint(4, 60, (1, PROMPT + 1)))
    finally:
        installed.remove()
    with pytest.raises(RoutingError, match="same shape"):
        ReplayRouting(expert_ids, weights[:1])


def test_cache_routing_names_a_bad_or_unknown_knob():
    weights = {"function": "softmax", "renormalize": True, "scale": 1.0, "jitter_eps": 0.0}
    policy = CacheConditionalRouting("prior", weights, lam=0.5, logit_range=[2.0, 4.0])
    assert (policy.lam, policy.m, policy.top_j, policy.range_sum) == (0.5, None, 1, {0: 2.0, 1: 4.0})
    with pytest.raises(RoutingError, match="cache_routing.lam must be a number >= 0, got -1"):
        CacheConditionalRouting("prior", weights, lam=-1)
    with pytest.raises(RoutingError, match="cache_routing.m must be a whole number >= 1"):
        CacheConditionalRouting("max_rank", weights, m=0)
    with pytest.raises(RoutingError, match=r"cache_routing has no knobs \['lamda'\]; its knobs are method, weights, lam"):
        CacheConditionalRouting("prior", weights, lamda=0.5)
    with pytest.raises(RoutingError, match="routing_weights must be"):
        CacheConditionalRouting("prior", {"function": "argmax"})
