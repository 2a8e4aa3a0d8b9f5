"""The modelled prefill: a prompt of recorded routing through the loader's chunked prefill (``loader/prefill.py``),
timed with a device profile.

The prompt is the first tokens of the replay's sequences (one after another, cycled where they are shorter). It is
cut into chunks as the loader cuts it (the budget's chunk); each chunk runs every MoE layer through the loader's
own schedule (``loader.schedule.LayerSchedule``) on the cache the budget builds, so hits, misses and evictions
are the loader's. Per layer step:

- an expert given n tokens computes for ``expert_seconds(profile, precision, form, n)``: the profile's prefill
  timings (``prep.sim.device.measure_prefill``) interpolated in n, else n decode tokens' compute;
- a miss reads its record (``profile.read_seconds``) and makes its form on a reader thread; one whose tokens
  reach its precision's prefill form (``plan.prefill.forms``) is made and computed in that form, not cached;
- hits compute while the reads run; each read is computed as it lands: the step takes
  ``max(all compute, all reads + the last read's compute)``, plus the profile's per-layer overhead.

Each prompt token adds the calibration's ``prefill_token_overhead_s`` (attention, dense layers, routers at prompt
batch sizes; fitted by ``calibrate_prefill`` from a measured prefill with every expert held).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from loader.cache import ExpertCache
from loader.plan import Plan
from loader.prefill import PrefillSpec
from loader.schedule import LayerSchedule
from prep.errors import MoeprepError
from prep.sim.device import DeviceProfile
from prep.sim.replay import Replay
from prep.sim.simulate import CacheSpec, _factory


@dataclass
class PrefillModel:
    """A modelled prefill: its tokens and chunks, seconds (experts' steps and per-token overhead), reads."""

    tokens: int
    chunks: int
    seconds: float
    step_seconds: float  # the MoE layer steps (compute and reads)
    compute_seconds: float  # every expert's compute
    read_seconds: float  # every read and form made (on reader threads)
    layer_overhead_seconds: float  # the profile's per layer step
    token_overhead_seconds: float  # the calibration's per prompt token
    reads: int
    read_bytes: int
    prefill_form_computes: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")

    def to_json(self) -> dict:
        return asdict(self) | {"tokens_per_second": self.tokens_per_second}


def prompt_routing(replay: Replay, tokens: int) -> list:
    """The first ``tokens`` tokens' routing ([T][L] -> experts): the replay's sequences one after another, again
    from the first where they run out."""
    flat = [token for sequence in replay.sequences for token in sequence]
    if not flat:
        raise MoeprepError("the trace holds no token to model a prefill with; record routing traces first")
    return [flat[i % len(flat)] for i in range(tokens)]


def expert_seconds(profile: DeviceProfile, precision: str, form: str | None, tokens: int) -> float:
    """One expert's compute for ``tokens`` tokens in ``form``: the profile's prefill timings linearly interpolated
    between its token counts (past the largest, at its per-token rate); without them, ``tokens`` decode steps."""
    timed = profile.prefill_seconds.get(precision, {}).get(form) if form is not None else None
    if not timed:
        return tokens * profile.compute(precision)
    points = sorted((int(t), s) for t, s in timed["tokens"].items())
    if tokens <= points[0][0]:
        return points[0][1] * tokens / points[0][0]
    for (t0, s0), (t1, s1) in zip(points, points[1:], strict=False):
        if tokens <= t1:
            return s0 + (s1 - s0) * (tokens - t0) / (t1 - t0)
    last, seconds = points[-1]
    return seconds * tokens / last


def make_seconds(profile: DeviceProfile, precision: str, form: str | None) -> float:
    """Making ``form`` from a record: its prefill timing, else the profile's held-form make time."""
    timed = profile.prefill_seconds.get(precision, {}).get(form) if form is not None else None
    return timed["make_s"] if timed else profile.make(precision)


def held_form_of(profile: DeviceProfile, precision: str) -> str | None:
    """The held form the profile timed first for ``precision`` (``measure_prefill`` times the held form first)."""
    timed = profile.prefill_seconds.get(precision, {})
    return next(iter(timed), None)


def simulate_prefill(replay: Replay, spec: CacheSpec, profile: DeviceProfile, tokens: int, chunks: list[int],
                     prefill: PrefillSpec | None = None, held_forms: dict | None = None) -> PrefillModel:
    """Model a prompt of ``tokens`` tokens run as ``chunks`` (their sizes: ``loader.prefill.chunk_sizes``) on the
    cache of ``spec``, starting cold. ``prefill``: the plan's prefill forms; ``held_forms``: precision -> the held
    form (default: the one the profile timed first)."""
    if sum(chunks) != tokens:
        raise MoeprepError(f"the chunks {chunks[:5]}... add up to {sum(chunks)} tokens, not the prompt's {tokens}")
    prefill = prefill or PrefillSpec()
    routing = prompt_routing(replay, tokens)
    cache = ExpertCache(spec.pools, spec.num_layers, spec.num_experts, _factory(*spec.eviction, None))
    record_bytes = spec.record_bytes
    slot_bytes = spec.slot_bytes if spec.slot_bytes is not None else record_bytes
    schedule = LayerSchedule(cache, spec.expert_precision, None, readable=record_bytes)
    held = dict(held_forms or {})
    step = compute = reads_s = overhead = 0.0
    reads = read_bytes = in_form = 0
    done = 0
    for size in chunks:
        chunk = routing[done:done + size]
        cache.clock.token = done + size - 1
        for layer in range(spec.num_layers):
            rows = [list(token[layer]) for token in chunk]
            given: dict = {}
            for row in rows:
                for e in row:
                    given[e] = given.get(e, 0) + 1
            decisions, _ = schedule.begin(layer, rows)
            all_compute = layer_reads = last = 0.0
            for d in decisions:
                n = given.get(d.expert, 0)
                form = held.get(d.precision) or held_form_of(profile, d.precision)
                if d.entry is not None:
                    all_compute += expert_seconds(profile, d.precision, form, n)
                    continue
                nbytes = record_bytes[d.precision]
                chosen = prefill.form_for(d.precision)
                if chosen is not None and n >= chosen.from_tokens and chosen.form != form:
                    cache.count_read(layer, nbytes)  # read once into a prefill buffer, not cached
                    form = chosen.form
                    in_form += 1
                else:
                    entry = schedule.admit(layer, d.expert, d.precision, slot_bytes[d.precision], nbytes)
                    if entry is not None:
                        cache.complete(entry)
                seconds = expert_seconds(profile, d.precision, form, n)
                all_compute += seconds
                last = seconds
                layer_reads += profile.read_seconds(nbytes) + make_seconds(profile, d.precision, form)
                reads += 1
                read_bytes += nbytes
            schedule.end(layer)
            step += max(all_compute, layer_reads + last)
            compute += all_compute
            reads_s += layer_reads
            overhead += profile.layer_overhead
        done += size
    token_overhead = float(profile.calibration.get("prefill_token_overhead_s", 0.0)) * tokens
    return PrefillModel(tokens, len(chunks), step + overhead + token_overhead, step, compute, reads_s, overhead,
                        token_overhead, reads, read_bytes, in_form)


def calibrate_prefill(profile: DeviceProfile, modelled_all_held: PrefillModel, measured_seconds: float) -> DeviceProfile:
    """``profile`` with ``prefill_token_overhead_s`` fitted: a prefill measured with every expert held, less its
    modelled expert steps, per prompt token (never below 0)."""
    m = modelled_all_held
    per_token = max(0.0, measured_seconds - m.step_seconds - m.layer_overhead_seconds) / m.tokens
    return DeviceProfile(profile.read_bandwidth, profile.read_latency, dict(profile.compute_seconds), profile.device,
                         dict(profile.extra), dict(profile.make_seconds),
                         dict(profile.calibration) | {"prefill_token_overhead_s": per_token})


def plan_prefill(replay: Replay, plan: Plan, spec: CacheSpec, profile: DeviceProfile, tokens: int, chunk: int,
                 held_forms: dict | None = None) -> PrefillModel:
    """``simulate_prefill`` for ``plan`` with the prompt cut into chunks of ``chunk`` tokens (the budget's)."""
    chunks = [min(chunk, tokens - start) for start in range(0, tokens, chunk)]
    return simulate_prefill(replay, spec, profile, tokens, chunks, plan.prefill, held_forms)


def artifact_prefill(trace, artifact, budget, profile_path, tokens: int) -> PrefillModel:
    """``moeprep simulate --prefill``: a ``tokens``-token prompt of ``trace`` on the cache and in the chunks that
    ``load(artifact, memory_budget=budget)`` builds (``loader.budget.cache_layout``), with the plan's prefill forms
    and the held forms it chooses, timed with the profile at ``profile_path``."""
    from loader.budget import cache_layout
    from prep.sim.device import load_profile
    from prep.sim.replay import load_replay
    from prep.sim.simulate import capacities_spec

    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 1 << 20:
        raise MoeprepError(f"--prefill {tokens!r}: give the prompt's tokens, from 1 to {1 << 20}")
    if artifact is None or profile_path is None:
        raise MoeprepError("--prefill models a prompt on an artifact's cache with a device profile: pass --plan ARTIFACT "
                           "and --profile device.json (moeprep profile-device)")
    layout = cache_layout(artifact, budget)
    spec = capacities_spec(layout.plan, layout.capacities, layout.record_bytes, layout.slot_bytes)
    profile = load_profile(profile_path)
    shape = layout.sizes.activation
    chunk = layout.capacities.prefill_chunk or layout.plan.prefill.chunk
    if shape is not None:
        from loader.prefill import chunk_sizes

        chunks = chunk_sizes(shape, layout.capacities.prefill_bytes, chunk, tokens)
    else:
        chunks = [min(chunk, tokens - start) for start in range(0, tokens, chunk)]
    return simulate_prefill(load_replay(trace), spec, profile, tokens, chunks, layout.plan.prefill, layout.forms)
