"""What ``load`` is asked for: its keyword arguments as one frozen, validated ``LoadOptions``.

Every option that can be checked without the artifact is checked here, once, when the options are made, and a bad
one is a ``LoaderError`` naming the value and the fix; what needs the artifact or the device's link (the plan's read
depth for ``workers="auto"``, the budget against the model, the neuron knobs against the stores,
``cpu_misses="always"`` against the link) is resolved by ``loader.runtime`` as it builds the model. The thread and
worker counts live here too, so a module that only needs them (the planner, the device profile) does not import the
runtime.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from loader.dense import check_dense
from loader.errors import LoaderError
from loader.forms import check_expert_dtype
from loader.plan import Plan
from loader.policies import policy_factory
from loader.vocab import CPU_MISSES

DEFAULT_WORKERS = 2  # reader threads where neither the caller nor the plan says (two reads in flight)
MAX_WORKERS = 64  # reader threads: each holds a read buffer, and a disk gains nothing past a few dozen in flight
STORE_MODES = ("disk", "host")  # read each miss from the file, or hold the whole store in host RAM


def compute_threads(device: torch.device, workers: int) -> int | None:
    """torch's intra-op threads for decode steps on ``device``: on a CPU, the cores the ``workers`` reader threads
    leave free, at least one. A decode step's products are small, and torch splits each over its OpenMP team,
    which waits at every product's end for its slowest thread: when a reader thread (or any other process) wakes
    on one of the team's cores, the whole product waits for the preempted thread. On this project's 2-core
    machine one expert's products of the reference model took 1.0-1.6x as long beside a reader thread with one
    torch thread, 3-14x with two (loader/README.md, "Threads"), and 2 threads decoded
    mixtral-shape at 21.5 tok/s with every expert cached against 25.5 with 1. None on CUDA (the products run on
    the GPU)."""
    if device.type != "cpu":
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - workers)


def _check_workers(workers) -> None:
    if workers != "auto" and (isinstance(workers, bool) or not isinstance(workers, int)
                              or not 1 <= workers <= MAX_WORKERS):
        raise LoaderError(f"workers {workers!r} must be 'auto' or a number of reader threads from 1 to {MAX_WORKERS}")


def reader_workers(workers: int | str, plan: Plan) -> int:
    """The reader threads of a load: ``workers`` itself, or for "auto" the plan's ``read_depth`` (the reads in
    flight that measured best on the planned device), else ``DEFAULT_WORKERS``."""
    _check_workers(workers)
    return (plan.read_depth or DEFAULT_WORKERS) if workers == "auto" else workers


def max_threads() -> int:
    """The most torch threads a load may ask for: four per core of this machine (more only slows it down, and a
    huge count makes torch fail, or crash, while it starts them)."""
    return 4 * (os.cpu_count() or 1)


def parse_device(device: str) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N'; anything else (or CUDA on a machine without one) is a LoaderError."""
    text = str(device).strip().lower()
    if text != "cpu" and not (text == "cuda" or (text.startswith("cuda:") and text[5:].isdigit())):
        raise LoaderError(f"device {device!r} is not supported; use 'cpu', 'cuda' or 'cuda:N'")
    if text.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LoaderError(f"device {device!r} was asked for but torch sees no CUDA GPU; use device='cpu'")
        if ":" in text and int(text[5:]) >= torch.cuda.device_count():
            raise LoaderError(f"device {device!r}: torch sees only {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(text)


@dataclass(frozen=True)
class LoadOptions:
    """``load``'s keyword arguments (``loader.runtime.load`` documents each), checked when made.

    The policy and predictor objects are taken as given (``loader.routing``, ``loader.predict``,
    ``loader.neuron.NeuronConfig``); ``None`` means "as the plan says" for each of them.
    """

    device: str = "cpu"
    memory_budget: object = None  # bytes, a size or share string, "unlimited", "auto"; None: the plan's
    store: str = "disk"  # ``STORE_MODES``
    policy: str | None = None  # an eviction policy name overriding the plan's
    workers: int | str = "auto"
    routing: object = None  # a RoutingPolicy overriding the plan's
    predictors: list | None = None  # Predictor objects or names; [] turns them off
    miss_policy: object = None  # a MissPolicy overriding the plan's
    plan: Plan | None = None  # a whole plan instead of the artifact's plan.json
    neuron: object = None  # True, False, a NeuronConfig, or None
    expert_dtype: str = "auto"
    cpu_misses: str = "auto"  # ``loader.vocab.CPU_MISSES``
    threads: int | str | None = "auto"
    replay: object = None  # a RoutingPolicy whose recorded decisions come before the routing policy
    ignore_device_file: bool = False  # run the plan as prepared, not as ``moeload tune`` left it (``tuning.json``)
    dense: str | None = None  # the dense weights' held form (``loader.vocab.DENSE_FORMS``); None: the plan's

    def __post_init__(self) -> None:
        self._check_device()
        _check_workers(self.workers)
        threads = self.threads
        if threads not in (None, "auto") and (isinstance(threads, bool) or not isinstance(threads, int)
                                              or not 1 <= threads <= max_threads()):
            raise LoaderError(f"threads {threads!r} must be None, 'auto' or a number of torch threads from 1 to "
                              f"{max_threads()} (four per core of this machine)")
        if self.store not in STORE_MODES:
            raise LoaderError(f"store {self.store!r} unknown; use 'disk' (read each miss from the file) or 'host' "
                              "(hold the stores in host RAM)")
        if self.policy is not None:
            policy_factory(self.policy, {})  # an unknown eviction policy names the known ones
        check_expert_dtype(self.expert_dtype)
        check_dense(self.dense)
        if isinstance(self.predictors, str):
            raise LoaderError(f"predictors must be a list of names or Predictor objects (for example "
                              f"[{self.predictors!r}]), got the string {self.predictors!r}")

    def _check_device(self) -> None:
        """The device exists, and ``cpu_misses`` is known (whether it fits the device's link is
        ``check_cpu_misses``'s, given the link)."""
        parse_device(self.device)
        if self.cpu_misses not in CPU_MISSES:
            raise LoaderError(f"cpu_misses {self.cpu_misses!r} unknown; use one of {', '.join(CPU_MISSES)}")

    def check_cpu_misses(self, link) -> None:
        """``cpu_misses="always"`` needs a GPU (``link``, ``loader.transfer.Link``, is accelerated) and the host store."""
        if self.cpu_misses == "always" and (not link.accelerated or self.store != "host"):
            raise LoaderError("cpu_misses='always' computes GPU misses on the CPU from a store held in host RAM; it "
                              "needs device='cuda' and store='host' (or leave it at 'auto')")

    @property
    def torch_device(self) -> torch.device:
        """The checked device as torch names it."""
        return torch.device(str(self.device).strip().lower())
