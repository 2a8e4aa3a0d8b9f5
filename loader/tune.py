"""``moeload tune``: each technique of the plan measured on this device, kept only where it pays here.

The cost model chooses techniques at preparation; they change a token's time by a few percent, and the model is
within +-20% of the loader, so a choice made from it keeps what loses. ``tune`` measures instead, with the loader
itself:

- **The workload.** The artifact's routing sample (``routing.safetensors``; ``--routing`` for the device's own) is
  replayed through the real loader, not the model: for each token and MoE layer, the plan's routing policy decides on
  the recorded router output, the predictors see the recorded router input, and the engine serves and computes the
  experts (reads, cache, forms, prefetches) exactly as in a decode step (``replay_tokens``). Attention and the dense
  layers take the same time whatever the plan, so they are left out: ratios are of the expert steps, the part the
  techniques change.
- **The variants.** The plan with every technique (``all``), with none (``plain``), and with each one switched off
  (``-name``): each variant is one run in a fresh process (``python -m loader.tune SPEC``), the variants interleaved
  round by round (the order rotates), so drift on the machine falls on all of them.
- **The figures.** A technique's ratio is the time of ``-name`` over the time of ``all`` on the same tokens of the same
  round (paired per token); its 95% interval comes from a two-stage bootstrap (rounds, then blocks of ``BLOCK`` tokens
  within them); a single round decides nothing (``MIN_DECIDING_ROUNDS``).
  A technique **pays** where the interval lies above 1 (kept), **loses** where it lies below (switched off), and is
  **within noise** where it straddles 1 (switched off: the cheaper choice), unless the plan without it does not fit
  the budget (**needed by the budget**: kept).
- **The check.** The plan with what was kept is measured against ``plain`` in two more rounds; if it is slower
  beyond noise, every technique is switched off.

The decisions, with the figures behind each and the machine, go into the artifact's device file (``loader/tuning.py``),
which ``load`` uses from then on. Everything here that touches time takes a clock and a runner, so the tests drive the
decisions with a fake engine clock.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loader.errors import ArtifactError, BudgetError, LoaderError, MoeError
from loader.tuning import TUNING_FILE, TunedPoint, Tuning, read_tuning, techniques, without, write_tuning

DEFAULT_TOKENS = "auto"  # timed tokens per run: "auto" sizes them so that MIN_ROUNDS rounds and the check fit the limit
MIN_TOKENS, MAX_TOKENS = 8, 64  # what "auto" chooses between
WARMUP_TOKENS = 4  # tokens replayed untimed first in each run (threads, allocator, first reads), then started over
MIN_ROUNDS, MAX_ROUNDS = 3, 6  # phase 1: at least 3 rounds where time allows, more while a decision is within noise
CHECK_ROUNDS = 2  # phase 2: the tuned plan against plain
BLOCK = 4  # tokens per bootstrap block (a token's time depends on the cache its neighbours left)
RESAMPLES = 2000
ALL, PLAIN, TUNED = "all", "plain", "tuned"


class TuneError(MoeError):
    """``moeload tune`` cannot measure as asked; the message says what to change."""


class RunFailed(Exception):
    """One variant's run failed; ``budget`` when the variant does not fit the memory budget."""

    def __init__(self, message: str, budget: bool = False) -> None:
        super().__init__(message)
        self.budget = budget


class RunCutShort(Exception):
    """A run stopped at the time limit: its round (or the check) ends there, on what was measured before it."""


@dataclass(frozen=True)
class Variant:
    name: str
    off: tuple[str, ...]


@dataclass
class Run:
    """One variant's run: seconds per timed token, and the loader's figures over them."""

    variant: str
    round: int
    seconds: list[float]
    figures: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------- statistics


def paired_ratio(off_runs: list[list[float]], on_runs: list[list[float]], seed: int = 0) -> tuple[float, float, float]:
    """(ratio, low, high): the time of the ``off`` runs over the ``on`` runs (round r of one paired with round r of the
    other, token by token), and its 95% interval by a two-stage bootstrap: rounds drawn with replacement (two runs
    in fresh processes differ by more than their tokens do), then blocks of ``BLOCK`` tokens within each round drawn."""
    rounds = []
    for off, on in zip(off_runs, on_runs, strict=True):
        n = min(len(off), len(on))
        rounds.append([(sum(off[s:min(s + BLOCK, n)]), sum(on[s:min(s + BLOCK, n)])) for s in range(0, n, BLOCK)])
    rounds = [r for r in rounds if r]
    if not rounds:
        raise TuneError("no paired tokens to compare")
    ratio = sum(u[0] for r in rounds for u in r) / sum(u[1] for r in rounds for u in r)
    rng = random.Random(seed)
    draws = []
    for _ in range(RESAMPLES):
        off = on = 0.0
        for _ in rounds:
            units = rounds[rng.randrange(len(rounds))]
            for _ in units:
                a, b = units[rng.randrange(len(units))]
                off, on = off + a, on + b
        draws.append(off / max(on, 1e-30))
    draws.sort()
    return ratio, draws[int(0.025 * RESAMPLES)], draws[int(0.975 * RESAMPLES) - 1]


MIN_DECIDING_ROUNDS = 2  # one round cannot tell a technique from the difference between two processes


def verdict(low: float, high: float, rounds: int = MIN_DECIDING_ROUNDS) -> str:
    """A technique's verdict from the interval of (time without it) / (time with it) over ``rounds`` rounds."""
    if rounds < MIN_DECIDING_ROUNDS:
        return "within noise"
    if low > 1:
        return "pays"
    if high < 1:
        return "loses"
    return "within noise"


# ------------------------------------------------------------------------------------------- the tuning


class _Rounds:
    """Phase 1: every variant (all, plain, each technique off) once per round, the order rotating, as time allows."""

    def __init__(self, names: list[str], run: Callable[[Variant, int], Run], echo) -> None:
        self.names, self.run, self.echo = names, run, echo
        self.variants = [Variant(ALL, ()), Variant(PLAIN, tuple(names))] + [Variant(f"-{n}", (n,)) for n in names]
        if len(names) == 1:  # -name is plain
            self.variants = self.variants[:2]
        self.by_variant: dict[str, list[Run]] = {v.name: [] for v in self.variants}
        self.failed: dict[str, RunFailed] = {}
        self.runs: list[Run] = []
        self.rounds = 0
        self.seconds = 0.0  # phase 1's wall time

    def off_variant(self, name: str) -> str:
        return PLAIN if len(self.names) == 1 else f"-{name}"

    def decisions(self) -> dict:
        """Each technique's ratio, interval and verdict over the complete rounds."""
        out = {}
        live = [v.name for v in self.variants if v.name not in self.failed]
        complete = [i for i in range(self.rounds) if all(len(self.by_variant[v]) > i for v in live)]
        for n in self.names:
            off = self.off_variant(n)
            if off in self.failed:
                out[n] = {"verdict": "needed by the budget", "why": str(self.failed[off])}
                continue
            ratio, low, high = paired_ratio([self.by_variant[off][i].seconds for i in complete],
                                            [self.by_variant[ALL][i].seconds for i in complete])
            out[n] = {"verdict": verdict(low, high, len(complete)), "ratio": ratio, "low": low, "high": high,
                      "rounds": len(complete)}
            if len(complete) < MIN_DECIDING_ROUNDS:
                out[n]["why"] = "one round only: too few to tell the technique from the runs' own difference"
        return out

    def play(self, deadline: float, clock) -> bool:
        """One round; False where the deadline cut it short (it is then not used)."""
        k = self.rounds % len(self.variants)
        for v in self.variants[k:] + self.variants[:k]:
            if v.name in self.failed:
                continue
            if clock() > deadline and self.rounds > 0:
                return False
            try:
                result = self.run(v, self.rounds)
            except RunCutShort:
                return False
            except RunFailed as e:
                if v.name == ALL or not e.budget:
                    raise TuneError(f"the {v.name} run failed: {e}") from None
                self.failed[v.name] = e
                self.echo(f"  {v.name}: does not fit the budget ({e})")
                continue
            self.by_variant[v.name].append(result)
            self.runs.append(result)
            self.echo(f"  round {self.rounds + 1} {v.name:24s} {_speed([result]):8.2f} tok/s")
        self.rounds += 1
        return True

    def measure(self, deadline: float, clock, min_rounds: int, max_rounds: int, check_rounds: int) -> None:
        """Rounds until ``max_rounds``, the deadline (keeping time for the check), or, past ``min_rounds``, until no
        verdict is within noise."""
        started = clock()
        try:
            self._rounds(started, deadline, clock, min_rounds, max_rounds, check_rounds)
        finally:
            self.seconds = clock() - started
        if self.rounds == 0:
            raise TuneError("the time limit ended before one round of every variant; allow more minutes or fewer "
                            "tokens")

    def _rounds(self, started, deadline, clock, min_rounds, max_rounds, check_rounds) -> None:
        while self.rounds < max_rounds:
            if self.rounds:
                now, per_round = clock(), (clock() - started) / self.rounds
                if now + per_round > deadline:
                    break
                if self.rounds >= min_rounds and (
                        all(d["verdict"] != "within noise" for d in self.decisions().values())
                        or now + per_round * (1 + check_rounds * 2 / len(self.variants)) > deadline):
                    break
            if not self.play(deadline, clock):
                break


def tune_decisions(names: list[str], run: Callable[[Variant, int], Run], deadline: float, clock=time.monotonic,
                   echo=print, min_rounds: int = MIN_ROUNDS, max_rounds: int = MAX_ROUNDS,
                   check_rounds: int = CHECK_ROUNDS) -> tuple[list[str], list[str], dict, dict, list[Run]]:
    """The decisions for the techniques ``names``: (kept, off, decisions, measured, runs). ``run(variant, round)``
    measures one variant (raising ``RunFailed``); ``deadline`` is on ``clock``. Raises TuneError where not one round
    of every variant fits before the deadline."""
    started = clock()
    phase = _Rounds(names, run, echo)
    phase.measure(deadline, clock, min_rounds, max_rounds, check_rounds)
    rounds, by_variant, runs = phase.rounds, phase.by_variant, phase.runs
    decisions = phase.decisions()
    kept = [n for n in names if decisions[n]["verdict"] in ("pays", "needed by the budget")]
    off = [n for n in names if n not in kept]
    measured = {"rounds": rounds, "variants": [v.name for v in phase.variants],
                "tokens_per_s": {name: _speed(rs) for name, rs in by_variant.items() if rs}}
    if PLAIN in phase.failed:  # the plan needs a technique to fit the budget: nothing to check against
        measured["check"] = {"against": PLAIN, "verdict": f"not run: {PLAIN} does not fit the budget"}
        measured["seconds"] = clock() - started
        return kept, off, decisions, measured, runs
    plain_vs_all = paired_ratio([r.seconds for r in by_variant[PLAIN][:rounds]],
                                [r.seconds for r in by_variant[ALL][:rounds]])
    measured["all_vs_plain"] = {"ratio": plain_vs_all[0], "low": plain_vs_all[1], "high": plain_vs_all[2]}
    if kept and off:  # the combination kept was not measured as such: check it against plain
        check = _check(names, kept, run, deadline, clock, echo, check_rounds, rounds, phase.seconds / max(1, len(runs)))
        runs += check.pop("runs")
        measured["check"] = check
        if check.get("verdict") == "loses":
            for n in kept:
                decisions[n]["verdict_before_check"] = decisions[n]["verdict"]
                decisions[n]["verdict"] = "off: the kept set lost to plain"
            off, kept = names[:], []
    elif kept:  # every technique kept: the check is all against plain
        measured["check"] = {"against": PLAIN, **measured["all_vs_plain"],
                             "verdict": verdict(*plain_vs_all[1:], rounds)}
    measured["seconds"] = clock() - started
    return kept, off, decisions, measured, runs


def _check(names, kept, run, deadline, clock, echo, check_rounds, first_round, per_run) -> dict:
    """The plan with ``kept`` against plain, ``check_rounds`` rounds as time allows (a pair is started only where it
    is expected to end before the deadline: ``per_run`` seconds a run, from phase 1)."""
    tuned = Variant(TUNED, tuple(n for n in names if n not in kept))
    plain = Variant(PLAIN, tuple(names))
    pairs: list[tuple[Run, Run]] = []
    runs: list[Run] = []
    started = clock()
    for i in range(check_rounds):
        pair_seconds = (clock() - started) / i if i else per_run * 2
        if clock() + pair_seconds > deadline:
            break
        order = (tuned, plain) if i % 2 == 0 else (plain, tuned)
        got = {}
        try:
            for v in order:
                got[v.name] = run(v, first_round + i)
                runs.append(got[v.name])
                echo(f"  check {i + 1} {v.name:24s} {_speed([got[v.name]]):8.2f} tok/s")
        except RunCutShort:
            break
        pairs.append((got[PLAIN], got[TUNED]))
    if not pairs:
        return {"against": PLAIN, "verdict": "not run: no time left", "runs": runs}
    ratio, low, high = paired_ratio([p.seconds for p, _ in pairs], [t.seconds for _, t in pairs])
    return {"against": PLAIN, "ratio": ratio, "low": low, "high": high,
            "verdict": verdict(low, high, len(pairs) + 1),  # the check adds to phase 1's rounds, which chose the set
            "rounds": len(pairs), "runs": runs}


def _speed(runs: list[Run]) -> float:
    tokens = sum(len(r.seconds) for r in runs)
    return tokens / max(sum(sum(r.seconds) for r in runs), 1e-30)


def tune(artifact, memory_budget=None, minutes: float = 5.0, device: str = "cpu", store: str = "disk",
         routing=None, tokens: int | str = DEFAULT_TOKENS, echo=print, runner=None, clock=time.monotonic,
         write: bool = True, rounds: tuple[int, int] = (MIN_ROUNDS, MAX_ROUNDS), in_process: bool = False) -> TunedPoint:
    """Measure each technique of ``artifact``'s plan on this device at ``memory_budget`` within ``minutes`` and write
    the decisions into its device file (``write``); returns them. ``runner(spec) -> dict``: one variant's run (default:
    a fresh process, ``SubprocessRunner``; ``in_process``: in this one, for smoke runs). ``rounds``: the least and most
    rounds of phase 1."""
    from loader.artifact import open_artifact
    from loader.budget import budget_bytes
    from loader.memory import auto_budget, is_auto

    if not minutes > 0:
        raise TuneError(f"--minutes {minutes}: give a positive time limit")
    deadline = clock() + minutes * 60
    manifest = _open_for_tune(artifact, echo)
    plan = manifest.plan
    names = techniques(plan)
    requested = memory_budget if memory_budget is not None else plan.default_budget
    if is_auto(memory_budget):
        chosen = auto_budget(device)
        echo(chosen.describe())
        memory_budget = chosen.budget_bytes
    budget = budget_bytes(manifest.root, memory_budget if memory_budget is not None else plan.default_budget, store,
                          plan, device)
    kind = device.split(":", 1)[0]
    if not names:
        echo(f"{manifest.root}: the plan runs no technique; nothing to tune")
        point = TunedPoint(kind, budget, str(requested), (), (), {}, machine(device), {"rounds": 0})
    else:
        echo(f"tuning {', '.join(names)} on {kind} at {requested} ({budget:,} B): {len(names) + 2 if len(names) > 1 else 2} "
             f"variants x {tokens} tokens per round, in at most {minutes:g} minutes")
        base = {"artifact": str(manifest.root), "memory_budget": memory_budget, "device": device, "store": store,
                "routing": str(routing) if routing else None, "tokens": tokens}
        if runner is None:
            runner = ((lambda spec: measure_variant(base | spec)) if in_process
                      else SubprocessRunner(base, clock, deadline))
        if tokens == "auto":
            tokens = auto_tokens(runner, len(names), deadline, clock, rounds[0])
            base["tokens"] = tokens
            echo(f"  {tokens} tokens per run (sized for {rounds[0]} rounds of every variant and the check within the "
                 f"limit; {MIN_TOKENS} at least)")

        def run(v: Variant, round_: int) -> Run:
            out = runner({"variant": v.name, "off": list(v.off), "round": round_})
            return Run(v.name, round_, out["seconds"], {k: x for k, x in out.items() if k != "seconds"})

        kept, off, decisions, measured, runs = tune_decisions(names, run, deadline, clock, echo, *rounds)
        measured |= {"tokens": tokens, "figures": _mean_figures(runs)}
        point = TunedPoint(kind, budget, str(requested), tuple(kept), tuple(off), decisions, machine(device), measured)
    if write:
        manifest = open_artifact(manifest.root)  # the manifest now, in case it changed during the runs
        existing = read_tuning(manifest) or Tuning(manifest.raw["package_key"], ())
        write_tuning(manifest, existing.with_point(point))
        echo(f"wrote {manifest.root / TUNING_FILE}")
    return point


def auto_tokens(runner, techniques_count: int, deadline: float, clock, min_rounds: int) -> int:
    """The timed tokens per run that let ``min_rounds`` rounds of every variant and the check fit before the deadline,
    from one probe run of the whole plan at ``MIN_TOKENS`` (its wall time: the process, the load, the tokens)."""
    started = clock()
    probe = runner({"variant": "probe", "off": [], "round": -1, "tokens": MIN_TOKENS})
    wall = clock() - started
    per_token = sum(probe["seconds"]) / len(probe["seconds"])
    fixed = max(0.0, wall - per_token * (MIN_TOKENS + WARMUP_TOKENS))  # process start, load, warm-up
    variants = techniques_count + 2 if techniques_count > 1 else 2
    runs = variants * min_rounds + 2 * CHECK_ROUNDS
    per_run = 0.9 * (deadline - clock()) / runs
    return max(MIN_TOKENS, min(MAX_TOKENS, int((per_run - fixed) / max(per_token, 1e-9))))


def _open_for_tune(artifact, echo):
    """The artifact opened with every load-time check; a device file that is damaged or unsealed is removed first (it
    is what this run writes anew), saying so."""
    from loader.artifact import open_artifact
    from loader.format import read_manifest, write_manifest

    manifest = read_manifest(artifact)
    try:
        read_tuning(dataclasses.replace(manifest, plan=None))
    except ArtifactError as e:
        echo(f"replacing the damaged device file: {e}")
        raw = dict(manifest.raw)
        raw["files"] = {k: v for k, v in raw["files"].items() if k != TUNING_FILE}
        write_manifest(manifest.root, raw)
        (manifest.root / TUNING_FILE).unlink(missing_ok=True)
    return open_artifact(artifact)


def _mean_figures(runs: list[Run]) -> dict:
    """Per variant, the mean of each numeric figure its runs reported (bytes read and stall per token, the techniques'
    own seconds per token)."""
    out: dict = {}
    for r in runs:
        out.setdefault(r.variant, []).append(r.figures)
    return {name: {k: sum(f[k] for f in fs) / len(fs) for k in fs[0]
                   if all(isinstance(f.get(k), int | float) and not isinstance(f.get(k), bool) for f in fs)}
            for name, fs in out.items()}


def cpu_name() -> str:
    """This machine's CPU model (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str) -> dict:
    """The machine the decisions were measured on."""
    import torch

    info = {"cpu": cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def add_to_profile(path, point: TunedPoint) -> None:
    """Write ``point``'s decisions into the device profile at ``path`` (``moeload tune --device-profile``), so that
    ``moeprep prepare --device-profile`` plans with them: the file is read, checked and written back atomically."""
    from loader.device import load_profile
    from loader.io import write_json_atomic
    from loader.tuning import PROFILE_KEY

    load_profile(path)  # a damaged profile is refused, naming it
    raw = json.loads(Path(path).read_text())
    raw[PROFILE_KEY] = {k: v for k, v in point.to_json().items() if k != "measured"}
    write_json_atomic(path, raw)


# ------------------------------------------------------------------------------------------- one run


class SubprocessRunner:
    """Each variant's run in a fresh process (``python -m loader.tune SPEC``): its memory, threads and allocator start
    clean, and a run stopped at the deadline loses nothing else."""

    def __init__(self, base: dict, clock, deadline: float) -> None:
        self.base = base  # what every run of this tune shares: artifact, budget, device, store, routing, tokens
        self.clock, self.deadline = clock, deadline

    def __call__(self, spec: dict) -> dict:
        full = self.base | spec
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(full, f)
        try:
            left = max(5.0, self.deadline - self.clock() + 30)
            try:
                done = subprocess.run([sys.executable, "-m", "loader.tune", f.name], capture_output=True, text=True,
                                      timeout=left, env=os.environ | {"PYTHONPATH": _package_root()})
            except subprocess.TimeoutExpired:
                raise RunCutShort(spec["variant"]) from None
        finally:
            os.unlink(f.name)
        lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
        if done.returncode != 0 or not lines:
            tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RunFailed(tail, budget="BudgetError" in done.stderr or "budget" in tail.lower())
        out = json.loads(lines[-1])
        if "error" in out:
            raise RunFailed(out["error"], budget=out.get("budget", False))
        return out


def _package_root() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    return os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])


def read_sample(manifest, path=None) -> dict:
    """The routing to replay: expert_ids and weights [T, L, K], sequence_lengths, and where recorded the router logits
    [T, L, E], router inputs [T, L, H] and LM head inputs [T, H]."""
    from safetensors.torch import load_file

    from loader.errors import ModelingError
    from loader.simulate import ROUTING_SAMPLE, read_routing_sample

    try:
        read_routing_sample(manifest, path)  # every shape check of the cost model's reader
    except ModelingError as e:
        raise TuneError(str(e)) from None
    tensors = load_file(str(path or manifest.path(ROUTING_SAMPLE)))
    if "sequence_lengths" not in tensors:
        import torch

        tensors["sequence_lengths"] = torch.tensor([tensors["expert_ids"].shape[0]])
    return tensors


def replay_tokens(loaded, sample: dict, count: int, timer=time.perf_counter) -> tuple[list[float], dict]:
    """Replay the sample's first ``count`` tokens through ``loaded``'s engine as decode steps (the module docstring):
    (seconds per token, the routing policy's and each predictor's seconds). Each sequence of the sample starts cold."""
    import torch

    engine = loaded.runtime
    policy = loaded.routing.policy if loaded.routing is not None else None
    view = engine.cache.view
    ids, weights = sample["expert_ids"].long(), sample["weights"].float()
    tokens, layers, k = ids.shape
    dtype = next((p.dtype for p in loaded.model.parameters() if p.is_floating_point()), torch.float32)
    device = engine.device
    inputs, head = sample.get("router_inputs"), sample.get("head_inputs")
    hidden_size = loaded.model.config.get_text_config().hidden_size
    logits = sample.get("logits")
    num_experts = engine.num_experts
    if policy is not None and logits is None:  # the router computes them in a decode step: not the policy's time
        logits = _logits_of(ids[:count], weights[:count], num_experts)
    generator = torch.Generator().manual_seed(0)
    positions = [p for n in sample["sequence_lengths"].tolist() for p in range(int(n))]
    spent = {"routing_seconds": 0.0} | {f"{p.name}_seconds": 0.0 for p in engine.predictors}
    timed_predictors = _timed_predictors(engine, spent, timer)
    out = []
    try:
        with torch.inference_mode():
            for t in range(min(count, tokens)):
                start = timer()
                engine.start_forward(positions[t], 1)
                for layer in range(layers):
                    x = (inputs[t, layer].to(device=device, dtype=dtype).view(1, -1) if inputs is not None
                         else torch.randn(1, hidden_size, generator=generator).to(device=device, dtype=dtype))
                    idx, w = ids[t, layer].view(1, k).to(device), weights[t, layer].view(1, k).to(device)
                    z = logits[t, layer].float().view(1, -1).to(device) if logits is not None else None
                    if policy is not None:
                        began = timer()
                        w, idx = policy.route(layer, z, w, idx, view(layer))
                        spent["routing_seconds"] += timer() - began
                    if engine.predictors:
                        engine.after_router(layer, x, idx)
                    engine.run_layer(layer, engine.modules[layer], x, idx, w.to(dtype))
                if engine.predictors:
                    h = (head[t].to(device=device, dtype=dtype).view(1, -1) if head is not None
                         else torch.randn(1, hidden_size, generator=generator).to(device=device, dtype=dtype))
                    engine.after_last_layer(h)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                out.append(timer() - start)
    finally:
        timed_predictors()
    return out, spent


def _logits_of(ids, weights, num_experts: int):
    """Router logits [T, L, E] a replay without recorded ones implies (ids and weights [T, L, K]): the log weight at
    the chosen experts, far below elsewhere."""
    import torch

    z = torch.full((*ids.shape[:2], num_experts), -30.0)
    return z.scatter(-1, ids, weights.float().clamp_min(1e-12).log())


def _timed_predictors(engine, spent: dict, timer):
    """Wrap each predictor's hooks to add their seconds to ``spent``; returns the undo."""
    undo = []
    for p in engine.predictors:
        for hook in ("after_router", "after_last_layer"):
            original = getattr(p, hook)

            def timed(*args, _original=original, _key=f"{p.name}_seconds", **kwargs):
                began = timer()
                try:
                    return _original(*args, **kwargs)
                finally:
                    spent[_key] += timer() - began

            setattr(p, hook, timed)
            undo.append((p, hook))

    def restore():
        for p, hook in undo:
            delattr(p, hook)

    return restore


def measure_variant(spec: dict) -> dict:
    """One run (in its own process): load the artifact with the variant's plan (the plan as prepared less the techniques
    ``spec["off"]`` names), replay ``WARMUP_TOKENS`` untimed, then ``tokens`` timed from a cold start; per-token seconds
    and the loader's figures per token."""
    from loader.artifact import open_artifact
    from loader.runtime import load

    manifest = open_artifact(spec["artifact"])
    plan = without(manifest.plan, spec["off"])
    sample = read_sample(manifest, spec.get("routing"))
    try:
        loaded = load(spec["artifact"], device=spec["device"], memory_budget=spec["memory_budget"],
                      store=spec["store"], plan=plan)
    except BudgetError as e:
        return {"error": str(e), "budget": True}
    try:
        replay_tokens(loaded, sample, WARMUP_TOKENS)
        before = loaded.stats()
        seconds, spent = replay_tokens(loaded, sample, spec["tokens"])
        after = loaded.stats()
    finally:
        loaded.close()
    n = len(seconds)
    b, a = before["decode_timing"], after["decode_timing"]
    total = sum(seconds)
    figures = {"bytes_read_per_token": (after["bytes_read"] - before["bytes_read"]) / n,
               "misses_per_token": (after["misses"] - before["misses"]) / n,
               "stall_fraction": (a["stall_seconds"] - b["stall_seconds"]) / total,
               "compute_fraction": (a["compute_seconds"] - b["compute_seconds"]) / total,
               "records_read_per_token": (after["reads"]["records"] - before["reads"]["records"]) / n}
    figures |= {f"{k.removesuffix('_seconds')}_us_per_token": v / n * 1e6 for k, v in spent.items()}
    return {"seconds": seconds} | figures


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m loader.tune SPEC.json (a run of `moeload tune`)")
    spec = json.loads(Path(argv[0]).read_text())
    try:
        result = measure_variant(spec)
    except (BudgetError, LoaderError, ArtifactError) as e:
        result = {"error": str(e), "budget": isinstance(e, BudgetError)}
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
