"""The device file (``tuning.json``): which of the plan's techniques ``moeload tune`` kept on a device, and the plan
that runs with them.

The preparation chooses techniques from a cost model; a technique that slows the artifact down on the device it runs
on is a bug there, not a result. ``moeload tune`` (``loader/tune.py``) measures each technique on the device and writes
its decisions here, one entry per device kind and budget; ``load``, ``moeload generate`` and ``moeload plan`` run the
artifact with them unless told to ignore the file. The file is listed in the manifest with its size and sha256, like
every other file, so a damaged one is refused by ``load``, ``verify`` and ``plan``, naming it.

A technique is named after what the plan holds (``techniques``): the routing policy (``adaptive_gating``,
``cache_routing``), the miss policy (``dynamic_precision``), each predictor (``next_gates``, ...), ``neuron`` (CORM's
neuron-level loading), ``eviction`` (a policy other than per-layer LRU) and ``allocation`` (the operating points and
per-layer splits of the DP allocation). ``without`` switches a set of them off.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from loader.errors import ArtifactError
from loader.format import TUNING_FILE
from loader.hashing import sha256_file
from loader.io import parse_json, write_json_atomic
from loader.plan import Plan, PolicySpec
from loader.vocab import DEFAULT_HOOKS

TUNING_VERSION = 1
VERDICTS = ("pays", "loses", "within noise", "needed by the budget", "kept by the check against plain")
_FIX = "run `moeload tune` again (it writes the file anew), or copy the artifact again"


def techniques(plan: Plan) -> list[str]:
    """The techniques ``plan`` runs, by name (the module docstring), in a fixed order."""
    names = []
    if plan.routing.name not in DEFAULT_HOOKS:
        names.append(plan.routing.name)
    if plan.miss.name not in DEFAULT_HOOKS:
        names.append(plan.miss.name)
    names += [spec.name for spec in plan.predictors]
    if plan.neuron.name != "off":
        names.append("neuron")
    if plan.eviction.name != "lru":
        names.append("eviction")
    if _allocated(plan):
        names.append("allocation")
    return names


def _allocated(plan: Plan) -> bool:
    return bool(plan.operating_points) or plan.layer_capacity is not None or any(p.layers is not None for p in plan.pools)


def without(plan: Plan, off) -> Plan:
    """``plan`` with the techniques named in ``off`` switched off (each to what a plain plan does); a name the plan
    does not run is an error (``techniques`` lists them)."""
    off = set(off)
    if unknown := sorted(off - set(techniques(plan))):
        raise ArtifactError(f"{TUNING_FILE} switches off {unknown}, which this artifact's plan does not run (it runs "
                            f"{techniques(plan)}); {_FIX}", TUNING_FILE)
    changes: dict = {}
    if plan.routing.name in off:
        changes["routing"] = PolicySpec("topk")
    if plan.miss.name in off:
        changes["miss"] = PolicySpec("plan")
    if any(spec.name in off for spec in plan.predictors):
        changes["predictors"] = tuple(spec for spec in plan.predictors if spec.name not in off)
    if "neuron" in off:
        changes["neuron"] = PolicySpec("off")
    if "eviction" in off:
        changes["eviction"] = PolicySpec("lru")
    if "allocation" in off:
        # the plan's own pools, each split equally across layers, at every budget
        changes |= {"operating_points": (), "layer_capacity": None,
                    "pools": tuple(dataclasses.replace(p, layers=None) for p in plan.pools)}
    return dataclasses.replace(plan, **changes)


@dataclass(frozen=True)
class TunedPoint:
    """``moeload tune``'s decisions on one device kind (``cpu``, ``cuda``) at one budget: the techniques kept and
    switched off, each with its verdict and figures (``decisions``), and the machine it ran on."""

    device: str
    budget_bytes: int
    requested: str  # the budget as asked for ("4bit-25%", "25%", "1.5GiB")
    kept: tuple[str, ...]
    off: tuple[str, ...]
    decisions: dict = field(default_factory=dict)  # technique -> {verdict, ratio, low, high, ...}
    machine: dict = field(default_factory=dict)
    measured: dict = field(default_factory=dict)  # rounds, tokens, seconds, the tuned and plain runs' figures

    def to_json(self) -> dict:
        return {"device": self.device, "budget_bytes": self.budget_bytes, "requested": self.requested,
                "kept": list(self.kept), "off": list(self.off), "decisions": self.decisions, "machine": self.machine,
                "measured": self.measured}


@dataclass(frozen=True)
class Tuning:
    """The device file: the artifact it was measured on (its ``package_key``) and one point per device and budget."""

    package_key: str
    points: tuple[TunedPoint, ...]
    version: int = TUNING_VERSION

    def to_json(self) -> dict:
        return {"version": self.version, "package_key": self.package_key, "points": [p.to_json() for p in self.points]}

    def point_for(self, device: str, budget_bytes: float | None) -> TunedPoint | None:
        """The point measured on this device kind nearest ``budget_bytes`` (by ratio); None where none was."""
        kind = device.split(":", 1)[0]
        mine = [p for p in self.points if p.device == kind]
        if not mine:
            return None
        if budget_bytes is None or not math.isfinite(budget_bytes) or budget_bytes <= 0:
            return max(mine, key=lambda p: p.budget_bytes)
        return min(mine, key=lambda p: abs(math.log(p.budget_bytes / budget_bytes)))

    def with_point(self, point: TunedPoint) -> Tuning:
        """This file with ``point`` replacing the one of the same device kind and budget."""
        kept = [p for p in self.points if (p.device, p.budget_bytes) != (point.device, point.budget_bytes)]
        return dataclasses.replace(self, points=tuple(sorted([*kept, point], key=lambda p: (p.device, p.budget_bytes))))


def _bad(what: str) -> ArtifactError:
    return ArtifactError(f"{TUNING_FILE}: {what}; {_FIX}", TUNING_FILE)


def parse_tuning(raw, plan: Plan) -> Tuning:
    """A checked device file: every key typed, every technique one the plan runs."""
    if not isinstance(raw, dict) or set(raw) != {"version", "package_key", "points"}:
        raise _bad("expected {version, package_key, points}")
    if raw["version"] != TUNING_VERSION or type(raw["version"]) is not int:
        raise _bad(f"version {raw['version']!r}, this loader reads version {TUNING_VERSION}")
    if not isinstance(raw["package_key"], str) or not isinstance(raw["points"], list):
        raise _bad("package_key must be a string and points a list")
    names = set(techniques(plan))
    points = []
    keys = {"device", "budget_bytes", "requested", "kept", "off", "decisions", "machine", "measured"}
    for i, p in enumerate(raw["points"]):
        if not isinstance(p, dict) or set(p) != keys:
            raise _bad(f"points[{i}] must have the keys {sorted(keys)}")
        if p["device"] not in ("cpu", "cuda") or isinstance(p["budget_bytes"], bool) or not isinstance(
                p["budget_bytes"], int) or p["budget_bytes"] <= 0 or not isinstance(p["requested"], str):
            raise _bad(f"points[{i}]: device must be cpu or cuda, budget_bytes a positive int, requested a string")
        for key in ("kept", "off"):
            if not isinstance(p[key], list) or not all(isinstance(n, str) for n in p[key]):
                raise _bad(f"points[{i}].{key} must be a list of technique names")
            if unknown := sorted(set(p[key]) - names):
                raise _bad(f"points[{i}].{key} names {unknown}, which this artifact's plan does not run")
        if set(p["kept"]) & set(p["off"]):
            raise _bad(f"points[{i}] both keeps and switches off {sorted(set(p['kept']) & set(p['off']))}")
        if not all(isinstance(p[k], dict) for k in ("decisions", "machine", "measured")):
            raise _bad(f"points[{i}]: decisions, machine and measured must be objects")
        points.append(TunedPoint(p["device"], p["budget_bytes"], p["requested"], tuple(p["kept"]), tuple(p["off"]),
                                 p["decisions"], p["machine"], p["measured"]))
    return Tuning(raw["package_key"], tuple(points))


def read_tuning(manifest) -> Tuning | None:
    """The artifact's device file, checked against its manifest entry (size and sha256) and parsed; None where the
    artifact has none. A file the manifest does not list (a tune stopped between its two writes) is an error too:
    it is not trusted, and ``moeload tune`` writes it again."""
    listed = TUNING_FILE in manifest.files
    path = manifest.path(TUNING_FILE) if listed else manifest.root / TUNING_FILE
    if not listed:
        if path.exists():
            raise _bad("is in the artifact's directory but its manifest does not list it (a `moeload tune` was "
                       "stopped before it sealed the file)")
        return None
    entry = manifest.files[TUNING_FILE]
    try:
        data = path.read_bytes()
    except OSError as e:
        raise _bad(f"cannot be read ({e.strerror or e})") from None
    if len(data) != entry["bytes"]:
        raise _bad(f"is {len(data)} bytes, the manifest says {entry['bytes']} (truncated or replaced)")
    if sha256_file(path) != entry["sha256"]:
        raise _bad("does not match its sha256 in the manifest (changed after `moeload tune` wrote it)")
    try:
        raw = parse_json(data)
    except ValueError as e:  # invalid, not UTF-8, or nested too deep (``loader.io.parse_json``)
        raise _bad(f"is not valid JSON ({e})") from None
    return parse_tuning(raw, manifest.plan if manifest.plan is not None else _plan_of(manifest))


def _plan_of(manifest) -> Plan:
    from loader.plan import read_plan

    return read_plan(manifest.root)


def write_tuning(manifest, tuning: Tuning) -> None:
    """Write the device file and seal it: the file first (atomically), then the manifest listing its size and sha256
    (``write_manifest``, atomically). Stopped between the two, the file is refused until a tune writes both again."""
    from loader.format import write_manifest

    path = manifest.root / TUNING_FILE
    write_json_atomic(path, tuning.to_json(), indent=1)
    raw = dict(manifest.raw)
    raw["files"] = dict(raw["files"]) | {TUNING_FILE: {"bytes": path.stat().st_size, "sha256": sha256_file(path)}}
    write_manifest(manifest.root, raw)


@dataclass(frozen=True)
class Applied:
    """What a load takes from the device file: the plan it runs, and a line for people (``describe``)."""

    plan: Plan
    point: TunedPoint | None
    why: str  # which point applies, or why none does

    def to_json(self) -> dict:
        p = self.point
        return {"applied": p is not None, "why": self.why,
                "device": p.device if p else None, "budget_bytes": p.budget_bytes if p else None,
                "kept": list(p.kept) if p else None, "off": list(p.off) if p else None,
                "untested": None if p else techniques(self.plan)}

    def describe(self) -> str:
        p = self.point
        if p is None:
            return f"device file: {self.why}"
        kept = ", ".join(p.kept) or "none"
        off = ", ".join(p.off) or "none"
        return (f"device file: {TUNING_FILE} measured on {p.device} at {p.requested} ({p.budget_bytes:,} B): "
                f"techniques kept {kept}; switched off {off}")


def apply_tuning(manifest, plan: Plan, device: str, budget_bytes, ignore: bool = False) -> Applied:
    """The plan a load runs: ``plan`` with the techniques the device file switched off on this device kind at the
    nearest budget (``budget_bytes``: the load's budget in bytes, or a function giving it, called only where the file
    has several points to choose from). Without a file (or ``ignore``), the plan as prepared, and ``why`` says its
    techniques are untested on any device where it runs any."""
    tuning = read_tuning(manifest)  # checked even when ignored: a damaged file is refused either way
    untested = techniques(plan)
    if ignore:
        return Applied(plan, None, "ignored (--ignore-device-file): the plan runs as prepared")
    if tuning is None:
        why = ("none; the plan's techniques (" + ", ".join(untested) + ") are untested on any device: run `moeload tune` "
               "on this device to keep only those that pay here") if untested else "none; the plan runs no technique"
        return Applied(plan, None, why)
    kind = device.split(":", 1)[0]
    if callable(budget_bytes):
        budget_bytes = budget_bytes() if sum(p.device == kind for p in tuning.points) > 1 else None
    point = tuning.point_for(device, budget_bytes)
    if point is None:
        kinds = sorted({p.device for p in tuning.points})
        return Applied(plan, None, f"measured on {', '.join(kinds)} only, not {device.split(':')[0]}: the plan runs as "
                                   "prepared; run `moeload tune` here")
    return Applied(without(plan, point.off), point, "applied")


# ------------------------------------------------------------------------------------- in a device profile

PROFILE_KEY = "tuning"  # a device profile's (``device.json``) copy of ``moeload tune``'s decisions on its device


def profile_choice(plan: Plan, profile: dict | None) -> tuple[Plan, dict]:
    """(the plan a preparation ships, report.json's ``technique_choice``) from a device profile's JSON: with
    ``moeload tune``'s decisions in it, ``plan`` without the techniques switched off there (among those it runs);
    without, the plan as composed, said to be untested on any device."""
    decided = (profile or {}).get(PROFILE_KEY)
    names = techniques(plan)
    if not isinstance(decided, dict) or not isinstance(decided.get("off"), list):
        return plan, {"tested": False, "techniques": names,
                      "why": "untested on any device: run `moeload tune` on the device (it keeps only what pays "
                             "there), or prepare with a --device-profile that carries its decisions"}
    off = [n for n in names if n in decided["off"]]
    return without(plan, off), {"tested": True, "techniques": [n for n in names if n not in off], "off": off,
                                "device": decided.get("device"), "budget": decided.get("requested"),
                                "machine": decided.get("machine"), "decisions": decided.get("decisions")}
