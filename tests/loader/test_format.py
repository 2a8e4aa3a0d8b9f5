"""The artifact format's guarantees, one test per
reproduction: paths that leave the artifact, a manifest that protects nothing, malformed headers and
JSON, the error root and the command lines' input edges."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM

from loader.artifact import open_artifact, store_offsets
from loader.binding import check_model
from loader.cli import main as moeload
from loader.codec import CodecError
from loader.errors import MoeError
from loader.format import (
    DIGEST,
    DIGEST_REQUIRED,
    SCHEMA_VERSION,
    ArtifactError,
    MoeSection,
    read_manifest,
    read_record_offsets,
    write_manifest,
)
from loader.hashing import check_record
from loader.io import read_safetensors_header
from loader.plan import PlanError, read_plan
from loader.verify import verify
from prep.cli import main as moeprep
from prep.errors import MoeprepError
from tests.helpers.tiny_models import prepare_tiny_artifact


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A tiny int4 mixtral artifact, prepared once for the module (tests work on copies)."""
    _, artifact = prepare_tiny_artifact(tmp_path_factory.mktemp("format"), precision="int4")
    artifact = artifact.resolve()
    assert DIGEST in _manifest(artifact)  # package seals its manifests
    return artifact


@pytest.fixture
def artifact(built, tmp_path) -> Path:
    copy = tmp_path / "artifact"
    shutil.copytree(built, copy)
    return copy


def _manifest(artifact: Path) -> dict:
    return json.loads((artifact / "manifest.json").read_text())


def _edit(artifact: Path, change) -> None:
    """Change the manifest and seal it again, so the check under test is the one that speaks (a raw edit
    is refused by the manifest's digest first: ``test_a_hand_edited_manifest_is_refused_by_its_digest``)."""
    raw = _manifest(artifact)
    change(raw)
    if isinstance(raw, dict):
        write_manifest(artifact, raw)
    else:
        (artifact / "manifest.json").write_text(json.dumps(raw))


def _rebless(artifact: Path, name: str) -> None:
    """List ``name``'s current size and hash in the manifest, as a consistent (if wrong) producer would."""
    data = (artifact / name).read_bytes()

    def change(raw):
        raw["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    _edit(artifact, change)


def _refused(artifact: Path, match: str) -> list[str]:
    """The artifact is refused by verify, by the load-time checks and by the runtime's load."""
    from loader.runtime import load

    bad = verify(artifact)
    assert bad, "verify passed"
    with pytest.raises(MoeError, match=match):
        open_artifact(artifact)
    with pytest.raises(MoeError):
        load(artifact, memory_budget="unlimited")
    return bad


def _store(artifact: Path) -> Path:
    return next(artifact.glob("experts-*.safetensors"))


def test_the_sound_artifact_passes_every_check(built):
    manifest = open_artifact(built)
    assert verify(built) == [] and manifest.plan is not None
    assert manifest.raw["schema_version"] == SCHEMA_VERSION == 5 and manifest.root == built
    config = AutoConfig.from_pretrained(manifest.root)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    check_model(manifest, model)



def test_the_moe_section_is_typed_and_gives_back_what_was_written(built):
    manifest = read_manifest(built)
    moe, raw = manifest.moe, manifest.raw["moe"]
    assert isinstance(moe, MoeSection) and moe.to_json() == raw
    assert moe.layers == tuple(raw["layers"]) and moe.num_experts == raw["num_experts"] and moe.top_k == raw["top_k"]
    assert len(moe.experts_modules) == len(moe.router_modules) == len(moe.layers)
    assert manifest.expert_keys()[0] == f"layers.{moe.layers[0]}.experts.0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        moe.top_k = 1
    without = {k: v for k, v in raw.items() if k != "routing_weights"}  # an older manifest records no weight function
    assert MoeSection.from_json(without).routing_weights is None and MoeSection.from_json(without).to_json() == without


# ------------------------------------------------------------------------------- one error root (15 §8)


def test_one_error_root_and_both_command_lines_print_it(artifact, tmp_path):
    for error in (ArtifactError, MoeprepError, CodecError, PlanError):
        assert issubclass(error, MoeError)
    assert not issubclass(CodecError, ValueError)
    (artifact / "config.json").write_text("{")
    for cli, args in ((moeload, ["info", str(tmp_path / "nowhere")]), (moeload, ["generate", str(artifact), "--prompt", "x"]),
                      (moeprep, ["eval", "--artifact", str(tmp_path / "nowhere")]),
                      (moeprep, ["eval", "--artifact", str(artifact), "--data", str(tmp_path)])):
        result = CliRunner().invoke(cli, args)
        assert result.exit_code == 1 and result.output.startswith("error: "), (args, result.output)
        assert isinstance(result.exception, SystemExit)  # handled, not a traceback


# ----------------------------------------------------------------------------------- paths (item 4)


def test_a_dotdot_entry_is_refused(artifact, tmp_path):
    outside = tmp_path / "secret.txt"
    outside.write_text("not yours")
    name = "../secret.txt"
    data = outside.read_bytes()
    _edit(artifact, lambda raw: raw["files"].update({name: {"bytes": len(data),
                                                            "sha256": hashlib.sha256(data).hexdigest()}}))
    bad = _refused(artifact, "outside the artifact|normalized relative path")
    assert bad[0].startswith("manifest.json:") and "'../secret.txt'" in bad[0]
    _edit(artifact, lambda raw: raw["files"].pop(name))
    for name in ("/etc/passwd", "a/../config.json", "./config.json", "", "a\\b"):
        _edit(artifact, lambda raw, n=name: raw["files"].update({n: raw["files"]["config.json"]}))
        with pytest.raises(ArtifactError, match="a manifest may only name files inside the artifact"):
            read_manifest(artifact)
        _edit(artifact, lambda raw, n=name: raw["files"].pop(n))
    assert verify(artifact) == []


def test_another_artifacts_store_is_refused(artifact):
    _edit(artifact, lambda raw: raw["stores"]["int4"].update(file="../other/experts-int4.safetensors"))
    _refused(artifact, "stores.int4.file must be 'experts-int4.safetensors'")


def test_an_escaping_symlink_is_refused(artifact, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(artifact / "config.json", outside / "config.json")  # same bytes: only the path is wrong
    (artifact / "config.json").unlink()
    (artifact / "config.json").symlink_to(outside / "config.json")
    bad = _refused(artifact, "resolves to .* outside the artifact directory")
    assert "config.json" in bad[0]
    (artifact / "config.json").unlink()
    (artifact / "config.json").symlink_to("../artifact/config.json")  # a loop through the parent
    with pytest.raises(ArtifactError, match="cannot be resolved"):
        read_manifest(artifact)
    (artifact / "config.json").unlink()
    shutil.copy(outside / "config.json", artifact / "config.json")
    (artifact / "sub").mkdir()
    (artifact / "sub" / "c.json").symlink_to("../config.json")  # a symlink that stays inside is fine
    _rebless(artifact, "sub/c.json")
    assert verify(artifact) == []


def test_the_artifact_directory_is_resolved_once(artifact, tmp_path):
    """An artifact reached through a symlink (prepare's versioned swap) is read from one version."""
    link = tmp_path / "current"
    link.symlink_to(artifact)
    manifest = open_artifact(link)
    assert manifest.root == artifact.resolve()
    other = tmp_path / "other"
    other.mkdir()
    link.unlink()
    link.symlink_to(other)  # swapped while "loading": the opened manifest still points at its version
    assert manifest.path("config.json") == artifact.resolve() / "config.json"
    with pytest.raises(ArtifactError, match="no manifest.json"):
        open_artifact(link)


# -------------------------------------------------------------------------- silent wrong output (item 5)


def test_flipped_record_bytes_are_caught_at_read(artifact):
    manifest = open_artifact(artifact)
    (precision, info), = manifest.stores.items()
    offsets = store_offsets(manifest, precision)
    key = manifest.expert_keys()[3]
    data = bytearray(_store(artifact).read_bytes()[offsets[key]:offsets[key] + info.stride])
    check_record(manifest, precision, key, data)  # sound: nothing raised
    check_record(manifest, precision, key, torch.frombuffer(bytearray(data), dtype=torch.uint8))
    data[17] ^= 0x10
    with pytest.raises(ArtifactError, match=rf"record {key} of .* is damaged \(xxh3_64"):
        check_record(manifest, precision, key, data)
    with pytest.raises(ArtifactError, match="truncated"):
        check_record(manifest, precision, key, bytes(info.record_bytes - 1))
    store = bytearray(_store(artifact).read_bytes())
    store[offsets[key] + 17] ^= 0x10
    _store(artifact).write_bytes(bytes(store))
    open_artifact(artifact)  # the store is not hashed at load: each record is checked as it is read
    assert verify(artifact) == [f"{_store(artifact).name}: xxh3_64 of records ['{key}'] differ from the manifest "
                                "(the manifest or the records changed)"]
    # the reproduction: generate used to print text from flipped expert bytes and exit 0
    for offset in offsets.values():  # one flipped byte in every record: whichever is read first fails
        store[offset + 5] ^= 0x01
    _store(artifact).write_bytes(bytes(store))
    result = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "abc", "--max-new-tokens", "2"])
    assert result.exit_code == 1 and "error: record layers." in result.output and "xxh3_64" in result.output


def test_an_edited_crc_is_caught_by_verify(artifact):
    key = "layers.1.experts.2"
    _edit(artifact, lambda raw: raw["stores"]["int4"]["xxh3"].update({key: (raw["stores"]["int4"]["xxh3"][key] + 1)
                                                                      % 2**32}))
    assert verify(artifact) == [f"{_store(artifact).name}: xxh3_64 of records ['{key}'] differ from the manifest "
                                "(the manifest or the records changed)"]


def test_empty_files_is_refused(artifact):
    _edit(artifact, lambda raw: raw.update(files={}))
    _refused(artifact, "files is empty")
    _edit(artifact, lambda raw: raw.update(files={"report.json": {"bytes": 1, "sha256": "0" * 64}}))
    _refused(artifact, r"files does not list \['config.json', 'dense.safetensors', 'plan.json'")


def test_an_edited_top_k_is_refused(artifact):
    _edit(artifact, lambda raw: raw["moe"].update(top_k=3))
    bad = _refused(artifact, "config num_experts_per_tok is 2, manifest moe.top_k is 3")
    assert bad[0].startswith("config.json:")


def test_moe_facts_are_checked_against_any_config_name_and_text_config(artifact):
    config = json.loads((artifact / "config.json").read_text())
    config["text_config"] = {"model_type": "mixtral", "n_routed_experts": 5}
    (artifact / "config.json").write_text(json.dumps(config))
    _rebless(artifact, "config.json")
    with pytest.raises(ArtifactError, match="config n_routed_experts is 5, manifest moe.num_experts is 4"):
        open_artifact(artifact)


def test_the_dense_weights_are_hashed_at_load(artifact):
    dense = bytearray((artifact / "dense.safetensors").read_bytes())
    dense[-5] ^= 0x01
    (artifact / "dense.safetensors").write_bytes(bytes(dense))
    _refused(artifact, "dense.safetensors: sha256 mismatch")


def test_check_model_refuses_a_layout_that_fits_its_bytes_but_not_the_model(artifact):
    def transpose(raw):
        for spec in raw["stores"]["int4"]["layout"]:
            if spec["name"] == "down_proj":
                spec["shape"] = spec["shape"][::-1]
                spec["group_size"] = 16

    _edit(artifact, transpose)
    manifest = open_artifact(artifact)  # same record size: only the model skeleton can tell
    config = AutoConfig.from_pretrained(manifest.root)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with pytest.raises(ArtifactError, match=r"down_proj is \(4, 32, 16\) in the model"):
        check_model(manifest, model)


def test_a_hand_edited_manifest_is_refused_by_its_digest(artifact):
    """The manifest protects itself: an edit that keeps every type and cross-check (here a crc32 of a
    record this load may never read) is refused at once, however the JSON is formatted."""
    _edit(artifact, lambda raw: None)  # sealed, as package writes it
    raw = _manifest(artifact)
    key = "layers.0.experts.1"
    raw["stores"]["int4"]["xxh3"][key] ^= 1
    (artifact / "manifest.json").write_text(json.dumps(raw, indent=4, sort_keys=True))
    bad = _refused(artifact, "does not match its digest")
    assert bad[0].startswith("manifest.json:")
    raw["stores"]["int4"]["xxh3"][key] ^= 1
    (artifact / "manifest.json").write_text(json.dumps(raw))  # any formatting of the same content is fine
    assert verify(artifact) == []
    if DIGEST_REQUIRED:  # once package seals every manifest, an unsealed one is refused too
        del raw[DIGEST]
        (artifact / "manifest.json").write_text(json.dumps(raw))
        _refused(artifact, "digest is missing")


# ------------------------------------------------------------------------------ malformed input (item 7)


@pytest.mark.parametrize("value", [True, 1, "3", 5.0, None, 6])
def test_schema_version_must_be_a_readable_integer(artifact, value):
    _edit(artifact, lambda raw: raw.update(schema_version=value))
    with pytest.raises(ArtifactError, match="schema_version") as err:
        read_manifest(artifact)
    if value == 1:
        assert "re-run `moeprep prepare`" in str(err.value)
    assert verify(artifact)[0].startswith("manifest.json:")


@pytest.mark.parametrize(("change", "named"), [
    (lambda raw: raw["moe"].pop("top_k"), "moe.top_k is missing"),
    (lambda raw: raw["moe"].update(num_experts="4"), "moe.num_experts must be int"),
    (lambda raw: raw["moe"].update(layers=[True, 1]), "moe.layers must be"),
    (lambda raw: raw.pop("package_key"), "package_key is missing"),
    (lambda raw: raw["files"]["config.json"].update(bytes=True), r"files\['config.json'\].bytes must be int"),
    (lambda raw: raw["stores"]["int4"]["xxh3"].update({"layers.9.experts.0": 1}), "one checksum per expert"),
    (lambda raw: raw["stores"]["int4"].update(xxh3={}), "one checksum per expert"),
    (lambda raw: raw["stores"]["int4"]["xxh3"].update({"layers.0.experts.0": -1}), "unsigned 64-bit"),
    (lambda raw: raw.update(extra=1), r"unknown keys \['extra'\]"),
    (lambda raw: raw["moe"].update(experts_modules=raw["moe"]["experts_modules"][::-1]), "not a module of layer"),
])
def test_missing_and_mistyped_keys_are_named(artifact, change, named):
    _edit(artifact, change)
    with pytest.raises(ArtifactError, match=named) as err:
        read_manifest(artifact)
    assert "manifest.json" in str(err.value) and "re-run `moeprep prepare`" in str(err.value)


def test_an_expert_the_plan_needs_but_its_store_lacks_is_refused_at_open(artifact):
    """A store may hold a subset of the experts (mixed precisions), but never fewer than the plan reads."""
    _edit(artifact, lambda raw: raw["stores"]["int4"]["xxh3"].pop("layers.0.experts.0"))
    with pytest.raises(ArtifactError, match="plans expert 0 of MoE layer 0 at int4, but the int4 store has no record"):
        open_artifact(artifact)


@pytest.mark.parametrize("which", ["store", "dense"])
def test_a_header_length_of_2_to_the_60_is_an_error_not_a_memory_error(artifact, which):
    path = _store(artifact) if which == "store" else artifact / "dense.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = struct.pack("<Q", 2**60)
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="header length field says 1,152,921,504,606,846,976 bytes"):
        read_safetensors_header(path)
    with pytest.raises(ArtifactError):
        read_record_offsets(path)
    if which == "dense":
        _rebless(artifact, path.name)
    _refused(artifact, "header length field|sha256 mismatch")


def test_store_header_offsets_must_be_exactly_the_manifests(artifact):
    path = _store(artifact)
    data = bytearray(path.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    a, b = "layers.0.experts.0", "layers.0.experts.1"
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    text = json.dumps(header, separators=(",", ":")).encode()
    data[8:8 + n] = text + b" " * (n - len(text))
    path.write_bytes(bytes(data))
    read_record_offsets(path)  # a valid safetensors file ...
    with pytest.raises(ArtifactError, match="record layers.0.experts.0 is laid out as"):  # ... not this artifact's
        open_artifact(artifact)


@pytest.mark.parametrize("name", ["plan.json", "config.json", "tokenizer_config.json", "report.json"])
def test_invalid_json_gets_one_error_naming_the_file(artifact, name):
    """Loading needs no report.json (it is informational): a broken one is found by verify and by info, not by
    the load-time checks; every other JSON file is refused at load."""
    (artifact / name).write_text('{"truncated": ')
    if name != "report.json":
        with pytest.raises(MoeError, match=name):  # as copied: the hash fails
            open_artifact(artifact)
    _rebless(artifact, name)  # as a producer would have written it: the JSON parse fails
    if name != "report.json":
        with pytest.raises(MoeError, match=rf"{name}.* is not valid JSON") as err:
            open_artifact(artifact)
        assert "prepare" in str(err.value)
    else:
        open_artifact(artifact)
    bad = verify(artifact)
    assert len(bad) == 1 and name in bad[0], bad
    if name == "plan.json":
        with pytest.raises(PlanError, match="not valid JSON"):
            read_plan(artifact)
    if name == "report.json":
        result = CliRunner().invoke(moeload, ["info", str(artifact)])
        assert result.exit_code == 1 and "report.json" in result.output and "not valid JSON" in result.output


@pytest.mark.parametrize("version", [2, 3, 4])
def test_artifacts_of_an_older_schema_are_refused_with_the_fix(artifact, version):
    """Schema 5 checks records with xxh3_64 where 2-4 had crc32: an older artifact is prepared again."""
    _edit(artifact, lambda raw: raw.update(schema_version=version))
    with pytest.raises(ArtifactError, match="re-run `moeprep prepare`"):
        read_manifest(artifact)
    assert verify(artifact)[0].startswith("manifest.json:")


def test_version_1_artifacts_are_refused_with_the_fix(artifact):
    _edit(artifact, lambda raw: raw.update(schema_version=1))
    result = CliRunner().invoke(moeload, ["generate", str(artifact), "--prompt", "abc"])
    assert result.exit_code == 1 and "re-run `moeprep prepare`" in result.output


# ---------------------------------------------------------------------------------- input edges (item 10)


@pytest.mark.parametrize(("args", "message"), [
    (["--max-new-tokens", "0"], "--max-new-tokens must be from 1 to 1,000,000"),
    (["--max-new-tokens", "-3"], "--max-new-tokens must be from 1 to 1,000,000"),
    (["--device", "gpu"], "use cpu, cuda or cuda:N"),
    (["--device", "mps"], "use cpu, cuda or cuda:N"),
    (["--device", "meta"], "use cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "cuda"),
])
def test_generate_input_edges(built, args, message):
    result = CliRunner().invoke(moeload, ["generate", str(built), "--prompt", "abc", *args])
    assert result.exit_code == 1 and result.output.startswith("error: ") and message in result.output


def test_the_record_hash_is_the_xxh3_64_of_the_record_bytes(built):
    """The manifest's xxh3 is plain xxh3_64 over record_bytes (what prep.quant.records writes)."""
    from xxhash import xxh3_64_intdigest

    manifest = open_artifact(built)
    (precision, info), = manifest.stores.items()
    raw = _store(built).read_bytes()
    for key, offset in store_offsets(manifest, precision).items():
        assert xxh3_64_intdigest(raw[offset:offset + info.record_bytes]) == info.xxh3[key]
