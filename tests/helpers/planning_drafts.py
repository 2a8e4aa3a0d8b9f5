"""Small planning drafts with no model behind them: synthetic routing with locality, the draft the planning
stages search over, and a recipe's ``plan`` section with the tuner on. Shared by the tuner's tests and the
executor's Optuna-worker tests."""

from __future__ import annotations

import random

from loader.budget import ModelSizes
from loader.plan import Plan
from prep.recipe import recipe_from_dict
from prep.sim.replay import Replay
from prep.stages.planning import Draft


def locality_replay(seed=0, sequences=4, tokens=120, layers=3, experts=8) -> Replay:
    """Routing with locality: each layer keeps a favourite pair for a while, plus noise."""
    rng = random.Random(seed)
    out = []
    for _ in range(sequences):
        favourite = [rng.sample(range(experts), 2) for _ in range(layers)]
        seq = []
        for _ in range(tokens):
            token = []
            for layer in range(layers):
                if rng.random() < 0.1:
                    favourite[layer] = rng.sample(range(experts), 2)
                pair = favourite[layer] if rng.random() < 0.6 else rng.sample(range(experts), 2)
                token.append(tuple(pair))
            seq.append(tuple(token))
        out.append(tuple(seq))
    return Replay(tuple(out), layers, experts, 2, "synthetic")


def planning_draft(replay: Replay) -> Draft:
    """Every expert at int4 (100 bytes a record) on ``replay``."""
    plan = Plan.default(replay.num_layers, replay.num_experts, "int4")
    sizes = ModelSizes(replay.num_layers, replay.num_experts, 2, 1000, 4 * 100 * replay.num_layers * replay.num_experts,
                       {"int4": 100})
    return Draft(plan, sizes, {"int4": 100}, replay, None, None, 100 * replay.num_layers * replay.num_experts)


def tune_section(trials: int, **tune_knobs):
    """A recipe's ``plan`` section tuning ``trials`` trials at a 40 % share."""
    recipe = recipe_from_dict({"name": "t", "model": {"path": "m"},
                               "plan": {"tune": {"enabled": True, "trials": trials, "share": 0.4} | tune_knobs}})
    return recipe.plan


def small_model_sizes(record=100, layers=2, experts=4) -> ModelSizes:
    """Sizes of a 2-layer, 4-expert model: 1000 dense bytes, ``record`` bytes an int4 record, 80 an int3 one."""
    return ModelSizes(layers, experts, 2, dense_bytes=1000, source_expert_bytes=layers * experts * record * 4,
                      record_bytes={"int4": record, "int3": 80})
