"""The typed, versioned plan (``plan.json``): the schema only.

A plan holds every decision a technique makes about how an artifact runs; each field's default means
"off", so a plan written by a pipeline that runs no technique reproduces plain offloading (one pool at
the store's precision, per-layer LRU, the model's own top-k, misses read at the expert's precision).
What a plan and a budget mean in bytes is ``loader/budget.py``'s; ``parse_budget`` lives here because the
plan's ``default_budget`` field is a budget string.

Shapes use the legend declared in ``loader/__init__.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from loader.errors import MoeError
from loader.policies import PolicyError, policy_factory
from loader.prefill import PrefillSpec, parse_prefill
from loader.vocab import DENSE_FORMS, FORM_NAMES, GROUPS, PRECISIONS

PLAN_VERSION = 1
PLAN_FILE = "plan.json"
_UNITS = {"b": 1, "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
          "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


class PlanError(MoeError):
    """A plan that cannot be used, or a budget that cannot be met; the message says what to do."""


@dataclass(frozen=True)
class PolicySpec:
    """A named policy and its parameters (JSON scalars, lists or dicts)."""

    name: str
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "params": dict(self.params)}

    @classmethod
    def from_json(cls, raw, where: str) -> PolicySpec:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("params", {}), dict):
            raise PlanError(f"{PLAN_FILE}: {where} must be {{'name': str, 'params': dict}}, got {raw!r:.80}; "
                            "prepare the artifact again")
        params = dict(raw.get("params", {}))
        if bad := _bad_number(params, f"{where}.params"):
            raise PlanError(f"{PLAN_FILE}: {bad}; every policy parameter is a finite number >= 0. The plan was "
                            "edited or damaged: prepare the artifact again")
        return cls(raw["name"], params)


def _bad_number(value, where: str) -> str | None:
    """The first NaN, infinite or negative number in a JSON value (``where`` names its path), else None."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return None
    if isinstance(value, int | float):
        return None if math.isfinite(value) and value >= 0 else f"{where} is {value!r}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if bad := _bad_number(item, f"{where}.{key}" if isinstance(value, dict) else f"{where}[{key}]"):
            return bad
    return None


@dataclass(frozen=True)
class Pool:
    """A share of the expert budget holding records of one precision, evicted per layer or globally."""

    name: str
    precision: str
    share: float = 1.0  # 0: the pool holds nothing (an allocation gave it no record)
    group: str = "layer"  # "layer": one eviction group per MoE layer; "global": one across all layers
    layers: tuple[float, ...] | None = None  # a per-layer pool's own relative split (0: that layer holds none)

    def to_json(self) -> dict:
        out = {"name": self.name, "precision": self.precision, "share": self.share, "group": self.group}
        return out | ({"layers": list(self.layers)} if self.layers is not None else {})

    @classmethod
    def from_json(cls, raw, where: str, num_layers: int) -> Pool:
        keys = {"name", "precision", "share", "group"}
        if (not isinstance(raw, dict) or not keys <= set(raw) <= keys | {"layers"}
                or not isinstance(raw["name"], str) or not isinstance(raw["precision"], str)
                or not _is_number(raw["share"]) or not 0 <= raw["share"] <= 1 or raw["group"] not in GROUPS):
            raise PlanError(f"{PLAN_FILE}: {where} must be {{name, precision, share in [0, 1], group in {GROUPS}, "
                            f"optional layers}}, got {raw!r:.120}; prepare the artifact again")
        layers = raw.get("layers")
        if layers is not None and (not isinstance(layers, list) or len(layers) != num_layers
                                   or not all(_is_number(w) and w >= 0 for w in layers) or not any(layers)):
            raise PlanError(f"{PLAN_FILE}: {where}.layers must be {num_layers} non-negative numbers, not all 0; "
                            "prepare the artifact again")
        return cls(raw["name"], raw["precision"], float(raw["share"]), raw["group"],
                   tuple(float(w) for w in layers) if layers is not None else None)


@dataclass(frozen=True)
class OperatingPoint:
    """The pools a planner chose for one budget (the plan's pools with other shares and layer splits): the
    loader takes the point of the largest budget that the memory budget it is given covers (``Plan.for_budget``)."""

    budget_bytes: int
    pools: tuple[Pool, ...]

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "pools": [p.to_json() for p in self.pools]}


@dataclass(frozen=True)
class Plan:
    """Everything a technique decides about running an artifact. Layers are positions 0..L-1 among the
    model's MoE layers; ``expert_precision[l][e]`` names the store a miss of (l, e) reads by default."""

    num_layers: int
    num_experts: int
    expert_precision: tuple[tuple[str, ...], ...]  # [L][E]
    pools: tuple[Pool, ...]
    layer_capacity: tuple[float, ...] | None = None  # relative per-layer weights (an allocator's output)
    eviction: PolicySpec = field(default_factory=lambda: PolicySpec("lru"))
    predictors: tuple[PolicySpec, ...] = ()
    routing: PolicySpec = field(default_factory=lambda: PolicySpec("topk"))
    miss: PolicySpec = field(default_factory=lambda: PolicySpec("plan"))  # read the planned precision
    # CORM's neuron-level loading: "off", or "sparse" with theta, crossover, compute, trust_prediction, prefill
    neuron: PolicySpec = field(default_factory=lambda: PolicySpec("off"))
    default_budget: str = "50%"
    operating_points: tuple[OperatingPoint, ...] = ()  # by rising budget (``for_budget``)
    # precision -> the held form its cached experts take (``loader/forms.py``), chosen for the target device
    # by the planner; absent: the loader's fixed rule for the device
    forms: tuple[tuple[str, str], ...] = ()
    read_depth: int = 0  # reads in flight (reader threads) measured best on the target device; 0: unplanned
    # prefill chunk, the context its reserve is sized for, and per precision the form a prefill computes with
    # from a token count (``loader/prefill.py``); the defaults where the plan does not say
    prefill: PrefillSpec = field(default_factory=PrefillSpec)
    # the dense weights' held form (``loader/dense.py``): "float" as stored, "int8" computed by the compiled kernels
    dense: str = "float"
    version: int = PLAN_VERSION

    def point_for(self, budget_bytes: float) -> OperatingPoint | None:
        """The operating point for ``budget_bytes``: the one of the largest budget the given one covers, else
        the smallest (None without points)."""
        if not self.operating_points:
            return None
        chosen = self.operating_points[0]
        for point in self.operating_points:
            if point.budget_bytes <= budget_bytes:
                chosen = point
        return chosen

    def for_budget(self, budget_bytes: float) -> Plan:
        """This plan with the pools of its operating point for ``budget_bytes`` (itself without points)."""
        point = self.point_for(budget_bytes)
        return dataclasses.replace(self, pools=point.pools) if point is not None else self

    @classmethod
    def default(cls, num_layers: int, num_experts: int, precision: str, default_budget: str = "50%") -> Plan:
        """Every technique off: one per-layer LRU pool at ``precision``."""
        return cls(num_layers, num_experts, tuple((precision,) * num_experts for _ in range(num_layers)),
                   (Pool("main", precision),), default_budget=default_budget)

    @classmethod
    def mixed(cls, expert_precision, record_bytes: dict[str, int], default_budget: str = "50%") -> Plan:
        """Every technique off but per-expert precisions: one per-layer LRU pool per precision, each with the
        share of the expert bytes its experts hold (a single precision gives ``default``)."""
        grid = tuple(tuple(row) for row in expert_precision)
        counts: dict[str, int] = {}
        for row in grid:
            for p in row:
                counts[p] = counts.get(p, 0) + 1
        if len(counts) == 1:
            return cls.default(len(grid), len(grid[0]), grid[0][0], default_budget)
        total = sum(record_bytes[p] * n for p, n in counts.items())
        pools = tuple(Pool(p, p, record_bytes[p] * n / total) for p, n in counts.items())
        return cls(len(grid), len(grid[0]), grid, pools, default_budget=default_budget)

    @property
    def low_precision(self) -> str | None:
        """The precision dynamic precision reads a lowered miss at (None without it)."""
        low = self.miss.params.get("low") if self.miss.name == "dynamic_precision" else None
        return low if isinstance(low, str) else None

    @property
    def precisions(self) -> tuple[str, ...]:
        """Every precision a record may be read at (the pools', the experts' and the miss policy's low copies),
        in first-seen order."""
        seen = [p.precision for p in self.pools] + [p for row in self.expert_precision for p in row]
        return tuple(dict.fromkeys(seen + ([self.low_precision] if self.low_precision else [])))

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "num_layers": self.num_layers,
            "num_experts": self.num_experts,
            "expert_precision": [list(row) for row in self.expert_precision],
            "pools": [p.to_json() for p in self.pools],
            "layer_capacity": list(self.layer_capacity) if self.layer_capacity is not None else None,
            "eviction": self.eviction.to_json(),
            "predictors": [p.to_json() for p in self.predictors],
            "routing": self.routing.to_json(),
            "miss": self.miss.to_json(),
            "default_budget": self.default_budget,
        } | ({"neuron": self.neuron.to_json()} if self.neuron.name != "off" else {}) \
          | ({"operating_points": [p.to_json() for p in self.operating_points]} if self.operating_points else {}) \
          | ({"forms": dict(self.forms)} if self.forms else {}) \
          | ({"read_depth": self.read_depth} if self.read_depth else {}) \
          | ({"prefill": self.prefill.to_json()} if self.prefill != PrefillSpec() else {}) \
          | ({"dense": self.dense} if self.dense != "float" else {})

    @classmethod
    def from_json(cls, raw) -> Plan:
        """Parse and check a plan; every malformed field gets a ``PlanError`` naming it."""

        def bad(what: str):
            return PlanError(f"{PLAN_FILE}: {what}; the plan is corrupt or from another moeprep, prepare the "
                             "artifact again")

        if not isinstance(raw, dict):
            raise bad(f"expected an object, got {type(raw).__name__}")
        known = {"version", "num_layers", "num_experts", "expert_precision", "pools", "layer_capacity",
                 "eviction", "predictors", "routing", "miss", "default_budget", "operating_points", "neuron", "forms",
                 "read_depth", "prefill", "dense"}
        if unknown := sorted(set(raw) - known):
            raise bad(f"unknown keys {unknown}")
        if raw.get("version") != PLAN_VERSION or type(raw.get("version")) is not int:
            raise bad(f"version {raw.get('version')!r}, this loader reads version {PLAN_VERSION}")
        n_layers, n_experts = raw.get("num_layers"), raw.get("num_experts")
        if not (_is_int(n_layers) and _is_int(n_experts) and n_layers > 0 and n_experts > 0):
            raise bad("num_layers and num_experts must be positive integers")
        rows = raw.get("expert_precision")
        if (not isinstance(rows, list) or len(rows) != n_layers
                or any(not isinstance(r, list) or len(r) != n_experts or not all(isinstance(p, str) for p in r)
                       for r in rows)):
            raise bad(f"expert_precision must be {n_layers} lists of {n_experts} precision names")
        pools_raw = raw.get("pools")
        if not isinstance(pools_raw, list) or not pools_raw:
            raise bad("pools must be a non-empty list")
        pools = _pools(pools_raw, "pools", n_layers)
        capacity = raw.get("layer_capacity")
        if capacity is not None and (not isinstance(capacity, list) or len(capacity) != n_layers
                                     or not all(_is_number(c) and c > 0 for c in capacity)):
            raise bad(f"layer_capacity must be null or {n_layers} positive numbers")
        predictors = raw.get("predictors", [])
        if not isinstance(predictors, list):
            raise bad("predictors must be a list")
        budget = raw.get("default_budget")
        if not isinstance(budget, str):
            raise bad("default_budget must be a string such as '50%'")
        try:
            parse_budget(budget)
        except PlanError as e:
            raise bad(f"default_budget: {e}") from None
        points = _operating_points(raw.get("operating_points", []), pools, n_layers, bad)
        forms = raw.get("forms", {})
        if not isinstance(forms, dict) or not all(k in PRECISIONS and v in FORM_NAMES for k, v in forms.items()):
            raise bad(f"forms must map precisions (of {list(PRECISIONS)}) to one of {list(FORM_NAMES)}, got "
                      f"{json.dumps(forms)[:120]}")
        depth = raw.get("read_depth", 0)
        if "read_depth" in raw and not (_is_int(depth) and depth > 0):
            raise bad(f"read_depth must be a positive number of reads in flight, got {depth!r}")
        dense = raw.get("dense", "float")
        if dense not in DENSE_FORMS:
            raise bad(f"dense must be one of {list(DENSE_FORMS)}, got {json.dumps(dense)[:60]}")
        plan = cls(n_layers, n_experts, tuple(tuple(r) for r in rows), tuple(pools),
                   tuple(float(c) for c in capacity) if capacity is not None else None,
                   PolicySpec.from_json(raw.get("eviction"), "eviction"),
                   tuple(PolicySpec.from_json(p, f"predictors[{i}]") for i, p in enumerate(predictors)),
                   PolicySpec.from_json(raw.get("routing"), "routing"),
                   PolicySpec.from_json(raw.get("miss"), "miss"),
                   PolicySpec.from_json(raw.get("neuron", {"name": "off"}), "neuron"), budget, tuple(points),
                   forms=tuple(sorted(forms.items())), read_depth=depth,
                   prefill=parse_prefill(raw.get("prefill", {}), bad, PRECISIONS, FORM_NAMES), dense=dense)
        try:  # the eviction policy's name and parameters, bounds included (``loader.policies``: torch-free)
            policy_factory(plan.eviction.name, plan.eviction.params)
        except PolicyError as e:
            raise bad(f"eviction: {e}") from None
        pooled = {p.precision for p in pools}
        if missing := sorted({p for row in plan.expert_precision for p in row} - pooled):
            raise bad(f"experts planned at precisions {missing} that no pool holds")
        return without_low_pool(plan)


def _operating_points(raw, pools: tuple[Pool, ...], num_layers: int, bad) -> list[OperatingPoint]:
    """A plan's ``operating_points``: each the plan's pools (names, precisions, groups, in order) with other shares
    and layer splits, by rising budget; ``bad(what)`` makes the PlanError."""
    if not isinstance(raw, list):
        raise bad("operating_points must be a list")
    points = []
    for i, point in enumerate(raw):
        if not isinstance(point, dict) or set(point) != {"budget_bytes", "pools"} or not _is_int(point["budget_bytes"]) \
                or point["budget_bytes"] <= 0:
            raise bad(f"operating_points[{i}] must be {{budget_bytes: a positive int, pools: [...]}}")
        points.append(OperatingPoint(point["budget_bytes"], _pools(point["pools"], f"operating_points[{i}].pools",
                                                                    num_layers)))
        if [(p.name, p.precision, p.group) for p in points[-1].pools] != [(p.name, p.precision, p.group) for p in pools]:
            raise bad(f"operating_points[{i}] must list the plan's pools (names, precisions, groups) in order; "
                      "only shares and layer splits differ")
    if [p.budget_bytes for p in points] != sorted({p.budget_bytes for p in points}):
        raise bad("operating_points must be in rising budget_bytes, each once")
    return points


def without_low_pool(plan: Plan) -> Plan:
    """A plan written when dynamic precision had a pool of its own (a pool holding only the miss policy's low
    copies, no expert planned at it), as it runs now: that pool dropped, its share given back to the others in
    proportion (in every operating point too), the low copies lodged in the main pool's slots
    (``loader.cache.host_pool``). So an old artifact loads at every budget its main pool does."""
    low = plan.low_precision
    planned = {p for row in plan.expert_precision for p in row}
    if low is None or low in planned or all(p.precision != low for p in plan.pools) or len(plan.pools) < 2:
        return plan

    def drop(pools: tuple[Pool, ...]) -> tuple[Pool, ...]:
        kept = tuple(p for p in pools if p.precision != low)
        rest, total = sum(p.share for p in kept), sum(p.share for p in pools)
        return tuple(dataclasses.replace(p, share=min(1.0, p.share / rest * total if rest else total / len(kept)))
                     for p in kept)

    return dataclasses.replace(plan, pools=drop(plan.pools), operating_points=tuple(
        dataclasses.replace(point, pools=drop(point.pools)) for point in plan.operating_points))


def _pools(raw, where: str, num_layers: int) -> tuple[Pool, ...]:
    if not isinstance(raw, list) or not raw:
        raise PlanError(f"{PLAN_FILE}: {where} must be a non-empty list; prepare the artifact again")
    pools = tuple(Pool.from_json(p, f"{where}[{i}]", num_layers) for i, p in enumerate(raw))
    if len({p.precision for p in pools}) != len(pools):
        raise PlanError(f"{PLAN_FILE}: {where}: two pools hold the same precision; prepare the artifact again")
    if sum(p.share for p in pools) > 1 + 1e-9 or not any(p.share for p in pools):
        raise PlanError(f"{PLAN_FILE}: {where}: the shares must add up to more than 0 and at most 1; prepare the "
                        "artifact again")
    return pools


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def read_plan(artifact: str | Path) -> Plan:
    """The checked ``plan.json`` of an artifact directory."""
    return read_plan_file(Path(artifact) / PLAN_FILE)


def read_plan_file(path: str | Path, fix: str = "prepare the artifact again") -> Plan:
    """A checked plan from any JSON file; ``fix`` ends the message of a missing or unparsable file."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise PlanError(f"{path} is missing; {fix}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{path} is not valid JSON ({e}); {fix}") from None
    return Plan.from_json(raw)


# ----------------------------------------------------------------------------------------- budgets


def parse_budget(budget) -> tuple[str, float] | None:
    """None | bytes (int) | "1.5GiB" | "25%" | "unlimited" -> None | (kind, value).

    kind is "bytes", "fraction" (of the source expert bytes) or "unlimited".
    """
    if budget is None:
        return None
    if isinstance(budget, int | float) and not isinstance(budget, bool):
        if not math.isfinite(budget) or budget <= 0:
            raise PlanError(f"memory budget {budget!r} must be a positive number of bytes")
        return ("bytes", float(budget))
    text = str(budget).strip().lower().replace(" ", "")
    if text in ("unlimited", "inf", "all"):
        return ("unlimited", math.inf)
    if text.endswith("%"):
        try:
            share = float(text[:-1]) / 100
        except ValueError:
            share = -1
        if not (math.isfinite(share) and share > 0):
            raise PlanError(f"memory budget {budget!r}: a percentage must be above 0")
        return ("fraction", share)
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)([a-z]*)", text)
    if not match or match.group(2) not in _UNITS | {"": 1}:
        raise PlanError(f"memory budget {budget!r} not understood; use bytes, a size like 1.5GiB, a share "
                        "like 25%, or 'unlimited'")
    value = float(match.group(1)) * _UNITS.get(match.group(2), 1)
    if value <= 0:
        raise PlanError(f"memory budget {budget!r} must be above 0 bytes")
    if not math.isfinite(value):  # hundreds of digits: past any float, so past any memory
        raise PlanError(f"memory budget {budget!r} is too large to be a number of bytes; use 'unlimited'")
    return ("bytes", value)
