"""The layer schedule (loader/schedule.py): the rules around the expert cache, one implementation that the
loader's steps and the simulator both call; its CPU miss rule and its prefetch gate, on a cache driven by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

from loader.cache import ExpertCache, PoolConfig
from loader.policies import policy_factory
from tests.helpers.cache_steps import REC, resident


def test_the_schedule_has_one_implementation():
    """The rules around the cache (classify, decide a miss, skip, lower, use, admit, place a miss, cancel an unwanted
    prefetch, prefetch admission, end) live in loader/schedule.py: the engine, its steps and the cost model ask
    ``serve`` and never call the cache's rule methods, nor admit or cancel on their own."""
    import re

    root = Path(__file__).resolve().parents[2]
    rules = re.compile(r"\.(begin_layer|use|skip|end_layer|decide|admit|cancel_unwanted)\(|cache\.(admit|prefetch)\(")
    users = ("loader/engine.py", "loader/step.py", "loader/neuron.py", "loader/runtime.py", "loader/simulate.py",
             "prep/sim/simulate.py")
    for path in users:
        found = [line.strip() for line in (root / path).read_text().splitlines()
                 if rules.search(line) and "matplotlib" not in line]
        assert not found, (path, found)
    schedule = (root / "loader/schedule.py").read_text()
    assert "import torch" not in schedule  # torch-free: the cost model runs it on sizes alone
    for caller in ("loader/engine.py", "loader/simulate.py"):  # the loader's layer call and the cost model's
        assert "schedule.serve(" in (root / caller).read_text(), caller


def test_the_schedule_serves_decode_misses_on_the_cpu_by_its_rule():
    """``CpuMissRule`` in ``LayerSchedule.begin``: in a one-token step a miss whose precision the rule names
    is served on the CPU (counted, used, never admitted); hits, a prefill step and a step that cannot (the
    neuron step) are not; ``always`` serves every miss, ``never`` and an ``auto`` rule with nothing faster
    on the CPU none."""
    from loader.errors import LoaderError
    from loader.schedule import CPU, READ, CpuMissRule, LayerSchedule

    def schedule(rule):
        pools = [PoolConfig("hi", "int4", "layer", {0: 4 * REC}), PoolConfig("lo", "int2", "layer", {0: 4 * REC})]
        cache = ExpertCache(pools, 1, 8, policy_factory("lru"))
        return LayerSchedule(cache, [["int4", "int2"] * 4], cpu_rule=rule)

    def run(sched, rows, cpu=True):
        decisions, _ = sched.begin(0, rows, cpu=cpu)
        for d in decisions:
            if d.entry is None and d.served == READ:
                sched.cache.complete(sched.admit(0, d.expert, d.precision, REC, REC))
        sched.end(0)
        return [(d.expert, d.served if d.entry is None else "hit") for d in decisions]

    sched = schedule(CpuMissRule("auto", {"int2"}))
    assert run(sched, [[0, 1]]) == [(0, READ), (1, CPU)]
    assert run(sched, [[1, 0]]) == [(1, CPU), (0, "hit")]  # never cached: the CPU serves it again
    assert resident(sched.cache) == {(0, 0, "int4")}
    counters = sched.cache.counters[0]
    assert (counters.misses, counters.cpu_computed, counters.bytes_read) == (3, 2, REC)
    assert run(sched, [[2, 3], [4, 5]]) == [(2, READ), (3, READ), (4, READ), (5, READ)]  # prefill reads
    assert run(sched, [[7]], cpu=False) == [(7, READ)]
    assert counters.cpu_computed == 2

    sched = schedule(CpuMissRule("always"))
    assert run(sched, [[0, 1]]) == [(0, CPU), (1, CPU)]
    assert run(sched, [[2, 3], [0, 1]]) == [(2, READ), (3, READ), (0, READ), (1, READ)]
    assert run(sched, [[0, 5]]) == [(0, "hit"), (5, CPU)]
    for rule in (CpuMissRule("never"), CpuMissRule("auto"), None):
        assert run(schedule(rule), [[0, 1]]) == [(0, READ), (1, READ)]
    assert CpuMissRule("auto").off and not CpuMissRule("always").off
    with pytest.raises(LoaderError, match="cpu_misses 'sometimes' unknown"):
        CpuMissRule("sometimes")


def test_the_prefetch_gate_stops_predictions_that_do_not_pay():
    """``PrefetchGate`` in ``LayerSchedule``: prefetches are read while at least ``floor`` of the decided ones
    (used or wasted) were used; after ``warmup`` decided ones with fewer used, reads stop for good at the end of
    that layer call (``end``), and no request is admitted any more. Without a gate nothing stops."""
    from loader.predict import PrefetchRequest
    from loader.schedule import LayerSchedule, PrefetchGate

    def schedule(gate):
        cache = ExpertCache([PoolConfig("main", "int4", "layer", {0: 2 * REC, 1: 2 * REC})], 2, 8,
                            policy_factory("lru"))
        return LayerSchedule(cache, [["int4"] * 8] * 2, prefetch_gate=gate)

    def token(sched, predicted, chosen):
        """Predict ``predicted`` for layer 1, then run layer 0 (choosing 0) and layer 1 (choosing ``chosen``)."""
        for entry in sched.prefetch([PrefetchRequest(1, predicted)], {"int4": REC}):
            sched.cache.complete(entry)
        for layer, expert in ((0, 0), (1, chosen)):
            decisions, _ = sched.begin(layer, [[expert]])
            for d in decisions:
                if d.entry is None:
                    sched.cache.complete(sched.admit(layer, d.expert, d.precision, REC, REC))
            sched.end(layer)

    gate = PrefetchGate(floor=0.5, warmup=4)
    sched = schedule(gate)
    for t in range(4):  # right twice, wrong twice: half used, the gate stays open
        token(sched, 2 + t, 2 + t if t % 2 == 0 else 7)
    assert sched.prefetching and gate.pays(sched.cache)
    token(sched, 3, 7)  # wrong again: 2 of 5 used
    assert not sched.prefetching
    issued = sum(c.prefetches for c in sched.cache.counters)
    token(sched, 4, 4)
    assert sum(c.prefetches for c in sched.cache.counters) == issued  # nothing read once closed
    assert sched.prefetch([PrefetchRequest(1, 5)], {"int4": REC}) == []

    ungated = schedule(None)
    for t in range(6):
        token(ungated, 2 + t % 3, 7)
    assert ungated.prefetching and sum(c.prefetch_wasted for c in ungated.cache.counters) >= 5


def _served_cache(slots: int):
    """One layer of 8 experts at int4 in a pool of ``slots`` 100-byte slots, and its schedule."""
    from loader.cache import ExpertCache, PoolConfig
    from loader.policies import policy_factory
    from loader.schedule import LayerSchedule

    cache = ExpertCache([PoolConfig("main", "int4", "layer", {0: slots * 100}, 100)], 1, 8, policy_factory("lru", {}))
    return cache, LayerSchedule(cache, [("int4",) * 8], readable={"int4"})


def test_serve_places_each_miss_in_the_cache_a_buffer_or_its_prefill_form_and_counts_every_read():
    """A prompt chunk's expert given to ``from_tokens`` tokens is read in its prefill form (not cached); the rest
    are admitted while the pool has room, then read into buffers; every read's bytes are counted once."""
    from loader.schedule import BUFFER, CACHE, HELD, PROMPT

    cache, schedule = _served_cache(slots=2)
    rows = [[0, 1], [0, 2], [3, 4]]  # expert 0 given to 2 tokens, the others to one
    served = schedule.serve(0, rows, slot_bytes={"int4": 100}, read_bytes={"int4": 70}, prompt_forms={"int4": 2})
    got = [(d.expert, d.served) for d in served.decisions]
    assert got == [(0, PROMPT), (1, CACHE), (2, CACHE), (3, BUFFER), (4, BUFFER)]
    assert all(d.miss for d in served.decisions) and served.skipped == []
    assert [d.entry is not None for d in served.decisions] == [False, True, True, False, False]
    assert cache.counters[0].bytes_read == 5 * 70
    for d in served.decisions:
        if d.served == CACHE:
            cache.complete(d.entry)
    schedule.end(0)
    again = schedule.serve(0, [[1, 2]], slot_bytes={"int4": 100}, read_bytes={"int4": 70})
    assert [(d.expert, d.served, d.miss) for d in again.decisions] == [(1, HELD, False), (2, HELD, False)]
    assert cache.counters[0].bytes_read == 5 * 70  # hits read nothing


def test_serve_cancels_an_unwanted_prefetch_only_where_its_read_can_still_be_stopped():
    """A prefetch for the layer the router did not choose is dropped when ``cancel`` stops its read; one whose read
    has started (cancel False) stays and is wasted at the layer's end; a chosen one is a hit."""
    from loader.predict import PrefetchRequest
    from loader.schedule import HELD

    for stoppable in (True, False):
        cache, schedule = _served_cache(slots=4)
        admitted = schedule.prefetch([PrefetchRequest(0, 5), PrefetchRequest(0, 6)], {"int4": 100})
        assert sorted(e.expert for e in admitted) == [5, 6] and all(e.in_flight for e in admitted)
        asked = []

        def cancel(entry, asked=asked, stoppable=stoppable) -> bool:
            asked.append(entry.expert)
            return stoppable

        served = schedule.serve(0, [[6, 1]], slot_bytes={"int4": 100}, read_bytes={"int4": 100}, cancel=cancel)
        assert asked == [5]  # only the unwanted one, and only while in flight
        assert sorted(served.prefetched) == [5, 6]
        assert (served.decisions[0].expert, served.decisions[0].served) == (6, HELD)
        assert (cache.find(0, 5, "int4") is None) == stoppable
        assert cache.counters[0].prefetch_cancelled == int(stoppable)
        schedule.end(0)
        assert cache.counters[0].prefetch_wasted == int(not stoppable)
