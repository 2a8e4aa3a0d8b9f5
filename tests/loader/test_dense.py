"""The dense weights' int8 held form (loader/dense.py): the rounding against its own bound, ``Int8Linear`` against
the float product of the weights it stands for, which modules a model holds at int8, the plan's ``dense`` and
``package.dense``, and the fallback without the compiled kernels."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from loader import kernels
from loader.dense import Int8Linear, decode_int8, hold_dense_int8, quantize_int8
from loader.errors import LoaderError
from loader.plan import Plan, PlanError
from loader.runtime import load
from prep.errors import MoeprepError
from prep.stages.package import PackageSection
from tests.helpers.tiny_models import tiny_artifact

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the compiled kernels are not built here")


@pytest.mark.parametrize("rows,cols,group", [(48, 64, 64), (40, 96, 32), (20, 48, 16), (17, 128, 64)])
def test_int8_rounding_is_within_half_a_step_and_keeps_zero(rows, cols, group):
    torch.manual_seed(rows)
    weight = torch.randn(rows, cols) * torch.rand(rows, 1) * 3
    weight[0, :group] = 0  # a group of zeros: a zero weight stays exactly zero
    parts = quantize_int8(weight, group)
    step = parts["scale"].float().repeat_interleave(group, dim=1)
    err = (decode_int8(parts) - weight).abs()
    assert bool((err <= step / 2 + 1e-6 * weight.abs()).all())
    assert bool((decode_int8(parts)[0, :group] == 0).all())
    assert parts["codes"].dtype == torch.uint8 and parts["zero"].float().frac().abs().max() == 0


@needs_kernels
@pytest.mark.parametrize("rows,cols,group", [(48, 64, 64), (40, 96, 32), (20, 48, 16), (1000, 256, 64)])
@pytest.mark.parametrize("tokens", [1, 2, 7, 64])
def test_int8_linear_is_the_float_product_of_its_weights_within_int8_activations(rows, cols, group, tokens):
    """The kernel rounds the activations to int8 per block of 64 (32/16 where the groups are smaller): a relative
    error of about half a percent, bounded here at 2% of the output's norm; the bias is added in float."""
    torch.manual_seed(tokens)
    linear = torch.nn.Linear(cols, rows, bias=True)
    held = Int8Linear(linear, group)
    x = torch.randn(3, tokens, cols)
    with torch.no_grad():
        expected = torch.nn.functional.linear(x, decode_int8(held.parts), linear.bias)
        got, half = held(x), held(x.to(torch.bfloat16))
    assert got.shape == expected.shape and got.dtype == x.dtype and half.dtype == torch.bfloat16
    assert float((got - expected).norm() / expected.norm()) < 0.02
    assert float((half.float() - expected).norm() / expected.norm()) < 0.03


def _logits(loaded, ids):
    with torch.no_grad():
        return loaded.model(input_ids=ids).logits


@needs_kernels
def test_the_plans_dense_int8_holds_attention_and_head_and_keeps_routers_float(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    ids = torch.randint(4, 60, (2, 12), generator=torch.Generator().manual_seed(3))
    plain = load(artifact, memory_budget="unlimited")
    assert plain.budget["dense"] == {"form": "float"}  # a lossless artifact's plan keeps them as stored
    expected = _logits(plain, ids)
    plain.close()
    loaded = load(artifact, memory_budget="unlimited", plan=dataclasses.replace(plain.runtime.plan, dense="int8"))
    held = {n for n, m in loaded.model.named_modules() if isinstance(m, Int8Linear)}
    got = _logits(loaded, ids)
    report = loaded.budget["dense"]
    loaded.close()
    layers = loaded.model.config.num_hidden_layers
    assert held == {f"model.layers.{i}.self_attn.{p}" for i in range(layers) for p in ("q_proj", "k_proj", "v_proj",
                                                                                         "o_proj")} | {"lm_head"}
    assert report["form"] == "int8" and report["matrices"] == len(held) and report["int8_bytes"] < report["float_bytes"]
    assert not any(isinstance(m, Int8Linear) for n, m in loaded.model.named_modules() if ".gate" in n)
    assert float((got - expected).abs().max()) < 0.05 * float(expected.abs().max())
    assert bool((got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9)


@needs_kernels
def test_load_dense_overrides_the_plan_and_is_checked(tmp_path_factory):
    _, artifact = tiny_artifact(tmp_path_factory, "mixtral", "passthrough")
    loaded = load(artifact, memory_budget="unlimited", dense="int8")
    assert loaded.budget["dense"]["form"] == "int8"
    loaded.close()
    with pytest.raises(LoaderError, match="dense 'int4' unknown"):
        load(artifact, dense="int4")


def test_without_the_kernels_dense_int8_stays_float(tmp_path_factory, monkeypatch):
    monkeypatch.setattr(kernels, "available", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32))
    assert hold_dense_int8(model)["form"] == "float"
    assert type(model[0]) is torch.nn.Linear


def test_the_plan_carries_dense_and_refuses_an_unknown_form():
    plan = Plan.default(2, 4, "int4")
    assert "dense" not in plan.to_json() and Plan.from_json(plan.to_json()).dense == "float"
    raw = dataclasses.replace(plan, dense="int8").to_json()
    assert Plan.from_json(raw).dense == "int8"
    with pytest.raises(PlanError, match="dense must be one of"):
        Plan.from_json(raw | {"dense": "int4"})


def test_package_dense_is_int8_for_quantized_experts_and_float_for_lossless_ones():
    auto = PackageSection()
    assert auto.dense_form(["int4", "int3"]) == "int8"
    assert auto.dense_form(["passthrough"]) == auto.dense_form(["mxfp4"]) == "float"
    assert PackageSection(dense="float").dense_form(["int4"]) == "float"
    with pytest.raises(MoeprepError, match="package.dense must be one of"):
        PackageSection(dense="int4")
