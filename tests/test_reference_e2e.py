"""End to end on the reference model: prepare a lossless artifact, verify it, generate under 30%."""

from __future__ import annotations

from pathlib import Path

import torch

from loader.format import verify
from loader.runtime import load
from prep.pipeline import prepare
from prep.recipe import load_recipe
from prep.reference.metrics import load_model

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "recipes" / "reference" / "model"


def test_lossless_artifact_generates_exactly_what_transformers_does(tmp_path):
    recipe = load_recipe(REPO / "recipes/reference-lossless.yaml", (f"model.path={MODEL}",
                                                                     "calibration.num_sequences=4"))
    summary = prepare(recipe, root=tmp_path)
    artifact = Path(summary["artifact"])
    assert verify(artifact) == []
    model, tokenizer = load_model(MODEL)
    prompt = "Question: Anna has 12 apples. Anna buys 5 more apples. How many apples does Anna have now?\nAnswer:"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                  pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        expected = model.generate(input_ids=ids, **kwargs)
        loaded = load(artifact, memory_budget="30%")
        got = loaded.model.generate(input_ids=ids, **kwargs)
    stats = loaded.stats()
    loaded.close()
    assert torch.equal(got, expected)
    assert all(int(s) < 8 for s in loaded.budget["cache_slots"].values())  # 30% really offloads
    assert stats["misses"] > 0 and stats["hits"] > 0
