"""One reader per file kind, used by every command: a table of damaged routing samples and device profiles, each raw
(the manifest's hashes left as they were) and resealed (the hashes updated, so only the value checks can catch it),
through ``moeload plan``, ``verify``, ``generate`` and ``moeprep prepare --device-profile --dry-run``: one refusal
each, with the reader's message everywhere.

The artifact is the shared tiny int4 one (``tests.helpers.tiny_models.tiny_artifact``), copied per case (120 KB);
every command runs in-process and refuses before it loads a weight, so the table takes seconds.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from loader.artifact import file_problem
from loader.cli import main as moeload
from loader.device import DEVICE_FILE, DeviceProfile, load_profile, read_artifact_profile
from loader.errors import MoeError
from loader.format import read_manifest, sha256_file, write_manifest
from loader.io import MAX_JSON_DEPTH, parse_json
from loader.simulate import ROUTING_SAMPLE, read_routing_sample
from loader.verify import verify
from tests.helpers.tiny_models import tiny_artifact

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    return tiny_artifact(tmp_path_factory, precision="int4")[1]


def good_profile() -> dict:
    """A calibrated profile with every optional table, for the tiny model's expert shape."""
    made = DeviceProfile(1e9, 2e-5, {"float32": 2e-3, "bfloat16": 1.5e-3, "int4": 1e-3, "passthrough": 1.5e-3},
                         "cpu: test", {"expert_shape": {"hidden": 256, "intermediate": 512}, "compute_device": "cpu",
                                       "read_depths": {"1": 1e9, "2": 1.5e9}, "read_depth": 2,
                                       "prefill_seconds_per_expert": {"int4": {"record": {
                                           "make_s": 1e-4, "tokens": {"1": 1e-3, "16": 4e-3}}}}},
                         {"int4": 1e-4}, {"overlap": True, "layer_overhead_s": 1e-4})
    return made.to_json()


def reseal(root: Path, name: str) -> None:
    """List ``name``'s new size and sha256 in the manifest (sealed again), as a careful forger would."""
    raw = json.loads((root / "manifest.json").read_text())
    raw["files"][name] = {"bytes": (root / name).stat().st_size, "sha256": sha256_file(root / name)}
    write_manifest(root, raw)


def copy_with_profile(artifact: Path, where: Path) -> Path:
    """A copy of the artifact that carries a good, sealed device.json (so routing cases have a profile to predict
    with and profile cases have a sealed file to damage)."""
    copy = where / "artifact"
    shutil.copytree(artifact.resolve(), copy)
    (copy / DEVICE_FILE).write_text(json.dumps(good_profile()))
    reseal(copy, DEVICE_FILE)
    return copy


# ------------------------------------------------------------------------------------------------- the damages


def _set(key, value):
    return lambda p: p | {key: value}


def _nested(depth: int) -> str:
    return '{"format": "moeprep-device-profile", "x": ' + "[" * depth + "]" * depth + "}"


PROFILE_DAMAGES = {  # name -> (dict -> dict) or the file's text
    "shape zero": _set("expert_shape", {"hidden": 0, "intermediate": 512}),
    "shape string": _set("expert_shape", {"hidden": "256", "intermediate": 512}),
    "shape empty": _set("expert_shape", {}),
    "shape negative": _set("expert_shape", {"hidden": -256, "intermediate": 512}),
    "shape 1e308": _set("expert_shape", {"hidden": 1e308, "intermediate": 512}),
    "bandwidth 1e308": _set("read_bandwidth_bytes_per_s", 1e308),
    "bandwidth string": _set("read_bandwidth_bytes_per_s", "fast"),
    "bandwidth past float": _set("read_bandwidth_bytes_per_s", 10 ** 400),
    "compute NaN": lambda p: p | {"compute_seconds_per_expert": {"int4": float("nan")}},
    "compute empty": _set("compute_seconds_per_expert", {}),
    "compute free": lambda p: p | {"compute_seconds_per_expert": dict.fromkeys(p["compute_seconds_per_expert"], 0.0)},
    "no compute for the plan's precision": lambda p: p | {"compute_seconds_per_expert": {"float32": 1e-3}},
    "prefill tokens not counts": _set("prefill_seconds_per_expert",
                                      {"int4": {"record": {"make_s": 0.0, "tokens": {"many": 1e-3}}}}),
    "prefill without make_s": _set("prefill_seconds_per_expert", {"int4": {"record": {"tokens": {"1": 1e-3}}}}),
    "prefill a list": _set("prefill_seconds_per_expert", [1, 2]),
    "calibration negative": _set("calibration", {"overlap": True, "layer_overhead_s": -1.0}),
    "compute device": _set("compute_device", "tpu:7"),
    "not JSON": "{not json",
    "nested deep": _nested(100_000),
}


def _routing(tensors: dict, **changed) -> dict:
    return tensors | changed


def _inputs(tensors: dict, width: int, value: float = 0.5) -> dict:
    t, layers = tensors["expert_ids"].shape[:2]
    inputs = torch.full((t, layers, width), value, dtype=torch.float16)
    return tensors | {"router_inputs": inputs}


ROUTING_DAMAGES = {  # name -> (tensors, router width) -> tensors, or the file's bytes
    "expert ids past E": lambda t, h: _routing(t, expert_ids=torch.full_like(t["expert_ids"], 4)),
    "negative expert id": lambda t, h: _routing(t, expert_ids=t["expert_ids"] - 5),
    "expert ids as floats": lambda t, h: _routing(t, expert_ids=t["expert_ids"].float()),
    "a layer short": lambda t, h: _routing(t, expert_ids=t["expert_ids"][:, :1].contiguous(),
                                           weights=t["weights"][:, :1].contiguous()),
    "one expert twice": lambda t, h: _routing(t, expert_ids=t["expert_ids"][..., :1].repeat(1, 1, 2).contiguous()),
    "negative weights": lambda t, h: _routing(t, weights=-t["weights"]),
    "NaN weights": lambda t, h: _routing(t, weights=torch.full_like(t["weights"], float("nan"))),
    "weights of another shape": lambda t, h: _routing(t, weights=t["weights"][:, :, :1].contiguous()),
    "lengths that do not add up": lambda t, h: _routing(t, sequence_lengths=t["sequence_lengths"] + 1),
    "infinite logits": lambda t, h: _routing(t, logits=torch.full_like(t["logits"], float("inf"))),
    "infinite router inputs": lambda t, h: _inputs(t, h, float("inf")),
    "router inputs too wide": lambda t, h: _inputs(t, h + 1),
    "not safetensors": b"\x00" * 64,
}


def damage_profile(root: Path, damage) -> None:
    text = damage if isinstance(damage, str) else json.dumps(damage(good_profile()))
    (root / DEVICE_FILE).write_text(text)


def damage_routing(root: Path, damage) -> None:
    if isinstance(damage, bytes):
        (root / ROUTING_SAMPLE).write_bytes(damage)
        return
    tensors = load_file(str(root / ROUTING_SAMPLE))
    width = load_file(str(root / "dense.safetensors"))["model.layers.0.mlp.gate.weight"].shape[1]
    save_file({k: v.contiguous() for k, v in damage(tensors, width).items()}, str(root / ROUTING_SAMPLE))


def refusals(root: Path, name: str, with_prepare: bool) -> dict[str, str]:
    """Each command's output on the damaged artifact at ``root`` (whose ``name`` is the damaged file), and its exit
    code checked to be 1."""
    runner = CliRunner()
    out = {}
    plan = runner.invoke(moeload, ["plan", str(root), "--memory-budget", "50%", "--prompt-tokens", "8"])
    out["plan"] = (plan.exit_code, plan.output)
    plan_json = runner.invoke(moeload, ["plan", str(root), "--memory-budget", "50%", "--json"])
    out["plan --json"] = (plan_json.exit_code, plan_json.output)
    lines = verify(root)
    out["verify"] = (1 if lines else 0, "\n".join(lines))
    generate = runner.invoke(moeload, ["generate", str(root), "--prompt", "a b", "--max-new-tokens", "1"])
    out["generate"] = (generate.exit_code, generate.output)
    if with_prepare:
        from prep.cli import main as moeprep

        prepare = runner.invoke(moeprep, ["prepare", "--recipe", str(ROOT / "recipes/reference.yaml"),
                                          "--device-profile", str(root / name), "--dry-run"])
        out["prepare --dry-run"] = (prepare.exit_code, prepare.output)
    return out


def expected(root: Path, name: str, read) -> tuple[str, str]:
    """(the reader's message, what ``verify`` prints for the file): ``name: problem`` where the file does not match
    its manifest (the reader's message holds those words), else ``name: message``."""
    manifest = read_manifest(root)
    with pytest.raises(MoeError) as refused:
        read(manifest)
    message = str(refused.value)
    problem = file_problem(manifest, name, hash_it=True)
    assert (problem is None) == (" is damaged: " not in message)
    return message, f"{name}: {problem}" if problem else f"{name}: {message}"


def check_one_message(found: dict, message: str, line: str) -> None:
    """Each command refused once (exit 1, no traceback), saying the reader's message; verify its one line."""
    for command, (code, output) in found.items():
        assert code == 1, f"{command} exited {code}: {output[-500:]}"
        assert "Traceback" not in output
        if command != "verify":
            assert message in output, f"{command} does not say {message!r}:\n{output[-800:]}"
    assert found["verify"][1] == line
    assert line.split(": ", 1)[1] in message


@pytest.mark.parametrize("sealed", [False, True], ids=["raw", "resealed"])
@pytest.mark.parametrize("case", list(PROFILE_DAMAGES))
def test_a_damaged_device_profile_is_refused_alike_by_every_command(artifact, tmp_path, case, sealed):
    root = copy_with_profile(artifact, tmp_path)
    damage_profile(root, PROFILE_DAMAGES[case])
    if sealed:
        reseal(root, DEVICE_FILE)
    message, line = expected(root, DEVICE_FILE, read_artifact_profile)
    # prepare reads the profile as a file of its own (no manifest to hash it against, no model yet to time): the
    # value checks' message, the artifact's own where it is sealed
    try:
        load_profile(root / DEVICE_FILE)
        standalone = None
    except MoeError as e:
        standalone = str(e)
    found = refusals(root, DEVICE_FILE, with_prepare=standalone is not None)
    if standalone is not None:
        code, prepared = found.pop("prepare --dry-run")
        assert code == 1 and standalone in prepared and "Traceback" not in prepared
        assert not sealed or standalone == message
    else:  # only the model tells: a profile without a time for the plan's precision
        assert case == "no compute for the plan's precision"
    check_one_message(found, message, line)


@pytest.mark.parametrize("sealed", [False, True], ids=["raw", "resealed"])
@pytest.mark.parametrize("case", list(ROUTING_DAMAGES))
def test_a_damaged_routing_sample_is_refused_alike_by_every_command(artifact, tmp_path, case, sealed):
    root = copy_with_profile(artifact, tmp_path)
    damage_routing(root, ROUTING_DAMAGES[case])
    if sealed:
        reseal(root, ROUTING_SAMPLE)
    message, line = expected(root, ROUTING_SAMPLE, read_routing_sample)
    check_one_message(refusals(root, ROUTING_SAMPLE, with_prepare=False), message, line)


def test_the_same_routing_given_with_routing_is_refused_by_its_values(artifact, tmp_path):
    """``plan --routing FILE``: a file of the user's, checked by the same reader (no manifest to hash it against)."""
    root = copy_with_profile(artifact, tmp_path)
    given = tmp_path / "mine.safetensors"
    shutil.copy(root / ROUTING_SAMPLE, given)
    tensors = load_file(str(given))
    save_file(tensors | {"weights": -tensors["weights"]}, str(given))
    result = CliRunner().invoke(moeload, ["plan", str(root), "--memory-budget", "50%", "--routing", str(given)])
    assert result.exit_code == 1 and f"routing sample {given}: weights hold negative gating weights" in result.output


def test_the_undamaged_copy_plans_verifies_and_prints_strict_json(artifact, tmp_path):
    root = copy_with_profile(artifact, tmp_path)
    assert verify(root) == []
    result = CliRunner().invoke(moeload, ["plan", str(root), "--memory-budget", "50%", "--json", "--prompt-tokens", "8"])
    assert result.exit_code == 0, result.output
    view = json.loads(result.output, parse_constant=lambda token: pytest.fail(f"plan --json printed {token}"))
    assert view["prediction"]["available"] and "not_finite" not in view


def test_plan_exits_1_when_the_profile_it_was_given_is_missing(artifact, tmp_path):
    result = CliRunner().invoke(moeload, ["plan", str(artifact), "--memory-budget", "50%",
                                          "--device-profile", str(tmp_path / "none.json")])
    assert result.exit_code == 1 and "does not exist" in result.output and "prediction" not in result.output


def test_json_nested_past_the_bound_is_one_clear_error():
    assert parse_json("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH) is not None
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(ValueError, match="nested deeper"):
            parse_json("[" * depth + "]" * depth)


def test_a_fifo_given_as_a_profile_is_refused_without_blocking(tmp_path):
    import os

    fifo = tmp_path / "device.json"
    os.mkfifo(fifo)
    with pytest.raises(MoeError, match="not a regular file"):
        load_profile(fifo)


def test_profile_device_refuses_a_missing_output_directory_before_it_measures(tmp_path, monkeypatch):
    import loader.calibrate as calibrate

    def measured(*args, **kwargs):
        raise AssertionError("the measurement started")

    monkeypatch.setattr(calibrate, "measure_device", measured)
    result = CliRunner().invoke(moeload, ["profile-device", "--output", str(tmp_path / "missing" / "device.json")])
    assert result.exit_code == 1 and "does not exist" in result.output and "measurement started" not in result.output
    result = CliRunner().invoke(moeload, ["profile-device", "--output", str(tmp_path)])
    assert result.exit_code != 0 and "directory" in result.output  # click's own check, before any measurement


REPORT_DAMAGES = {
    "points not a list": lambda r: r | {"operating_points": {"budget_bytes": 1}},
    "a point not an object": lambda r: r | {"operating_points": [7]},
    "a point's budget a string": lambda r: r | {"operating_points": [{"budget_bytes": "1GiB"}]},
    "a point's speed infinite": lambda r: r | {"operating_points": [{"budget_bytes": 1 << 20,
                                                                    "modeled_tokens_per_s": float("inf")}]},
    "divergence without stats": lambda r: r | {"divergence": {"held_out": {"sequence_length": 8}, "sequences": 4,
                                                              "tokens": 28, "resamples": 10, "level": 0.95}},
    "a list": lambda r: [r],
}


@pytest.mark.parametrize("case", list(REPORT_DAMAGES))
def test_a_malformed_sealed_report_is_refused_alike_by_info_plan_verify_and_eval(artifact, tmp_path, case):
    from loader.artifact import read_report
    from loader.format import REPORT
    from prep.report import current_report

    root = tmp_path / "artifact"
    shutil.copytree(artifact.resolve(), root)
    report = json.loads((root / REPORT).read_text())
    (root / REPORT).write_text(json.dumps(REPORT_DAMAGES[case](report)))
    reseal(root, REPORT)
    message, line = expected(root, REPORT, read_report)
    with pytest.raises(MoeError) as evaluated:  # what `moeprep eval` and `accuracy` read before they evaluate
        current_report(read_manifest(root))
    assert str(evaluated.value) == message
    runner = CliRunner()
    found = {"info": runner.invoke(moeload, ["info", str(root)]),
             "plan": runner.invoke(moeload, ["plan", str(root), "--memory-budget", "50%"])}
    found = {k: (r.exit_code, r.output) for k, r in found.items()} | {"verify": (1, "\n".join(verify(root)))}
    check_one_message(found, message, line)
