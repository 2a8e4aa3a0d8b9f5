"""Routing and predictor contexts made by hand, for the tests of path statistics (prep) and of the loader's
predictors (loader/predict.py): E experts, top-K, L layers."""

from __future__ import annotations

import torch

from loader.predict import PredictorContext

E, K, L = 8, 2, 4


def deterministic_routing(n_seq: int = 3, tokens: int = 40, seed: int = 0) -> list[torch.Tensor]:
    """Layer 0 random; every later layer's pair is a fixed function of the previous layer's pair."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_seq):
        rows = []
        for _ in range(tokens):
            first = torch.randperm(E, generator=gen)[:K].tolist()
            layers = [first]
            for _ in range(1, L):
                a, b = sorted(layers[-1])
                layers.append([(a + b) % E, (a + b + 1) % E])
            rows.append(layers)
        out.append(torch.tensor(rows))
    return out


def predictor_context(held=lambda layer, expert, precision: False, tensors=None, routers=None) -> PredictorContext:
    """A context of L layers of E experts, top-K: ``held`` says what is resident, every expert is int4."""
    return PredictorContext(L, E, K, routers or [], tensors or {}, held=held, precision_of=lambda layer, e: "int4")
