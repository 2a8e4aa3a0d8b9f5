"""Fuzz: seeded random mutations of a real artifact give 0 tracebacks and 0 silent successes.

Each case copies a tiny prepared artifact, applies one mutation to ``manifest.json``, ``plan.json``, the
expert store's safetensors header or ``dense.safetensors``'s header (bit flips, truncations, length
fields, type changes, deleted or renamed keys, number and string edits, swapped elements, path edits
and escaping symlinks), then runs what a user would: ``verify``, the load-time checks
(``open_artifact``, ``read_plan``) and, where they pass, ``loader.runtime.load`` and one forward over
tokens that reach every expert.

- a traceback: any exception that is not a ``MoeError`` (from verify, the checks, load or the forward);
- a silent success: every check passes although the forward's logits differ from the unmutated
  artifact's (a mutation that changes nothing that matters may pass).

A second, smaller set applies the same mutations and then makes the artifact consistent again (the
manifest re-hashes the mutated file and is re-sealed), as a buggy producer would write it. Those edits
cannot be told from a genuine artifact by design, so only their tracebacks count; they drive the
parsers and cross-checks behind the hashes.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import struct
from pathlib import Path

import pytest
import torch

from loader.artifact import open_artifact
from loader.errors import MoeError
from loader.format import DIGEST, write_manifest
from loader.plan import read_plan
from loader.runtime import load
from loader.verify import verify
from tests.helpers.tiny_models import prepare_tiny_artifact

SEED = 1415
RAW_CASES = 560
CONSISTENT_CASES = 160
TARGETS = ("manifest.json", "manifest.json", "plan.json", "store", "dense.safetensors")
# the neuron layout (records read in part, each 4 KiB block hashed), the predictors file and the plan
NEURON_TARGETS = ("manifest.json", "plan.json", "plan.json", "store", "predictors.safetensors",
                  "predictors.safetensors", "blocks")
NEURON_RAW_CASES = 140
NEURON_CONSISTENT_CASES = 70
ODD_VALUES = (None, True, False, 0, 1, -1, 2**64, 0.5, float("nan"), "", "x", [], [0], {}, {"x": 1})


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(artifact dir, reference logits, token ids) of a tiny int4 mixtral, prepared once."""
    _, artifact = prepare_tiny_artifact(tmp_path_factory.mktemp("fuzz"), precision="int4")
    artifact = artifact.resolve()
    assert DIGEST in json.loads((artifact / "manifest.json").read_text())  # package seals its manifests
    ids = torch.randint(4, 60, (2, 24), generator=torch.Generator().manual_seed(SEED))
    logits, reads = _forward(artifact, ids)
    assert verify(artifact) == [] and reads == 8  # every expert of both layers is read: each record hash is checked
    return artifact, logits, ids


def _forward(artifact: Path, ids: torch.Tensor, stepwise: bool = False) -> tuple[torch.Tensor, int]:
    """The logits of ``ids``; ``stepwise``: one token per call (decode steps: the neuron path's partial reads),
    at a budget small enough to evict."""
    loaded = load(artifact, memory_budget="60%" if stepwise else "unlimited")
    try:
        with torch.no_grad():
            if not stepwise:
                logits = loaded.model(input_ids=ids).logits
            else:
                past, steps = None, []
                for t in range(ids.shape[1]):
                    out = loaded.model(input_ids=ids[:, t:t + 1], past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    steps.append(out.logits)
                logits = torch.cat(steps, dim=1)
        return logits, loaded.stats()["misses"]
    finally:
        loaded.close()


@pytest.fixture(scope="module")
def neuron_base(tmp_path_factory):
    """(artifact dir, reference logits, token ids, stepwise) of a tiny int4 mixtral in the neuron layout with
    neuron-level loading and all three prefetch predictors: partial reads, block hashes and predictors.safetensors."""
    from tests.helpers.tiny_models import tiny_recipe

    recipe = tiny_recipe("int4", neuron={"layout": "neuron", "enabled": True, "theta": 0.2, "crossover": 1.0},
                         predict={"predictors": ["next_gates", "path_stats", "first_gate"]})
    _, artifact = prepare_tiny_artifact(tmp_path_factory.mktemp("fuzz-neuron"), recipe=recipe)
    artifact = artifact.resolve()
    assert {"predictors.safetensors", "experts-int4.blocks.safetensors"} <= set(
        json.loads((artifact / "manifest.json").read_text())["files"])
    ids = torch.randint(4, 60, (1, 12), generator=torch.Generator().manual_seed(SEED))
    logits, _ = _forward(artifact, ids, stepwise=True)
    assert verify(artifact) == []
    return artifact, logits, ids, True


# ------------------------------------------------------------------------------------------ mutations


def _nodes(node, path=()):
    """Every (path, value) of a JSON tree, the root included."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _nodes(v, (*path, i))


def _parent(tree, path):
    for key in path[:-1]:
        tree = tree[key]
    return tree


def _mutate_tree(rng: random.Random, tree, artifact: Path):
    """One random edit of a JSON tree (returns the new tree and what was done)."""
    nodes = list(_nodes(tree))
    op = rng.choice(["type", "delete", "number", "string", "swap", "key"])
    if op == "number" and (nums := [(p, v) for p, v in nodes if p and type(v) in (int, float)]):
        path, value = rng.choice(nums)
        new = rng.choice([value + 1, value - 1, -value, 0, value * 2, 2**31, 2**63, 2**70, value + 0.5])
        _parent(tree, path)[path[-1]] = new
        return tree, f"number {path} {value}->{new}"
    if op == "string" and (texts := [(p, v) for p, v in nodes if p and isinstance(v, str)]):
        path, value = rng.choice(texts)
        other = rng.choice(texts)[1]
        new = rng.choice([value + "x", value[:-1], "", other, value.upper(), "../" + value,
                          value.replace("1", "0"), value.replace("0", "1")])
        _parent(tree, path)[path[-1]] = new
        return tree, f"string {path} {value[:30]!r}->{new[:30]!r}"
    if op == "swap" and (seqs := [(p, v) for p, v in nodes if isinstance(v, list | dict) and len(v) >= 2]):
        path, value = rng.choice(seqs)
        keys = list(value) if isinstance(value, dict) else list(range(len(value)))
        a, b = rng.sample(keys, 2)
        value[a], value[b] = value[b], value[a]
        return tree, f"swap {path} {a}<->{b}"
    if op == "key" and (maps := [(p, v) for p, v in nodes if isinstance(v, dict) and v]):
        path, value = rng.choice(maps)
        old = rng.choice(list(value))
        new = rng.choice([old + "x", old[:-1], rng.choice(list(value)), old.upper()])
        value[new] = value.pop(old)
        return tree, f"rename key {path} {old!r}->{new!r}"
    if op == "delete" and len(nodes) > 1:
        path, _ = rng.choice(nodes[1:])
        del _parent(tree, path)[path[-1]]
        return tree, f"delete {path}"
    path, _ = rng.choice(nodes)
    new = rng.choice(ODD_VALUES)
    if not path:
        return new, f"type root->{new!r}"
    _parent(tree, path)[path[-1]] = new
    return tree, f"type {path}->{new!r}"


def _mutate_bytes(rng: random.Random, data: bytes, region: int) -> tuple[bytes, str]:
    """A bit flip or a truncation inside the first ``region`` bytes."""
    if rng.random() < 0.6:
        i = rng.randrange(region)
        bit = 1 << rng.randrange(8)
        return data[:i] + bytes([data[i] ^ bit]) + data[i + 1:], f"bit flip at {i} (0x{bit:02x})"
    cut = rng.randrange(region)
    return data[:cut], f"truncate to {cut}"


def _mutate_json_file(rng, path: Path, artifact: Path) -> str:
    data = path.read_bytes()
    if rng.random() < 0.3:
        new, what = _mutate_bytes(rng, data, len(data))
        path.write_bytes(new)
        return what
    tree, what = _mutate_tree(rng, json.loads(data), artifact)
    path.write_text(json.dumps(tree, indent=2))
    return what


def _mutate_safetensors(rng, path: Path) -> str:
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    roll = rng.random()
    if roll < 0.35:
        new, what = _mutate_bytes(rng, data, 8 + n)
        path.write_bytes(new)
        return what
    if roll < 0.45:
        length = rng.choice([2**60, 2**64 - 1, n + 1, n - 1, 0, len(data), 2])
        path.write_bytes(struct.pack("<Q", length) + data[8:])
        return f"header length {n}->{length}"
    tree, what = _mutate_tree(rng, json.loads(data[8:8 + n]), path.parent)
    text = json.dumps(tree, separators=(",", ":")).encode()
    text += b" " * max(0, n - len(text))  # same length when it fits, so the data section stays put
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n:])
    return what


def _mutate_paths(rng, artifact: Path, outside: Path) -> str:
    """Edits of where the manifest's files are: '..', absolute names, other artifacts, escaping symlinks."""
    raw = json.loads((artifact / "manifest.json").read_text())
    names = sorted(raw["files"])
    name = rng.choice(names)
    op = rng.randrange(6)
    if op == 0:
        new = rng.choice([f"../{artifact.name}/{name}", f"sub/../{name}", f"./{name}", str(artifact / name),
                          f"{name}/", f"//{name}"])
        raw["files"][new] = raw["files"].pop(name)
        what = f"files key {name!r}->{new!r}"
    elif op == 1:
        secret = outside / "secret.txt"
        secret.write_text("not part of the artifact")
        body = secret.read_bytes()
        raw["files"]["../outside/secret.txt"] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
        what = "files lists ../outside/secret.txt with its true hash"
    elif op == 2:
        store = next(iter(raw["stores"].values()))
        store["file"] = rng.choice([f"../other/{store['file']}", f"/tmp/{store['file']}", f"{store['file']}/.."])
        what = f"store file -> {store['file']!r}"
    elif op in (3, 4):
        shutil.copy(artifact / name, outside / name)  # identical bytes: only the path is wrong
        (artifact / name).unlink()
        (artifact / name).symlink_to(outside / name)
        return f"{name} -> symlink to an identical copy outside"
    else:
        other = rng.choice([n for n in names if n != name])
        (artifact / name).unlink()
        (artifact / name).symlink_to(other)
        return f"{name} -> symlink to {other} inside"
    (artifact / "manifest.json").write_text(json.dumps(raw, indent=2))
    return what


def _make_case(rng: random.Random, artifact: Path, outside: Path, consistent: bool, targets=TARGETS) -> str:
    target = rng.choice(targets)
    store = next(p for p in artifact.glob("experts-*.safetensors") if not p.name.endswith(".blocks.safetensors")).name
    if target == "manifest.json" and not consistent and rng.random() < 0.25:
        return _mutate_paths(rng, artifact, outside)
    name = {"store": store, "blocks": store.replace(".safetensors", ".blocks.safetensors")}.get(target, target)
    path = artifact / name
    if name.endswith(".json"):
        what = _mutate_json_file(rng, path, artifact)
    else:
        what = _mutate_safetensors(rng, path)
    what = f"{name}: {what}"
    if consistent:  # as a producer that wrote it so would: hashes and seal agree with the mutated files
        try:
            raw = json.loads((artifact / "manifest.json").read_text())
            if name != "manifest.json":
                body = path.read_bytes()
                raw["files"][name] = {"bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
            write_manifest(artifact, raw)
        except (ValueError, TypeError, AttributeError, KeyError):
            pass  # the manifest no longer parses as a dict of files: it stays as mutated
    return what


# ------------------------------------------------------------------------------------------ the run


def _run_case(artifact: Path, ids: torch.Tensor, reference: torch.Tensor, stepwise: bool = False) -> tuple[str, str]:
    """('refused' | 'unchanged' | 'silent' | 'traceback', detail)."""
    try:
        verify(artifact)  # returns lines; a bad artifact never makes it raise
    except Exception as e:  # noqa: BLE001 - counting what escapes is the point
        return "traceback", f"verify: {type(e).__name__}: {e}"
    try:
        open_artifact(artifact)
        read_plan(artifact)
        logits, _ = _forward(artifact, ids, stepwise)
    except MoeError:
        return "refused", ""
    except Exception as e:  # noqa: BLE001
        return "traceback", f"load: {type(e).__name__}: {e}"
    if logits.shape == reference.shape and torch.equal(logits, reference):
        return "unchanged", ""
    return "silent", "every check passed and the logits changed"


def _fuzz(base, tmp_path, count: int, consistent: bool, seed: int, targets=TARGETS) -> dict:
    artifact, reference, ids, *rest = base
    stepwise = bool(rest and rest[0])
    counts = {"refused": 0, "unchanged": 0, "silent": 0, "traceback": 0}
    failures = []
    for case in range(count):
        rng = random.Random(seed * 100_003 + case)
        work = tmp_path / f"case-{case}"
        copy, outside = work / "artifact", work / "outside"
        shutil.copytree(artifact, copy)
        outside.mkdir()
        what = _make_case(rng, copy, outside, consistent, targets)
        outcome, detail = _run_case(copy, ids, reference, stepwise)
        counts[outcome] += 1
        if outcome in ("traceback", "silent"):
            failures.append(f"case {case} ({what}): {detail}")
        shutil.rmtree(work)
    counts["failures"] = failures
    return counts


def test_random_mutations_give_no_traceback_and_no_silent_success(base, tmp_path):
    counts = _fuzz(base, tmp_path, RAW_CASES, consistent=False, seed=SEED)
    print(f"\nfuzz, {RAW_CASES} raw mutations: " + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "failures"))
    assert counts["traceback"] == 0 and counts["silent"] == 0, "\n".join(counts["failures"][:20])
    assert counts["refused"] > RAW_CASES * 0.8  # the mutations bite: most are refused, the rest change nothing


def test_consistent_mutations_give_no_traceback(base, tmp_path):
    counts = _fuzz(base, tmp_path, CONSISTENT_CASES, consistent=True, seed=SEED + 1)
    print(f"\nfuzz, {CONSISTENT_CASES} consistent (re-hashed, re-sealed) mutations: "
          + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "failures"))
    tracebacks = [f for f in counts["failures"] if "every check passed" not in f]
    assert not tracebacks, "\n".join(tracebacks[:20])


def test_the_neuron_layout_predictors_and_plan_give_no_traceback_and_no_silent_success(neuron_base, tmp_path):
    counts = _fuzz(neuron_base, tmp_path, NEURON_RAW_CASES, consistent=False, seed=SEED + 2, targets=NEURON_TARGETS)
    print(f"\nfuzz, neuron layout + predictors + plan, {NEURON_RAW_CASES} raw mutations: "
          + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "failures"))
    assert counts["traceback"] == 0 and counts["silent"] == 0, "\n".join(counts["failures"][:20])
    assert counts["refused"] > NEURON_RAW_CASES * 0.8


def test_consistent_mutations_of_the_neuron_layout_predictors_and_plan_give_no_traceback(neuron_base, tmp_path):
    counts = _fuzz(neuron_base, tmp_path, NEURON_CONSISTENT_CASES, consistent=True, seed=SEED + 3,
                   targets=NEURON_TARGETS)
    print(f"\nfuzz, neuron layout + predictors + plan, {NEURON_CONSISTENT_CASES} consistent mutations: "
          + ", ".join(f"{k} {v}" for k, v in counts.items() if k != "failures"))
    tracebacks = [f for f in counts["failures"] if "every check passed" not in f]
    assert not tracebacks, "\n".join(tracebacks[:20])
