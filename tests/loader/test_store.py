"""Expert stores and the reader (loader/store.py): whole records and byte ranges read into given memory, checked
whole; the reader serves demands before queued prefetches, promotes and cancels."""

from __future__ import annotations

import threading
import time

import torch
from xxhash import xxh3_64_intdigest

from loader.store import DEMAND, PREFETCH, Reader, ReadJob, SlotArena


class _SlowStore:
    """A store stand-in whose reads record their order; the first read blocks until released."""

    precision, record_bytes = "x", 16

    def __init__(self) -> None:
        self.order: list[str] = []
        self.gate = threading.Event()

    def read_into(self, key, dest, start=0, length=None):
        if key == "block":
            self.gate.wait(5)
        self.order.append(key)
        dest[:4] = b"abcd"
        return 16


def test_reader_serves_demand_before_queued_prefetch_and_cancels():
    store, arena = _SlowStore(), SlotArena(5, 64, torch.device("cpu"))
    reader = Reader(workers=1)
    try:
        jobs = {k: ReadJob(store, k, (arena, i), p) for i, (k, p) in
                enumerate([("block", DEMAND), ("p1", PREFETCH), ("p2", PREFETCH), ("p3", PREFETCH), ("d1", DEMAND)])}
        reader.submit(jobs["block"])
        time.sleep(0.05)  # the worker is now inside the blocking read
        for k in ("p1", "p2", "p3", "d1"):
            reader.submit(jobs[k])
        assert reader.cancel(jobs["p2"])
        reader.promote(jobs["p3"])  # a demand now waits on p3
        store.gate.set()
        for k in ("block", "p1", "p3", "d1"):
            jobs[k].wait()
        assert store.order == ["block", "d1", "p3", "p1"]  # demands first (the promoted one too), p2 never read
        assert jobs["p2"].state == "cancelled" and not reader.cancel(jobs["p1"])
        assert bytes(arena.host_view(1)[:4]) == b"abcd"  # read into its slot, no buffer of its own
    finally:
        store.gate.set()
        reader.close()


def test_store_reads_whole_records_and_byte_ranges_into_given_memory(tmp_path):
    from loader.store import ExpertStore
    from prep.quant.records import write_aligned_records

    gen = torch.Generator().manual_seed(0)
    records = {f"layers.0.experts.{e}": torch.randint(0, 256, (10000,), dtype=torch.uint8, generator=gen).numpy().tobytes()
               for e in range(3)}
    hashes = write_aligned_records(tmp_path / "s.safetensors", records, 10000)
    assert hashes == {k: xxh3_64_intdigest(v) for k, v in records.items()}
    checked = []

    def check(key, data):
        checked.append(key)
        if xxh3_64_intdigest(data) != hashes[key]:
            raise ValueError(key)

    for mode in ("disk", "host"):
        store = ExpertStore(tmp_path / "s.safetensors", "x", mode=mode, check=check)
        arena = SlotArena(2, store.stride, torch.device("cpu"))
        for key, data in records.items():
            assert store.read_into(key, arena.host_view(0)) == 10000
            assert bytes(arena.host_view(0)[:10000]) == data
            for start, length in ((4096, 4096), (10, 777), (9000, 1000)):
                assert store.read_into(key, arena.host_view(1), start, length) == length
                assert bytes(arena.host_view(1)[:length]) == data[start:start + length]
        store.close()
    assert checked == list(records) * 2  # whole-record reads are checked, ranges are not
