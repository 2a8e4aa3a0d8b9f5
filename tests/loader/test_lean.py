"""The lean one-token decode step (``loader/lean.py``) against transformers' own forward of the same model."""

from __future__ import annotations

import pytest
import torch

from loader import kernels
from loader.lean import ENV, LeanLayer
from loader.runtime import load
from tests.helpers.tiny_models import tiny_artifact

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are not built here")
PROMPT = torch.tensor([[3, 17, 5, 42, 9, 11, 2, 30]])


def _decode(loaded, steps: int = 6) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy steps after the prompt: every step's logits and token."""
    logits, tokens = [], []
    with torch.no_grad():
        out = loaded.model(input_ids=PROMPT, use_cache=True)
        for _ in range(steps):
            nxt = out.logits[:, -1:].argmax(-1)
            tokens.append(int(nxt))
            out = loaded.model(input_ids=nxt, cache=out.past_key_values, use_cache=True)
            logits.append(out.logits[0, -1].clone())
    return logits, tokens


def _both(artifact, monkeypatch, **options):
    """(lean run, transformers' run, the lean load's decode_path) of the same artifact and options."""
    loaded = load(artifact, memory_budget="unlimited", **options)
    path = loaded.budget["decode_path"] | {"model_layers": len(loaded.model.model.layers)}
    calls = []
    for layer in loaded.model.model.layers:
        lean = getattr(layer, "_moeprep_lean", None)
        if lean is not None:
            original = lean.original
            lean.original = lambda *a, _o=original, **k: calls.append(a[0].shape[1]) or _o(*a, **k)
    lean_run = _decode(loaded)
    loaded.close()
    monkeypatch.setenv(ENV, "off")
    loaded = load(artifact, memory_budget="unlimited", **options)
    assert loaded.budget["decode_path"] == {"path": "transformers", "why": f"{ENV}=off"}
    plain_run = _decode(loaded)
    loaded.close()
    monkeypatch.delenv(ENV)
    return lean_run, plain_run, path, calls


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_the_lean_step_equals_transformers_bit_for_bit(tmp_path_factory, monkeypatch, arch):
    _, artifact = tiny_artifact(tmp_path_factory, arch, "passthrough")
    (lean_logits, lean_tokens), (plain_logits, plain_tokens), path, calls = _both(artifact, monkeypatch,
                                                                                 dense="float")
    layers, moe_layers = path["model_layers"], len(load_layers(artifact))
    assert path["path"] == "lean" and path["layers"] == layers
    # a block with a shared expert runs as its own module
    assert path["direct_moe_layers"] == (0 if arch == "qwen2_moe" else moe_layers)
    # the prompt went through transformers' forward once per layer; every one-token step through the lean one
    assert calls == [PROMPT.shape[1]] * layers
    assert lean_tokens == plain_tokens
    for a, b in zip(lean_logits, plain_logits, strict=True):
        assert torch.equal(a, b)


@needs_kernels
def test_the_lean_step_with_int8_dense_weights_equals_transformers_with_the_same_weights(tmp_path_factory,
                                                                                           monkeypatch):
    """q, k and v computed as one product of their fused rows: each row as the separate products compute it."""
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "int4")
    (lean_logits, lean_tokens), (plain_logits, plain_tokens), path, _ = _both(artifact, monkeypatch, dense="int8")
    assert path["path"] == "lean"
    assert lean_tokens == plain_tokens
    for a, b in zip(lean_logits, plain_logits, strict=True):
        assert torch.equal(a, b)


def load_layers(artifact):
    import json

    return json.loads((artifact / "manifest.json").read_text())["moe"]["layers"]


def test_a_layer_the_lean_step_does_not_know_keeps_transformers_forward(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "olmoe", "passthrough")
    loaded = load(artifact, memory_budget="unlimited", dense="float")
    try:
        path = loaded.budget["decode_path"]
        assert path["path"] == "transformers" and "OlmoeAttention" in path["why"]
        assert not any(hasattr(layer, "_moeprep_lean") for layer in loaded.model.model.layers)
    finally:
        loaded.close()


def test_a_masked_multi_token_or_hooked_call_runs_transformers_forward(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    loaded = load(artifact, memory_budget="unlimited", dense="float")
    try:
        lean: LeanLayer = loaded.model.model.layers[0]._moeprep_lean
        seen = []
        lean.original = lambda *a, **k: seen.append(k["attention_mask"]) or "transformers"
        x = torch.zeros(1, 1, loaded.model.config.hidden_size)
        mask = torch.ones(1, 1, 1, 2, dtype=torch.bool)
        assert lean.forward(x, attention_mask=mask, cache=object(), position_embeddings=(x, x)) == "transformers"
        assert lean.forward(torch.zeros(1, 2, x.shape[-1]), cache=object(), position_embeddings=(x, x)) == "transformers"
        assert lean.forward(x, cache=None, position_embeddings=(x, x)) == "transformers"
        # a hook on a module the lean step computes without calling it (here the experts) must still run
        handle = loaded.model.model.layers[0].mlp.experts.register_forward_pre_hook(lambda *a: None)
        assert lean.forward(x, cache=object(), position_embeddings=(x, x)) == "transformers"
        handle.remove()
        assert len(seen) == 4 and seen[0] is mask
    finally:
        loaded.close()
