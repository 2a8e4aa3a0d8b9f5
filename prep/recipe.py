"""Strict recipes: a YAML file maps one-to-one onto frozen dataclasses; an unknown key is an error.

A recipe names the model, the calibration data, where the work runs (``executor``) and one section per pipeline stage (each stage declares its
section, a frozen dataclass that checks its own keys; ``Recipe`` is made from the stage table). ``load_recipe``
reads the YAML, applies ``--set section.key=value`` overrides, checks every key and type, and returns a
``Recipe``. ``Recipe.to_dict()`` is the resolved recipe; each stage records the sections it derives from.

YAML is read with a bounded loader: aliases may not expand the document past ``MAX_YAML_NODES`` nodes
(a "billion laughs" recipe is refused at once instead of filling memory), and recursive aliases are
refused. A recipe ``name`` names a directory (``artifacts/<name>/``), so it is one plain path component.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from prep.calibration import CalibrationSection
from prep.errors import MoeprepError
from prep.executor import ExecutorSection
from prep.stages.table import SECTIONS, STAGES

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
MAX_YAML_NODES = 10_000  # a recipe has well under a hundred; aliases may not expand past this


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses documents whose aliases expand past ``MAX_YAML_NODES`` nodes, or loop."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node, sizes: dict, active: set) -> int:
    """Nodes in ``node`` with every alias expanded (each shared node counted once per use)."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in active:
        raise MoeprepError("the recipe YAML has a recursive alias (an anchor used inside itself); remove it")
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1
    for child in children:
        size += _expanded_size(child, sizes, active)
        if size > MAX_YAML_NODES:
            raise MoeprepError(f"the recipe YAML expands to more than {MAX_YAML_NODES:,} values through its "
                               "aliases (&anchor / *alias), far more than a recipe needs; write it out plainly")
    active.discard(id(node))
    sizes[id(node)] = size
    return size


def _load_yaml(text: str, what: str):
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        raise MoeprepError(f"{what} is not valid YAML: {e}") from None
    except RecursionError:
        raise MoeprepError(f"{what} nests too deeply to be a recipe") from None


@dataclass(frozen=True)
class ModelSection:
    """Where the source model comes from: ``path``, a local directory (relative to the repo root), else the
    Hugging Face hub cache's snapshot of ``hub_id`` at ``revision``. ``config``: the model's config.json as
    shipped beside a real-model recipe (public facts; ``moeprep inspect-model`` reads it without weights)."""

    path: str | None = None
    hub_id: str | None = None
    revision: str | None = None
    config: str | None = None




class _RecipeMethods:
    """What every recipe can do; its fields are ``Recipe``'s, made from the stage table below."""

    def to_dict(self) -> dict:
        return _to_plain(dataclasses.asdict(self))

    def model_path(self, root: Path) -> str:
        """The model as a path when it is a local directory relative to ``root`` or a hub-cache snapshot of
        ``model.hub_id``, else what the recipe names (the path, or the hub id)."""
        if self.model.path is not None:
            candidate = (root / self.model.path)
            return str(candidate) if candidate.exists() else self.model.path
        return hub_snapshot(self.model.hub_id, self.model.revision) or self.model.hub_id

    def missing_model_hint(self) -> str:
        """What to do when the model is not here: how to download it and where to point ``model.path``."""
        if self.model.hub_id is None:
            return "set model.path to the directory holding the model's config.json and *.safetensors"
        where = f"models/{self.name}"
        revision = f" --revision {self.model.revision}" if self.model.revision else ""
        return (f"download it with `hf download {self.model.hub_id}{revision} --local-dir {where}` (huggingface_hub's "
                f"CLI; or `huggingface-cli download`), then run `make prepare MODEL={self.name} MODEL_PATH={where}` "
                f"or pass `--set model.path={where}` (a copy in the hub cache is found without it)")


# name, model, calibration, then each stage's section in the table's order (``prep.stages.table.SECTIONS``)
Recipe = dataclasses.make_dataclass(
    "Recipe",
    [("name", str), ("model", ModelSection), ("calibration", CalibrationSection, field(default_factory=CalibrationSection)),
     # how the stages' units run (prep/executor.py): in no stage key and no record, since it changes no output
     ("executor", ExecutorSection, field(default_factory=ExecutorSection)),
     *((name, section, field(default_factory=section)) for name, section in SECTIONS.items())],
    bases=(_RecipeMethods,), frozen=True)
Recipe.__module__ = __name__
Recipe.__doc__ = "A validated recipe: the model, the calibration data and one section per stage (``load_recipe``)."


def hub_snapshot(hub_id: str, revision: str | None = None) -> str | None:
    """The local directory of ``hub_id``'s snapshot in the Hugging Face hub cache, None when it is not there.
    Never touches the network."""
    try:
        from huggingface_hub import snapshot_download

        cache = os.environ.get("HF_HUB_CACHE")  # read now, not at huggingface_hub's import
        path = Path(snapshot_download(hub_id, revision=revision, local_files_only=True, cache_dir=cache))
    except Exception:  # not cached, or no huggingface_hub: both mean "not here"
        return None
    return str(path) if (path / "config.json").is_file() and any(path.glob("*.safetensors")) else None


def _to_plain(value):
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_plain(v) for v in value]
    return value


def _parse_scalar(text: str):
    return _load_yaml(text, f"--set value {text!r}")


def _apply_override(data: dict, assignment: str) -> None:
    if "=" not in assignment or "." not in assignment.split("=", 1)[0]:
        raise MoeprepError(f"--set expects section.key=value, got {assignment!r}")
    dotted, value = assignment.split("=", 1)
    *path, key = dotted.split(".")
    node = data
    for part in path:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise MoeprepError(f"--set {assignment!r}: {part!r} is not a section")
    node[key] = _parse_scalar(value)


def _coerce(value, annotation, where: str):
    """Check ``value`` against a dataclass field's annotation (str/int/float/bool/None/tuple/dataclass)."""
    origin = typing.get_origin(annotation)
    if dataclasses.is_dataclass(annotation):
        if not isinstance(value, dict):
            raise MoeprepError(f"{where} must be a mapping of its keys, got {value!r}")
        return _build(annotation, value, where)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        if len(real := [o for o in options if o is not type(None)]) == 1:  # X | None: X's own error says more
            return _coerce(value, real[0], where)
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, where)
            except MoeprepError:
                continue
        kinds = " or ".join("null" if o is type(None) else getattr(o, "__name__", str(o)) for o in options)
        raise MoeprepError(f"{where} must be {kinds}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise MoeprepError(f"{where} must be a list, got {value!r}")
        (item_type, _ellipsis) = typing.get_args(annotation)
        return tuple(_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value))
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if annotation is bool and not isinstance(value, bool):
        raise MoeprepError(f"{where} must be true or false, got {value!r}")
    if annotation in (int, float) and isinstance(value, bool):
        raise MoeprepError(f"{where} must be a number, got {value!r}")
    if not isinstance(value, annotation):
        raise MoeprepError(f"{where} must be {annotation.__name__}, got {value!r}")
    return value


def _build(cls, data: dict, where: str):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise MoeprepError(
            f"unknown key {', '.join(repr(u) for u in unknown)} in {where}; allowed keys: {', '.join(names)}"
        )
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _coerce(data[f.name], hints[f.name], f"{where}.{f.name}" if where else f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MoeprepError(f"missing key {f.name!r} in {where or 'the recipe'}")
    return cls(**kwargs)


def _validate(recipe: Recipe) -> None:
    """The recipe's own rules (each section checked its keys as it was built), then each stage's rules across
    sections (``Stage.check``)."""
    if not NAME_PATTERN.fullmatch(recipe.name):
        raise MoeprepError(f"recipe name {recipe.name!r} is not allowed: it names the directory artifacts/<name>, "
                           "so use letters, digits, '.', '_' and '-', starting with a letter or digit "
                           "(no '/', no '..'); set name: in the recipe")
    if recipe.model.path is None and recipe.model.hub_id is None:
        raise MoeprepError("the recipe names no model: set model.path (a local directory) or model.hub_id")
    for stage in STAGES:
        if stage.check is not None:
            stage.check(recipe)


def recipe_from_dict(data: dict, overrides: tuple[str, ...] = ()) -> Recipe:
    """A validated Recipe from plain data plus ``section.key=value`` overrides."""
    data = _to_plain(data or {})
    for assignment in overrides:
        _apply_override(data, assignment)
    recipe = _build(Recipe, data, "")
    _validate(recipe)
    return recipe


def load_recipe(path: str | Path, overrides: tuple[str, ...] = ()) -> Recipe:
    """Read a recipe YAML (see ``recipes/reference.yaml``) and apply overrides."""
    path = Path(path)
    if not path.is_file():
        available = sorted(p.stem for p in path.parent.glob("*.yaml")) if path.parent.is_dir() else []
        hint = f"; recipes in {path.parent}: {', '.join(available)}" if available else ""
        raise MoeprepError(f"recipe {path} not found{hint}")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise MoeprepError(f"cannot read recipe {path} ({e}); it must be a UTF-8 YAML file") from None
    data = _load_yaml(text, f"recipe {path}")
    if not isinstance(data, dict):
        raise MoeprepError(f"recipe {path} must be a mapping of sections")
    data.setdefault("name", path.stem)
    return recipe_from_dict(data, overrides)
