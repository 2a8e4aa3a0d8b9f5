"""The loader's three predictors (loader/predict.py) against hand-made contexts: next-gate walks, path statistics
with a cap and a floor, the first gate's top-k; unknown predictors and bad settings are refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loader.predict import FirstGatePredictor, NextGates, PathStatsPredictor, PredictorError, make_predictor
from prep.methods.routing_stats import fit_path_stats
from tests.helpers.predict_contexts import E, K, L, deterministic_routing, predictor_context


def test_next_gates_walk_to_the_first_layer_with_a_missing_expert():
    gen = torch.Generator().manual_seed(3)
    hidden = 5
    routers = [(torch.randn(E, hidden, generator=gen), None) for _ in range(L)]
    x = torch.randn(1, hidden, generator=gen)
    predicted = {layer: F.linear(x, w).topk(K).indices[0].tolist() for layer, (w, _) in enumerate(routers)}
    held = {(1, e) for e in predicted[1]}  # layer 1's prediction is resident; layer 2 misses one
    gates = NextGates(depth=3)
    gates.bind(predictor_context(lambda layer, e, p: (layer, e) in held, routers=routers))
    requests = gates.after_router(0, x, torch.tensor([[0, 1]]))
    assert [(r.layer, r.expert) for r in requests] == [(1, e) for e in predicted[1]] + [(2, e) for e in predicted[2]]
    # everything resident: the walk goes to the end of the model (depth) and stops there, no wrap
    everything = NextGates(depth=5)
    everything.bind(predictor_context(lambda layer, e, p: True, routers=routers))
    assert {r.layer for r in everything.after_router(1, x, torch.tensor([[0, 1]]))} == {2, 3}
    assert everything.after_router(L - 1, x, torch.tensor([[0, 1]])) == []
    one = NextGates(depth=1, experts=1)
    one.bind(predictor_context(routers=routers))
    assert [(r.layer, r.expert) for r in one.after_router(0, x, torch.tensor([[0, 1]]))] == [(1, predicted[1][0])]


def test_path_stats_predictor_takes_the_ranked_next_layer_with_a_cap_and_a_floor():
    routing = deterministic_routing()
    tensors = fit_path_stats(routing, E)
    token = routing[0][0].tolist()
    predictor = PathStatsPredictor(max_preload=3, floor=0.05, min_count=1)
    predictor.bind(predictor_context(tensors=tensors))
    assert predictor.after_router(0, torch.zeros(1, 4), torch.tensor([token[0]])) != []
    got = predictor.after_router(1, torch.zeros(1, 4), torch.tensor([token[1]]))
    assert sorted(r.expert for r in got) == sorted(token[2]) and {r.layer for r in got} == {2}  # floor drops p=0
    capped = PathStatsPredictor(max_preload=1, floor=0.0, min_count=1)
    capped.bind(predictor_context(tensors=tensors))
    capped.after_router(0, torch.zeros(1, 4), torch.tensor([token[0]]))
    assert len(capped.after_router(1, torch.zeros(1, 4), torch.tensor([token[1]]))) == 1
    with pytest.raises(PredictorError, match="path_stats in predict.predictors"):
        PathStatsPredictor().bind(predictor_context())


def test_first_gate_predictor_names_the_top_k_of_the_last_position():
    weight = torch.randn(E, 6, generator=torch.Generator().manual_seed(4))
    hidden = torch.randn(1, 3, 6)
    predictor = FirstGatePredictor()
    predictor.bind(predictor_context(tensors={"first_gate.weight": weight}))
    requests = predictor.after_last_layer(hidden)
    assert [(r.layer, r.expert) for r in requests] == [(0, e) for e in (hidden[0, -1] @ weight.T).topk(K).indices.tolist()]
    with pytest.raises(PredictorError, match="first_gate in predict.predictors"):
        FirstGatePredictor().bind(predictor_context())
    with pytest.raises(PredictorError, match="unknown"):
        make_predictor("oracle")
    with pytest.raises(PredictorError, match="depth"):
        make_predictor("next_gates", {"depth": 0})


def test_a_single_tokens_ranking_takes_the_short_path_and_agrees_with_the_votes():
    """A decode step ranks one token's experts by sort alone; the vote count over the same token twice (the general
    path) gives the same experts in the same order, and the stacked routers agree with one product per layer."""
    from loader.predict import ranked_votes, stacked_router_logits

    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        z = torch.randn(1, 16, generator=g)
        for k, limit in ((2, 2), (4, 3), (1, 5)):
            assert ranked_votes(z, k, limit) == ranked_votes(z.repeat(2, 1), k, limit)
    w, b, x = torch.randn(3, 16, 32, generator=g), torch.randn(3, 16, generator=g), torch.randn(1, 32, generator=g)
    expected = torch.stack([x @ w[i].T + b[i] for i in range(3)])
    assert torch.allclose(stacked_router_logits(w, b, x), expected, atol=1e-5)
