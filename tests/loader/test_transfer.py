"""The GPU transfer path (``loader/transfer.py``) on a machine without a GPU: the same reader and engine code
against ``tests.helpers.loader_fakes.FakeLink`` (deferred copies), and the host store's logic with CPU tensors."""

from __future__ import annotations

import pytest
import torch

from loader.runtime import load, minimum_budget
from loader.store import ExpertStore, Reader, ReadJob, SlotArena
from loader.transfer import HostLink
from tests.helpers.loader_fakes import FakeLink
from tests.helpers.tiny_models import tiny_artifact

PROMPT = [5, 9, 13, 20, 7, 11, 3, 8]


@torch.no_grad()
def decode_logits(artifact, steps: int = 6, **options) -> tuple[torch.Tensor, dict]:
    """Greedy decode, one token per call (every call a decode step): (logits [steps + prompt, V], stats)."""
    loaded = load(artifact, **options)
    try:
        past, logits, tok = None, [], None
        for i in range(len(PROMPT) + steps):
            tok = torch.tensor([[PROMPT[i]]]) if i < len(PROMPT) else logits[-1].argmax().view(1, 1)
            out = loaded.model(tok, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits[0, -1])
        return torch.stack(logits), loaded.stats()
    finally:
        loaded.close()


@pytest.fixture()
def fake(monkeypatch):
    link = FakeLink()
    monkeypatch.setattr("loader.runtime.link_for", lambda device: link)
    return link


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    return tiny_artifact(tmp_path_factory, "mixtral", "int4")[1]


@pytest.mark.parametrize("store", ["disk", "host"])
@pytest.mark.parametrize("dtype", ["packed", "float32"])
def test_the_accelerated_path_computes_what_the_cpu_path_computes(int4, fake, monkeypatch, store, dtype):
    """Copies on streams, deferred until an event is waited on: the logits equal the in-place CPU path's, at
    unlimited and at the smallest budget (evictions, read buffers), and the compute thread never synchronizes."""
    budgets = ["unlimited", minimum_budget(int4, store=store, expert_dtype=dtype)]
    for budget in budgets:
        with monkeypatch.context() as m:
            m.setattr("loader.runtime.link_for", lambda device: HostLink())
            expected, _ = decode_logits(int4, memory_budget=budget, store=store, expert_dtype=dtype)
        copies = fake.copies
        got, stats = decode_logits(int4, memory_budget=budget, store=store, expert_dtype=dtype, cpu_misses="never")
        # equal up to the order the experts' outputs are summed in (which reads land first)
        assert (got - expected).abs().max() <= 1e-5, budget
        assert fake.copies > copies  # the accelerated path ran
        assert stats["misses"] > 0
    assert fake.compute_thread_syncs() == 0
    assert fake.waits > 0


def test_a_compute_that_does_not_wait_for_its_copy_computes_stale_bytes(int4, fake, monkeypatch):
    """The fake can fail: with the compute stream's wait removed, a read's deferred copy has not run when the
    expert computes, and the logits change."""
    expected, _ = decode_logits(int4, memory_budget=minimum_budget(int4, expert_dtype="packed"),
                                expert_dtype="packed")
    real_wait = fake.wait
    monkeypatch.setattr(fake, "wait", lambda event, stream=None: real_wait(event, stream) if stream is not None
                        else None)
    got, _ = decode_logits(int4, memory_budget=minimum_budget(int4, expert_dtype="packed"), expert_dtype="packed")
    assert (got - expected).abs().max() > 1e-3


def test_a_refilled_bounce_buffer_waits_for_its_last_copy(int4, tmp_path):
    """Disk reads go through two pinned bounce buffers per reader thread: a third read refills the first one
    only after its copy ran, so every slot holds its own record's bytes."""
    from loader.artifact import open_artifact

    manifest = open_artifact(int4)
    precision, spec = next(iter(manifest.stores.items()))
    store = ExpertStore(manifest.path(spec.file), precision)
    link = FakeLink()
    arena = SlotArena(6, store.stride, torch.device("cpu"))
    reader = Reader(1, link=link)
    keys = list(store.offsets)[:6]
    try:
        jobs = [reader.submit(ReadJob(store, key, (arena, slot), 0)) for slot, key in enumerate(keys)]
        for job in jobs:
            job.wait()
            link.wait(job.ready)
        for slot, key in enumerate(keys):
            expected = bytearray(store.record_bytes)
            store.read_into(key, memoryview(expected))
            assert bytes(arena.tensor(slot, store.record_bytes).numpy()) == bytes(expected)
        assert link.syncs_by_thread.get("moeprep-read-0", 0) >= len(keys) - 2  # buffers reused after their copy
    finally:
        reader.close()
        store.close()


def test_the_host_store_is_a_private_copy_checked_once_per_record(int4, tmp_path):
    """Host mode reads the file once (a later change of the file is not seen) and checks a record's xxh3_64 the
    first time it is used, not on every read."""
    import shutil

    from loader.artifact import open_artifact
    from loader.hashing import check_record

    copy = tmp_path / "artifact"
    shutil.copytree(int4, copy)
    manifest = open_artifact(copy)
    precision, spec = next(iter(manifest.stores.items()))
    checked = []

    def check(key, data):
        checked.append(key)
        check_record(manifest, precision, key, data)

    store = ExpertStore(manifest.path(spec.file), precision, mode="host", check=check)
    key = next(iter(store.offsets))
    first = bytes(store.host_slice(key).numpy())
    path = manifest.path(spec.file)
    data = bytearray(path.read_bytes())
    data[store.offsets[key]] ^= 0xFF
    path.write_bytes(bytes(data))
    assert bytes(store.host_slice(key).numpy()) == first
    buf = bytearray(store.record_bytes)
    store.read_into(key, memoryview(buf))
    assert checked == [key]
    assert store.host_slice(key, 8, 16).numel() == 16
    store.close()
