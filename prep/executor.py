"""Where a stage's work units run: in this process (``local``, the default) or on a Ray cluster (``ray``).

A stage that splits its work declares ``Unit``s (``prep/stages/quantize.py``: one per precision and MoE layer;
``prep/stages/sensitivity.py``: one per MoE layer of the sweep) and hands them to ``StageInputs.map_units``;
the executor runs each unit's function and the stage merges the files they wrote. Both executors run the same
function through ``run_unit``, so there is one code path; they differ only in where it runs and where its
model comes from (the pipeline's own model in-process; a worker loads it once from ``UnitPaths`` on a Ray
node, so no weight is pickled through the driver).

What keeps a cluster run's output the same bytes as a local run's and makes it resumable:

- a unit writes one file in the stage's work directory, through a temporary in its ``.unit-tmp/`` folder renamed
  into place, so a file there is complete and a worker killed mid-write leaves its partial file only where no
  merge and no seal looks (the folder is removed after each map and before a stage directory is sealed); a unit
  whose file exists, sealed as this unit's (stage, key, unit name, file name) with finite values, is not run
  again (a killed driver resumes with them);
- before a unit runs, torch's, numpy's and Python's generators are seeded from the unit's identity
  (``unit_seed``), never from the order workers pick units up;
- a unit computes with ``UNIT_THREADS`` torch thread(s) wherever it runs: a float reduction's result depends on
  how many threads split it, so a unit run on a 2-core laptop and on a 64-core node gives the same bytes only
  at one fixed thread count (parallelism comes from running units side by side). A stage that runs in the
  driver computes at the same count (``fixed_threads``; the gating stage's Fisher sensitivities differed in
  the eighth digit between a local and a Ray run before);
- a unit that raises (or, on Ray, whose worker dies) is retried up to ``max_retries`` times; a
  ``MoeprepError`` (a user's mistake, the same on every try) is not retried.

How work runs is not what is computed: the recipe's ``executor`` section is in no stage key and no record.
Ray is an optional extra, imported only when asked for (``pip install -e '.[ray]'``).
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from prep.errors import MoeprepError
from prep.integrity import (
    drop_temporaries,
    drop_unit,
    notice,
    seal_unit,
    unit_binding,
    unit_damage,
    unit_temporary,
)

EXECUTOR_KINDS = ("local", "ray")
# auto, local, ray://host:port, host:port (a host name or IPv4 address, or [IPv6])
_ADDRESS = re.compile(r"auto|local|(ray://)?([A-Za-z0-9][A-Za-z0-9.-]{0,252}|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}")
UNIT_THREADS = 1  # torch threads per unit, everywhere (see the module docstring)
RAY_EXTRA = "pip install -e '.[ray]'"


@dataclass(frozen=True)
class ExecutorSection:
    """Where stage units run. ``kind``: ``local`` (this process) or ``ray``. ``address`` (ray only): ``auto``
    (the cluster this node belongs to, e.g. after ``ray start --head``, or ``RAY_ADDRESS``), ``local`` (a
    fresh Ray instance on this machine, for trying it), or a cluster address (``ray://head:10001``,
    ``head:6379``). ``num_cpus_per_task``: the CPUs Ray reserves per unit (a unit computes with one torch
    thread wherever it runs; reserve more to run fewer units per node, e.g. when each needs much memory). ``max_retries``: tries after the first for a unit that fails or whose worker is lost."""

    kind: str = "local"
    address: str | None = None  # None: auto (ray only)
    num_cpus_per_task: float = 1.0
    max_retries: int = 2

    def __post_init__(self) -> None:
        if self.kind not in EXECUTOR_KINDS:
            raise MoeprepError(f"executor.kind {self.kind!r} unknown; use one of {EXECUTOR_KINDS}")
        if not 0 < self.num_cpus_per_task <= 1024:
            raise MoeprepError(f"executor.num_cpus_per_task must be in (0, 1024], got {self.num_cpus_per_task}")
        if not 0 <= self.max_retries <= 100:
            raise MoeprepError(f"executor.max_retries must be from 0 to 100, got {self.max_retries}")
        if self.address is None:
            return
        if self.kind != "ray":
            raise MoeprepError(f"executor.address {self.address!r} is for the ray executor, and this run's executor "
                               "is local; drop the address (--ray-address), or run on Ray (--executor ray)")
        if not (isinstance(self.address, str) and _ADDRESS.fullmatch(self.address)):
            raise MoeprepError(f"executor.address {self.address!r} is not a Ray address; use auto, local, "
                               "ray://host:port or host:port")

    @property
    def ray_address(self) -> str:
        """The cluster to join: the address, or ``auto``."""
        return self.address or "auto"


@dataclass(frozen=True)
class Unit:
    """One piece of a stage's work: ``fn(context, out, **args)`` writes the file ``out``, which the executor then
    renames to ``work / output``. ``fn`` is a module-level function (a Ray worker imports it by name); ``args``
    are small plain values (indices, paths), never tensors: large inputs are read from paths."""

    name: str  # unique within the stage; the unit's seed derives from it
    output: str  # the file it writes, relative to the stage's work directory
    fn: Callable
    args: dict = field(default_factory=dict)


@dataclass(frozen=True)
class UnitPaths:
    """What a worker reads its model from: a path every node sees, and how the pipeline was asked to load it."""

    model_dir: str
    device: str = "cpu"
    expert_memory: int | str | None = "auto"


_MODELS: dict = {}  # one streamed model per worker process, keyed by its UnitPaths


class UnitContext:
    """What a unit may use. ``model``/``adapter``: the pipeline's own model in-process, else the model loaded
    once per worker process from ``paths`` (``prep.streaming.load_streamed``). ``cache``: a per-process
    dict a unit may keep derived state in between units (e.g. the sweep's base pass); it must not change
    a unit's output, only its cost."""

    caches: dict = {}

    def __init__(self, paths: UnitPaths, load_model: Callable | None = None) -> None:
        self.paths, self._load_model = paths, load_model

    @property
    def model(self):
        if self._load_model is not None:
            return self._load_model()
        if self.paths not in _MODELS:
            from prep.streaming import load_streamed

            _MODELS.clear()  # a worker holds one model at a time
            _MODELS[self.paths] = load_streamed(self.paths.model_dir, device=self.paths.device,
                                                resident_bytes=self.paths.expert_memory)
        return _MODELS[self.paths]

    @property
    def adapter(self):
        from prep.adapters import get_adapter

        return get_adapter(self.model)

    def cache(self, key: str) -> dict:
        """A dict kept for this process under ``key`` (only the latest key is kept)."""
        if key not in UnitContext.caches:
            UnitContext.caches.clear()
            UnitContext.caches[key] = {}
        return UnitContext.caches[key]


def unit_seed(stage: str, name: str) -> int:
    """The seed of unit ``name`` of ``stage``: from its identity, so it is the same whichever worker runs it."""
    return int.from_bytes(hashlib.sha256(f"{stage}/{name}".encode()).digest()[:8], "little") & (2**63 - 1)


def _seed_all(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def run_unit(stage: str, unit: Unit, work: str | Path, context: UnitContext, key: str | None = None) -> bool:
    """Run ``unit`` of ``stage`` (key ``key``) unless its sealed file exists (``prep.integrity``); write its file
    atomically, sealed as this unit's. The temporary lives in the work directory's ``UNIT_TEMPORARIES`` folder, which
    no stage merges and no seal covers, so a worker killed mid-write leaves nothing a stage could take.
    Returns whether it ran."""
    out = Path(work) / unit.output
    if reusable(stage, unit, Path(work), key):  # finished earlier (before a driver was killed, or by a lost worker's try)
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = unit_temporary(work, unit.output)
    try:
        with fixed_threads():
            _seed_all(unit_seed(stage, unit.name))
            unit.fn(context, tmp, **unit.args)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        seal_unit(tmp, out, unit_binding(stage, unit.name, unit.output, key))
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
    return True


@contextmanager
def fixed_threads() -> Iterator[None]:
    """Compute with ``UNIT_THREADS`` torch threads inside the block (a unit, or a stage run in the driver), so a
    result is the same bytes on any machine and under either executor; torch's own count is restored after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(UNIT_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def reusable(stage: str, unit: Unit, work: Path, key: str | None = None) -> bool:
    """Whether ``unit``'s file in ``work`` is there and is what this unit (of ``stage``, key ``key``) wrote, with
    finite values; a damaged one (or one another unit wrote, or a link) is removed, with a notice, so the unit
    runs again."""
    out = work / unit.output
    if not (out.is_file() or out.is_symlink()):
        return False
    problem = unit_damage(out, unit_binding(stage, unit.name, unit.output, key))
    if problem is None:
        return True
    notice(f"stage {stage}: unit {unit.name}'s file in {work} is not reused: {problem}; running it again")
    drop_unit(out)
    return False


@dataclass
class MapStats:
    """What one map did: units run, units reused from the work directory, tries repeated after a failure."""

    ran: int = 0
    reused: int = 0
    retried: int = 0
    seconds: float = 0.0

    def __add__(self, other: MapStats) -> MapStats:
        return MapStats(self.ran + other.ran, self.reused + other.reused, self.retried + other.retried,
                        self.seconds + other.seconds)

    def to_json(self) -> dict:
        return {"ran": self.ran, "reused": self.reused, "retried": self.retried, "seconds": round(self.seconds, 3)}


class LocalExecutor:
    """Runs units one after another in this process, with the pipeline's loaded model."""

    kind = "local"

    def __init__(self, cfg: ExecutorSection | None = None) -> None:
        self.cfg = cfg or ExecutorSection()

    def map(self, stage: str, units: list[Unit], work: Path, paths: UnitPaths, load_model: Callable | None = None,
            desc: str | None = None, key: str | None = None) -> MapStats:
        work = Path(work)
        drop_temporaries(work)
        stats, started = MapStats(), time.perf_counter()
        context = UnitContext(paths, load_model)
        todo = [u for u in units if not reusable(stage, u, work, key)]
        stats.reused = len(units) - len(todo)
        with tqdm(total=len(units), initial=stats.reused, desc=desc or stage, unit="unit", leave=False) as bar:
            for unit in todo:
                for attempt in range(self.cfg.max_retries + 1):
                    try:
                        run_unit(stage, unit, work, context, key)
                        break
                    except MoeprepError:
                        raise
                    except Exception:
                        if attempt == self.cfg.max_retries:
                            raise
                        stats.retried += 1
                stats.ran += 1
                bar.update(1)
        drop_temporaries(work)  # a lost worker's half-written file, before the stage merges the work directory
        stats.seconds = time.perf_counter() - started
        return stats

    def close(self) -> None:
        pass


def import_ray():
    """The ``ray`` module, or one clear error naming the extra to install."""
    try:
        import ray
    except ImportError:
        raise MoeprepError(f"executor kind 'ray' (--executor ray) needs Ray, which is not installed here; install "
                           f"the extra with `{RAY_EXTRA}` (on the driver and every node of the cluster), or use "
                           "--executor local") from None
    return ray


def _ray_unit(stage: str, unit: Unit, work: str, paths: UnitPaths, key: str | None = None):
    """A Ray task: one unit on a worker. A user's error comes back as a value, so Ray does not retry it."""
    try:
        return ("ran" if run_unit(stage, unit, work, UnitContext(paths), key) else "reused", None)
    except MoeprepError as e:
        return ("error", str(e))


class RayExecutor:
    """Runs units as Ray tasks on the cluster at ``cfg.address``; connects on the first map (a fully cached run
    never does). Workers must see the same paths as the driver (the model and the stage cache)."""

    kind = "ray"

    def __init__(self, cfg: ExecutorSection) -> None:
        self.cfg = cfg
        self.ray = import_ray()
        self._started = False
        self._remote = None

    def _connect(self):
        ray = self.ray
        if not ray.is_initialized():
            address = None if self.cfg.ray_address == "local" else self.cfg.ray_address
            try:
                ray.init(address=address, include_dashboard=False, log_to_driver=False)
            except ConnectionError as e:
                raise MoeprepError(f"no Ray cluster at executor.address {self.cfg.ray_address!r} ({e}); start one "
                                   "(`ray start --head` on this machine, `ray up cluster.yaml`, or KubeRay) or "
                                   "pass --ray-address local for a Ray instance on this machine only") from None
            self._started = True
        if self._remote is None:
            self._remote = ray.remote(_ray_unit).options(
                num_cpus=self.cfg.num_cpus_per_task, max_retries=self.cfg.max_retries, retry_exceptions=True)
        return self._remote

    def map(self, stage: str, units: list[Unit], work: Path, paths: UnitPaths, load_model: Callable | None = None,
            desc: str | None = None, key: str | None = None) -> MapStats:
        work = Path(work).resolve()
        drop_temporaries(work)
        stats, started = MapStats(), time.perf_counter()
        todo = [u for u in units if not reusable(stage, u, work, key)]
        stats.reused = len(units) - len(todo)
        if todo:
            remote = self._connect()
            pending = {remote.remote(stage, u, str(work), paths, key): u for u in todo}
            with tqdm(total=len(units), initial=stats.reused, desc=desc or stage, unit="unit", leave=False) as bar:
                try:
                    while pending:
                        done, _ = self.ray.wait(list(pending), num_returns=1)
                        for ref in done:
                            unit = pending.pop(ref)
                            try:
                                state, error = self.ray.get(ref)
                            except self.ray.exceptions.RayError as e:
                                raise MoeprepError(f"unit {unit.name} of stage {stage} failed on Ray after "
                                                   f"{self.cfg.max_retries + 1} tries: {e}") from None
                            if state == "error":
                                raise MoeprepError(error)
                            stats.ran += state == "ran"
                            stats.reused += state == "reused"
                            bar.update(1)
                finally:
                    for ref in pending:  # queued units; running ones finish and their files are reused
                        self.ray.cancel(ref)
        drop_temporaries(work)  # a lost worker's half-written file, before the stage merges the work directory
        stats.seconds = time.perf_counter() - started
        return stats

    def close(self) -> None:
        if self._started:
            self.ray.shutdown()
            self._started = False


def executor_overrides(kind: str | None, address: str | None) -> tuple[str, ...]:
    """The recipe overrides ``--executor KIND --ray-address ADDR`` stand for (a flag left out keeps the recipe's)."""
    return tuple(f"executor.{key}={value}" for key, value in (("kind", kind), ("address", address))
                 if value is not None)


def make_executor(cfg: ExecutorSection):
    """The executor ``cfg`` asks for (Ray imported only here, and only for ``kind: ray``)."""
    return RayExecutor(cfg) if cfg.kind == "ray" else LocalExecutor(cfg)
