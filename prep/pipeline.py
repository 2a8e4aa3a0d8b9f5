"""The stage table, cache keys, resume, ``--until`` and ``--force``.

``STAGES`` lists the stage modules' declarations (``prep/stages/__init__.py`` says what a stage
declares). ``prepare(recipe)`` walks the table in order with no per-stage code: for each stage it
computes the key from what the stage declares (its recipe section; the keys of the stages it reads;
the model fingerprint when it needs the model; the calibration section and data fingerprint when it
needs calibration data; the recipe it records), reuses a complete cached result (and, for a stage
whose output lives outside the stage store, only when ``output_ok`` confirms that output), and
otherwise runs it; a stage that splits its work hands its units to the run's executor (``prep/executor.py``,
the recipe's ``executor`` section, in no key). The model, the tokenizer and the calibration data are loaded on first use, so a
fully cached run loads none of them. ``force`` reruns the named stage and every stage after it;
``until`` stops after the named stage.

The whole run holds an exclusive lock per artifact name (``artifacts/<name>/.lock``) and, for an
``--output`` elsewhere, one on that output; leftovers of interrupted runs are tidied first.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from functools import cached_property
from pathlib import Path

from tqdm import tqdm

from prep.adapters import get_adapter, load_config
from prep.calibration import calibration_sequences, check_context, fingerprint_sequences
from prep.errors import MoeprepError
from prep.executor import LocalExecutor, MapStats, Unit, UnitPaths, fixed_threads, import_ray, make_executor
from prep.fingerprint import model_fingerprint
from prep.integrity import notice
from prep.recipe import Recipe
from prep.stages import Stage, StageResult
from prep.stages.table import REPORT, STAGE_NAMES, STAGES
from prep.store import ArtifactOutput, StageStore, exclusive_lock, stage_key
from prep.streaming import check_device, give_back_memory, load_streamed

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def _file_digest(path: Path) -> str | None:
    """sha256 of a recipe-named input file (None when it is missing: the stage itself says so when it runs)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def lineage(stage: Stage, stages: tuple[Stage, ...] = STAGES, recipe: Recipe | None = None) -> list[Stage]:
    """``stage`` and every stage it reads, directly or not, in table order; with ``recipe``, a stage it
    switches off is listed but what it would read is not followed."""
    by_name = {s.name: s for s in stages}
    wanted, todo = set(), [stage.name]
    while todo:
        name = todo.pop()
        if name not in wanted:
            wanted.add(name)
            off = recipe is not None and by_name[name].enabled is not None and not by_name[name].enabled(recipe)
            todo += () if off else by_name[name].reads
    return [s for s in stages if s.name in wanted]


class _Sources:
    """What stages may need, each loaded or computed on first use and then shared by every stage."""

    def __init__(self, recipe: Recipe, root: Path, model_dir: Path, device: str = "cpu",
                 expert_memory: int | str | None = "auto") -> None:
        self.recipe, self.root, self.model_dir = recipe, root, model_dir
        self.device, self.expert_memory = device, expert_memory
        self.sections = recipe.to_dict()

    @cached_property
    def model_fingerprint(self) -> str:
        return model_fingerprint(self.model_dir)

    @cached_property
    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @cached_property
    def sequences(self) -> list:
        check_context(self.recipe, load_config(self.model_dir))
        return calibration_sequences(self.recipe.calibration, self.tokenizer, self.root)

    @cached_property
    def data_fingerprint(self) -> str:

        return fingerprint_sequences(self.sequences)

    @cached_property
    def model(self):
        # dense weights loaded, routed experts read from the shards a layer at a time (prep/streaming.py)

        return load_streamed(self.model_dir, device=self.device, resident_bytes=self.expert_memory)

    @cached_property
    def adapter(self):

        return get_adapter(self.model)

    def recipe_of(self, stage: Stage) -> dict:
        """The resolved recipe ``stage``'s output derives from: name, model, the sections of its lineage,
        and the calibration section when one of them reads calibration data."""
        chain = lineage(stage, recipe=self.recipe)
        names = ["name", "model"] + [s.section for s in chain]
        if any("calibration" in s.needs and (s.enabled is None or s.enabled(self.recipe)) for s in chain):
            names.append("calibration")
        return {k: v for k, v in self.sections.items() if k in names}

    def key_inputs(self, stage: Stage) -> tuple[dict, dict]:
        """(config, fingerprints) of ``stage``'s key: exactly what it declares."""
        config: dict = {"section": self.sections[stage.section]}
        fingerprints: dict = {}
        if "model" in stage.needs:
            fingerprints["model"] = self.model_fingerprint
        if "calibration" in stage.needs:
            config["calibration"] = self.sections["calibration"]
            fingerprints["data"] = self.data_fingerprint
        if "recipe" in stage.needs:
            config["recipe"] = self.recipe_of(stage)
        if stage.files is not None:
            fingerprints["files"] = {name: _file_digest(self.root / name) for name in stage.files(self.recipe)}
        return config, fingerprints


class StageInputs:
    """What one stage run may use; asking for something the stage did not declare is a bug in that stage
    (its key would not cover it), so it raises ``TypeError``."""

    def __init__(self, stage: Stage, sources: _Sources, store: StageStore, keys: dict[str, str],
                 artifact: ArtifactOutput, executor=None) -> None:
        self.stage, self._sources, self._store, self._keys, self._artifact = stage, sources, store, keys, artifact
        self.config = getattr(sources.recipe, stage.section)
        self.report_layout = REPORT  # report.md's sections, for a stage that renders it (package, evaluate)
        self.key = keys[stage.name]
        self.root, self.model_dir = sources.root, sources.model_dir
        self.work: Path | None = None
        self.executor = executor or LocalExecutor()
        self.unit_stats: MapStats | None = None

    def map_units(self, units: list[Unit], desc: str | None = None) -> MapStats:
        """Run the stage's work units with the run's executor (``prep/executor.py``): each writes its file in
        ``self.work``; units whose file is there already are reused. In-process units use this run's model; a
        Ray worker loads it from the model directory. Returns (and keeps, for the summary) what it did."""
        paths = UnitPaths(model_dir=str(Path(self.model_dir).resolve()), device=self._sources.device,
                          expert_memory=self._sources.expert_memory)
        load_model = (lambda: self.model) if "model" in self.stage.needs else None
        stats = self.executor.map(self.stage.name, units, Path(self.work), paths, load_model=load_model, desc=desc,
                                  key=self.key)
        self.unit_stats = stats if self.unit_stats is None else self.unit_stats + stats
        return stats

    def _need(self, what: str):
        if what not in self.stage.needs:
            raise TypeError(f"stage {self.stage.name} uses {what!r} but does not declare it in needs")

    def upstream(self, name: str, optional: bool = False) -> tuple[Path, StageResult] | None:
        """(stage directory, result) of a stage this one reads; with ``optional``, None when the recipe
        switches that stage off."""
        if name not in self.stage.reads:
            raise TypeError(f"stage {self.stage.name} reads {name!r} but does not declare it in reads")
        reader = next(s for s in STAGES if s.name == name)
        key = self._keys[name]
        if optional and reader.enabled is not None and not reader.enabled(self._sources.recipe):
            return None
        if not self._store.is_complete(name, key):
            raise MoeprepError(f"stage {self.stage.name} needs the result of stage {name}, which this recipe "
                               f"switches off; enable it")
        return self._store.final_dir(name, key), self._store.load(reader, key)

    def read_results(self) -> list[tuple[type[StageResult], StageResult | None]]:
        """(result type, result) of each stage this one reads, in the table's order, the result None where the
        recipe switches that stage off: what ``prep.stages.report_entries`` folds into report.json."""
        found = ((s.result, self.upstream(s.name, optional=True)) for s in STAGES if s.name in self.stage.reads)
        return [(kind, f[1] if f is not None else None) for kind, f in found]

    def contributions(self) -> list[StageResult]:
        """The results of the stages this one reads that the recipe switches on, in the table's order: what
        ``prep.stages.planning.compose_plan`` applies (``StageResult.apply``)."""
        return [result for _, result in self.read_results() if result is not None]

    @property
    def model(self):
        self._need("model")
        return self._sources.model

    @property
    def adapter(self):
        self._need("model")
        return self._sources.adapter

    @property
    def tokenizer(self):
        self._need("model")
        return self._sources.tokenizer

    @property
    def model_fingerprint(self) -> str:
        self._need("model")
        return self._sources.model_fingerprint

    @property
    def sequences(self) -> list:
        self._need("calibration")
        return self._sources.sequences

    @property
    def calibration(self):
        """The recipe's calibration section (``prep.calibration.CalibrationSection``): where the text came from."""
        self._need("calibration")
        return self._sources.recipe.calibration

    @property
    def recipe(self) -> dict:
        self._need("recipe")
        return self._sources.recipe_of(self.stage)

    @property
    def source(self) -> dict:
        """The source model as recorded: {path, hub_id, revision, fingerprint}."""
        self._need("recipe")
        self._need("model")
        model = self._sources.recipe.model
        return {"path": model.path if model.path is not None else str(self.model_dir), "hub_id": model.hub_id,
                "revision": model.revision, "fingerprint": self._sources.model_fingerprint}

    @property
    def artifact(self) -> ArtifactOutput:
        self._need("artifact")
        return self._artifact


def _check_stage(name: str | None, what: str) -> None:
    if name is not None and name not in STAGE_NAMES:
        raise MoeprepError(f"{what} {name!r} is not a stage; stages in order: {', '.join(STAGE_NAMES)}")


def prepare(recipe: Recipe, root: str | Path = ".", output: str | Path | None = None,
            until: str | None = None, force: str | None = None, overwrite: bool = False,
            device: str = "cpu", expert_memory: int | str | None = "auto") -> dict:
    """Run the pipeline for ``recipe``; returns {stage: {key, seconds, cached[, skipped]}} and the artifact path.

    ``device``: where the stages run the model (``cuda`` needs a GPU). ``expert_memory``: bytes of routed
    experts kept in memory between uses (None: all of them once read; 0: one MoE layer at a time; "auto":
    what fits in half the memory available, ``prep.streaming.load_streamed``). Neither changes a result, so
    neither is part of a stage key.

    ``output`` (default ``artifacts/<name>/artifact`` under ``root``) is replaced only when it is absent,
    empty or a moeprep artifact, unless ``overwrite``; the model directory, the working directory, the
    project root and the stage cache are never replaced.
    """
    root = Path(root)
    problems = preflight(recipe, root, output, overwrite, device, until, force)
    if problems:
        raise problems[0]
    model_dir = Path(recipe.model_path(root))
    work_root = root / "artifacts" / recipe.name
    default_output = output is None
    artifact = _output(recipe, root, output, overwrite)

    executor = make_executor(recipe.executor)  # asking for Ray without it installed fails here, before any work
    sources = _Sources(recipe, root, model_dir, device, expert_memory)
    try:
        with exclusive_lock(work_root / ".lock", f"artifact name {recipe.name!r}"):
            if default_output:
                return _run_stages(recipe, root, model_dir, work_root, artifact, until, force, sources, executor)
            with artifact.lock():
                return _run_stages(recipe, root, model_dir, work_root, artifact, until, force, sources, executor)
    finally:
        executor.close()


def _output(recipe: Recipe, root: Path, output, overwrite: bool) -> ArtifactOutput:
    work_root = root / "artifacts" / recipe.name
    return ArtifactOutput(work_root / "artifact" if output is None else Path(output),
                          protected=[Path(recipe.model_path(root)), Path.cwd(), root, PROJECT_ROOT, work_root / "stages"],
                          overwrite=overwrite)


def preflight(recipe: Recipe, root: str | Path = ".", output: str | Path | None = None,
              overwrite: bool = False, device: str = "cpu", until: str | None = None,
              force: str | None = None) -> list[MoeprepError]:
    """Every refusal ``prepare`` can make before it reads a weight, in order: ``--until``/``--force`` name stages, the
    device is there, the model is here, the output may be written and replaced, Ray is installed when the recipe's
    executor asks for it, an Optuna database answers, the files the recipe names (a device profile) exist.
    ``prepare`` raises the first; ``--dry-run`` reports them all. Reads no weights and writes nothing (a database
    storage is opened and closed)."""
    root = Path(root)
    problems = []
    for check in (lambda: _check_stage(until, "--until"), lambda: _check_stage(force, "--force"),
                  lambda: check_device(device)):
        try:
            check()
        except MoeprepError as e:
            problems.append(e)
    model_dir = Path(recipe.model_path(root))
    named = recipe.model.path if recipe.model.path is not None else recipe.model.hub_id
    if not model_dir.is_dir():
        problems.append(MoeprepError(f"model {named!r} is not here (not a local directory under {root}, not in the "
                                     f"Hugging Face hub cache); {recipe.missing_model_hint()}"))
    elif not (model_dir / "config.json").is_file() or not any(model_dir.glob("*.safetensors")):
        problems.append(MoeprepError(f"model directory {model_dir} holds no config.json and *.safetensors "
                                     f"checkpoint; {recipe.missing_model_hint()}"))
    try:
        _output(recipe, root, output, overwrite).check_replaceable()
    except MoeprepError as e:
        problems.append(e)
    if recipe.executor.kind == "ray":
        try:
            import_ray()
        except MoeprepError as e:
            problems.append(e)
    if recipe.plan.tune.enabled and recipe.plan.tune.storage is not None and "://" in recipe.plan.tune.storage:
        from prep.stages.tune_policy import probe_storage

        try:  # a database is opened and closed: its driver, its server and its credentials answer now
            probe_storage(recipe.plan.tune.storage)
        except MoeprepError as e:
            problems.append(e)
    for stage in STAGES:
        if stage.files is None or (stage.enabled is not None and not stage.enabled(recipe)):
            continue
        for name in stage.files(recipe):
            if not (root / name).is_file():
                problems.append(MoeprepError(
                    f"{name}, which the recipe names for stage {stage.name}, is not there; write or fetch it first (a "
                    "device profile: `moeprep profile-device`; recorded routing or sensitivity: ../shared/data/traces)"))
    return problems


def _run_stages(recipe: Recipe, root: Path, model_dir: Path, work_root: Path, artifact: ArtifactOutput,
                until: str | None, force: str | None, sources: _Sources, executor=None) -> dict:
    artifact.tidy()
    artifact.check_replaceable()
    store = StageStore(work_root / "stages")
    keys: dict[str, str] = {}
    summary: dict = {}
    wrote_artifact = False
    forced = False
    for stage in tqdm(STAGES, desc="prepare", unit="stage", leave=False):
        enabled = stage.enabled is None or stage.enabled(recipe)
        if enabled:
            config, fingerprints = sources.key_inputs(stage)
            key = stage_key(stage.name, stage.version, config, {r: keys[r] for r in stage.reads}, fingerprints)
        else:  # a switched-off stage's key is a constant, so what it would have read keys nothing downstream
            key = stage_key(stage.name, stage.version, {"switched_off": True}, {}, {})
        keys[stage.name] = key
        forced = forced or stage.name == force
        inputs = StageInputs(stage, sources, store, keys, artifact, executor)
        if not enabled:
            summary[stage.name] = {"key": key[:16], "seconds": 0.0, "cached": False, "skipped": True}
        else:
            if forced:
                store.discard(stage.name, key)
            started = time.perf_counter()
            cached = store.is_complete(stage.name, key)
            if cached and (problem := store.damage(stage.name, key, stage.result)) is not None:
                notice(f"stage {stage.name}: the cached result in {store.final_dir(stage.name, key)} is not reused: "
                       f"{problem}; computing it again")
                store.discard(stage.name, key)
                cached = False
            cached = cached and (stage.output_ok is None or stage.output_ok(inputs, store.load(stage, key)))
            if not cached:
                inputs.work = store.work_dir(stage.name, key)
                try:
                    with fixed_threads():  # one result for one key, whatever the machine's cores
                        result = stage.run(inputs)
                except Exception:  # a failure, not an interruption: a kill or Ctrl-C keeps the units to resume from
                    shutil.rmtree(inputs.work, ignore_errors=True)
                    raise
                store.commit(stage.name, key, inputs.work, result, version=stage.version, config=config)
                give_back_memory()  # what the stage freed, before the next one allocates (a streamed prepare's peak)
            summary[stage.name] = {"key": key[:16], "seconds": round(time.perf_counter() - started, 3),
                                   "cached": cached}
            if inputs.unit_stats is not None:  # a stage that ran work units: how many ran and how many were reused
                summary[stage.name]["units"] = inputs.unit_stats.to_json()
            wrote_artifact = wrote_artifact or "artifact" in stage.needs
        if stage.name == until:
            break
    summary["artifact"] = str(artifact.path) if wrote_artifact else None
    return summary
