"""``load``'s options: one frozen ``LoadOptions`` with ``load``'s own names and defaults, each bad value refused
when the options are made (before the artifact is opened), naming the value and the fix."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from loader.errors import LoaderError, MoeError
from loader.options import (
    DEFAULT_WORKERS,
    MAX_WORKERS,
    LoadOptions,
    compute_threads,
    max_threads,
    reader_workers,
)
from loader.plan import Plan
from loader.runtime import load


def test_the_options_have_loads_names_and_defaults():
    given = {name: p.default for name, p in inspect.signature(load).parameters.items() if name != "artifact"}
    assert given == {f.name: f.default for f in dataclasses.fields(LoadOptions)}


def test_the_defaults_are_sound_and_frozen():
    options = LoadOptions()
    assert options.torch_device == torch.device("cpu")
    assert LoadOptions(device=" CPU ").torch_device == torch.device("cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.store = "host"


@pytest.mark.parametrize("change, named", [
    ({"device": "tpu"}, "device 'tpu' is not supported; use 'cpu', 'cuda' or 'cuda:N'"),
    ({"store": "nvme"}, "store 'nvme' unknown; use 'disk'"),
    ({"workers": 0}, f"workers 0 must be 'auto' or a number of reader threads from 1 to {MAX_WORKERS}"),
    ({"workers": True}, "workers True must be"),
    ({"threads": 0}, "threads 0 must be None, 'auto' or a number of torch threads"),
    ({"threads": "many"}, "threads 'many' must be"),
    ({"cpu_misses": "sometimes"}, "cpu_misses 'sometimes' unknown"),
    ({"expert_dtype": "int9"}, "expert dtype 'int9' unknown"),
    ({"predictors": "next_gates"}, r"predictors must be a list .* \['next_gates'\]"),
    ({"policy": "no_such_policy"}, "no_such_policy"),
])
def test_each_bad_option_is_named(change, named):
    with pytest.raises(MoeError, match=named):
        LoadOptions(**change)


def test_load_checks_its_options_before_it_opens_the_artifact(tmp_path):
    with pytest.raises(LoaderError, match="store 'nvme' unknown"):
        load(tmp_path / "no-such-artifact", store="nvme")  # not "the artifact does not exist"


def test_reader_workers_take_the_plans_read_depth_for_auto():
    plan = Plan.default(1, 4, "int4")
    assert reader_workers("auto", plan) == DEFAULT_WORKERS
    assert reader_workers("auto", dataclasses.replace(plan, read_depth=5)) == 5
    assert reader_workers(3, plan) == 3
    with pytest.raises(LoaderError, match="workers 65 must be"):
        reader_workers(MAX_WORKERS + 1, plan)


def test_thread_counts():
    assert max_threads() >= 4
    assert compute_threads(torch.device("cpu"), 1) >= 1
    assert compute_threads(torch.device("cuda"), 1) is None
