"""``moeprep policy-study``: HOBBIT's tuned cache weights against LRU, LFU and EdgeMoE's policy on a trace.

The tune_policy stage's search (``prep.stages.tune_policy.tune``) is fitted on one sequence of the trace
(on the real Mixtral traces: one GSM8K problem) and tested on the others, then the other way round, at
each cache size; every policy is replayed by the simulator at the same bytes. The cost is demand bytes
per token, i.e. misses times the record size: the traces carry no precisions, so this is the plain miss
penalty (HOBBIT's precision weighting needs a mixed-precision plan).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from loader.budget import ModelSizes
from loader.plan import Plan, PolicySpec, Pool
from prep.errors import MoeprepError
from prep.sim.replay import load_replay
from prep.sim.simulate import DEFAULT_RECORD_BYTES
from prep.stages.planning import Draft, PlanSection, TuneKnobs
from prep.stages.tune_policy import tune

BASELINES = ("lru", "lfu", "edgemoe")
DENSE_BYTES = 1 << 20  # the budget arithmetic needs one; the dense part never competes with experts here


def _draft(replay, record_bytes: int) -> Draft:
    plan = Plan.default(replay.num_layers, replay.num_experts, "int4")
    total = replay.num_layers * replay.num_experts * record_bytes
    sizes = ModelSizes(replay.num_layers, replay.num_experts, replay.top_k, DENSE_BYTES, 4 * total, {"int4": record_bytes})
    return Draft(plan, sizes, {"int4": record_bytes}, replay, None, None, total)


def _only(replay, index: int):
    pick = slice(index, index + 1)
    return dataclasses.replace(replay, sequences=replay.sequences[pick],
                               weights=replay.weights[pick] if replay.weights is not None else None,
                               logits=replay.logits[pick] if replay.logits is not None else None)


def run_study(trace, capacities: list[int], trials: int = 40, seed: int = 0, record_bytes: int | None = None,
              progress: bool = True) -> dict:
    """Per capacity (records per layer) and fold (fit sequence, test sequence): each policy's cost."""

    replay = load_replay(trace)
    if len(replay.sequences) < 2:
        raise MoeprepError(f"{trace} holds {len(replay.sequences)} sequence(s); the study fits on one and tests on another")
    record = record_bytes or DEFAULT_RECORD_BYTES
    rows = []
    for capacity in capacities:
        if not 1 <= capacity <= replay.num_experts:
            raise MoeprepError(f"capacity {capacity} must be 1..{replay.num_experts} records per layer")
        share = capacity / replay.num_experts
        for fit in range(len(replay.sequences)):
            test = (fit + 1) % len(replay.sequences)
            cfg = PlanSection(tune=TuneKnobs(enabled=True, trials=trials, seed=seed, share=share))
            fit_draft, test_draft = _draft(_only(replay, fit), record), _draft(_only(replay, test), record)
            with tempfile.TemporaryDirectory() as work:
                tuned = tune(fit_draft, cfg, Path(work), progress=progress)
            budget = test_draft.budget_for_share(share)

            def cost(plan: Plan, draft: Draft = test_draft, budget: int = budget) -> float:
                return draft.cost(draft.simulate(plan, draft.capacities(plan, budget)))

            base = test_draft.plan
            row = {"capacity": capacity, "fit": fit, "test": test, "tuned": tuned.eviction | {"group": tuned.group},
                   "fit_cost": {"tuned": tuned.objective["best trial"], **{b: tuned.objective[b] for b in BASELINES}},
                   "test_cost": {"tuned": cost(tuned.apply(base))}}
            for name in BASELINES:
                row["test_cost"][name] = cost(dataclasses.replace(base, eviction=PolicySpec(name)))
                row["test_cost"][f"{name} (global)"] = cost(dataclasses.replace(
                    base, eviction=PolicySpec(name), pools=(Pool("main", "int4", 1.0, "global"),)))
            equal = {"w_lru": 0.25, "w_lfu": 0.25, "w_lhu": 0.25, "w_fld": 0.25}
            row["test_cost"]["hobbit equal (global)"] = cost(dataclasses.replace(
                base, eviction=PolicySpec("hobbit", equal), pools=(Pool("main", "int4", 1.0, "global"),)))
            for part in ("fit_cost", "test_cost"):
                lru = row[part]["lru"]
                row[part.replace("cost", "vs_lru")] = {k: (v / lru - 1 if lru else None) for k, v in row[part].items()}
            rows.append(row)
    return {"trace": str(trace), "sequences": [len(s) for s in replay.sequences], "record_bytes": record,
            "trials": trials, "seed": seed, "unit": "demand bytes per token", "rows": rows}


def study_markdown(study: dict) -> str:
    lines = [f"Tuned cache weights on {study['trace']} (sequences of {study['sequences']} tokens), {study['trials']} "
             "trials fitted on one sequence and tested on the other; penalty relative to per-layer LRU "
             "(negative: fewer demand bytes).", "",
             "| records per layer | fit -> test | tuned weights (group) | tuned, fit | tuned, test | LFU, test | "
             "EdgeMoE, test | HOBBIT equal, test |",
             "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in study["rows"]:
        w = r["tuned"]
        weights = (", ".join(f"{k[2:]} {v:.2f}" for k, v in w["params"].items()) + f" ({w['group']})"
                   if w["name"] == "hobbit" else w["name"])
        t = r["test_vs_lru"]
        lines.append(f"| {r['capacity']} | {r['fit']} -> {r['test']} | {weights} | {r['fit_vs_lru']['tuned']:+.1%} | "
                     f"{t['tuned']:+.1%} | {t['lfu']:+.1%} | {t['edgemoe']:+.1%} | {t['hobbit equal (global)']:+.1%} |")
    return "\n".join(lines) + "\n"
