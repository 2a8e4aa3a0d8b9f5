"""Expert stores and the reader: where a miss or a prefetch reads a record from, and into what.

One ``ExpertStore`` per precision (``experts-<precision>.safetensors``). ``disk`` mode reads the
artifact file with positioned reads that bypass the page cache (O_DIRECT when the filesystem allows
it, else plain reads followed by ``posix_fadvise(DONTNEED)``), so a miss costs what it costs on a
device reading from flash; ``host`` mode holds the whole store in RAM (pinned on CUDA) and a miss is a
copy; the runtime counts those bytes against the budget.

Records land in memory allocated once (``SlotArena``: page-aligned, so O_DIRECT reads straight into
it): the caches' slots, the read buffers, and one staging buffer per reader thread. No read allocates. A
job with a held form that is made (``loader/forms.py``) reads into its thread's staging buffer, and the
same thread makes the form into the target slot: the compute thread never decodes. A job of the record
form reads into the target slot directly. On CUDA a read goes through a pinned host buffer of the thread,
then to the device (the slot, or the thread's device staging buffer where the form is made) on the
reader's own stream.

``Reader`` runs the reads on worker threads from one priority queue: demand reads before queued
prefetch reads; a queued prefetch can be cancelled, and a demand for a queued prefetch promotes it.
Every full-record read is checked against the record's crc32 from the manifest (``check``).
"""

from __future__ import annotations

import heapq
import itertools
import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from loader.errors import ArtifactError
from loader.io import read_record_offsets

DEMAND, PREFETCH = 0, 1


class ExpertStore:
    """Read-only access to the records of one ``experts-<precision>.safetensors`` file."""

    def __init__(self, path: str | Path, precision: str, mode: str = "disk",
                 check: Callable[[str, memoryview], None] | None = None) -> None:
        """check(key, data): raises when a full record read does not match the manifest (its crc32)."""
        if mode not in ("disk", "host"):
            raise ArtifactError(f"store mode {mode!r} unknown; use 'disk' or 'host'")
        self.path = Path(path)
        self.precision = precision
        self.mode = mode
        self.check = check
        self.offsets, self.record_bytes, self.stride = read_record_offsets(self.path)
        self.size = self.path.stat().st_size
        end = max(self.offsets.values(), default=0) + self.stride
        if self.size < end:
            raise ArtifactError(f"{self.path.name} is truncated: {self.size} bytes, its records need {end}. "
                                "Copy the artifact again or rerun `moeprep prepare`")
        self.direct_io = False
        self._host: torch.Tensor | None = None
        self._fd = -1
        self._plain_fd = -1
        if mode == "host":
            self._host = torch.from_file(str(self.path), shared=False, size=self.size, dtype=torch.uint8)
        else:
            self._fd, self.direct_io = self._open()
            self._plain_fd = os.open(self.path, os.O_RDONLY) if self.direct_io else self._fd

    @property
    def host_bytes(self) -> int:
        """Bytes this store holds in RAM (the whole file in host mode)."""
        return self.size if self._host is not None else 0

    def _open(self) -> tuple[int, bool]:
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            fd = -1
            try:
                fd = os.open(self.path, os.O_RDONLY | flag)
                probe = mmap.mmap(-1, self.stride)
                try:
                    os.preadv(fd, [probe], next(iter(self.offsets.values()), 0))  # the filesystem may refuse here
                finally:
                    probe.close()
                return fd, True
            except OSError:
                if fd >= 0:
                    os.close(fd)
        return os.open(self.path, os.O_RDONLY), False

    def offset(self, key: str) -> int:
        try:
            return self.offsets[key]
        except KeyError:
            raise ArtifactError(f"{self.path.name} has no record {key}; the artifact is incomplete, "
                                "rerun `moeprep prepare`") from None

    def spans(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The byte ranges a read of ``ranges`` of one record actually fetches: with O_DIRECT each widened to
        whole 4 KiB blocks (clipped to the record) and merged where they touch, so a dense set of small
        ranges is a few large reads; without it, the ranges themselves."""
        if not self.direct_io:
            return list(ranges)
        out: list[list[int]] = []
        for start, length in sorted(ranges):
            a = start // 4096 * 4096
            b = min(-(-(start + length) // 4096) * 4096, self.record_bytes)
            if out and a <= out[-1][1]:
                out[-1][1] = max(out[-1][1], b)
            else:
                out.append([a, b])
        return [(a, b - a) for a, b in out]

    def read_into(self, key: str, dest: memoryview, start: int = 0, length: int | None = None) -> int:
        """Read bytes [start, start + length) of record ``key`` into ``dest`` (host memory); returns the
        number of useful bytes. A full-record read is checked against the manifest's crc32."""
        length = self.record_bytes - start if length is None else length
        if start < 0 or length <= 0 or start + length > self.record_bytes:
            raise ArtifactError(f"byte range [{start}, {start + length}) is outside the {self.record_bytes}-byte "
                                f"records of {self.path.name}")
        offset = self.offset(key) + start
        if self._host is not None:
            dest[:length] = memoryview(self._host.numpy())[offset:offset + length]
        else:
            aligned = self.direct_io and start % 4096 == 0 and len(dest) >= -(-length // 4096) * 4096
            if aligned:
                span = -(-length // 4096) * 4096
                n = os.preadv(self._fd, [dest[:span]], offset)
            else:
                n = os.preadv(self._plain_fd, [dest[:length]], offset)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(self._plain_fd, offset, length, os.POSIX_FADV_DONTNEED)
            if n < length:
                raise ArtifactError(f"{self.path.name}: short read at {key}; the file is truncated. "
                                    "Copy the artifact again or rerun `moeprep prepare`")
        if start == 0 and length == self.record_bytes and self.check is not None:
            self.check(key, dest[:length])
        return length

    def host_record(self, key: str) -> torch.Tensor | None:
        """Record ``key`` as a view of the host copy (host mode; None on disk), checked against its crc32."""
        if self._host is None:
            return None
        offset = self.offset(key)
        record = self._host[offset:offset + self.record_bytes]
        if self.check is not None:
            self.check(key, record)
        return record

    def close(self) -> None:
        for fd in {self._fd, self._plain_fd}:
            if fd >= 0:
                os.close(fd)
        self._fd = self._plain_fd = -1


class SlotArena:
    """``count`` fixed-size slots of ``slot_bytes`` each, allocated once; page-aligned on the host.

    On CUDA the slots live on the device; reads fill them through a pinned staging buffer.
    """

    def __init__(self, count: int, slot_bytes: int, device: torch.device) -> None:
        self.count = count
        self.slot_bytes = slot_bytes
        self.device = device
        self.free = list(range(count - 1, -1, -1))
        total = max(1, count * slot_bytes)
        if device.type == "cuda":
            self._map = None
            self.data = torch.empty(total, dtype=torch.uint8, device=device)
        else:
            self._map = mmap.mmap(-1, total)  # page-aligned, as O_DIRECT needs
            self.data = torch.frombuffer(self._map, dtype=torch.uint8)

    def take(self) -> int:
        if not self.free:
            raise RuntimeError("slot arena exhausted: the cache admitted more records than its capacity")
        return self.free.pop()

    def give(self, slot: int) -> None:
        self.free.append(slot)

    def tensor(self, slot: int, nbytes: int) -> torch.Tensor:
        start = slot * self.slot_bytes
        return self.data[start:start + nbytes]

    def host_view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self._map)[start:start + self.slot_bytes]


class ReadJob:
    """One queued or running read; ``wait()`` returns the seconds the read (and the making of its form) took.

    ``form``: the held form to make from the record (None: the bytes only, as a neuron read);
    ``weights`` is what the form made, for the compute thread."""

    def __init__(self, store: ExpertStore, key: str, arena: SlotArena, slot: int, priority: int,
                 ranges: list[tuple[int, int]] | None = None, form=None) -> None:
        """ranges: (start, length) byte ranges of the record, each landing at its own place in the slot
        (a neuron read); None reads the whole record."""
        self.store, self.key, self.arena, self.slot = store, key, arena, slot
        self.priority = priority
        self.ranges = ranges
        self.form = form
        self.weights = None
        self.state = "queued"  # queued -> running -> done | failed; or queued -> cancelled
        self.seconds = 0.0
        self.make_seconds = 0.0  # of ``seconds``, the time spent making the form
        self.nbytes = 0
        self.error: BaseException | None = None
        self._done = threading.Event()

    def wait_done(self) -> None:
        """Block until the job finished, failed or was cancelled, without raising."""
        self._done.wait()

    def wait(self) -> float:
        self._done.wait()
        if self.error is not None:
            raise self.error
        if self.state == "cancelled":
            raise RuntimeError(f"read of {self.key} was cancelled and then waited on")
        return self.seconds


class Reader:
    """Worker threads serving one priority queue of reads (demand before prefetch, then first come)."""

    def __init__(self, workers: int = 2, device: torch.device | None = None, staging: SlotArena | None = None) -> None:
        """staging: one slot per worker (``workers`` of them), where reads of a made form land."""
        self.device = device or torch.device("cpu")
        self.staging = staging
        self._heap: list = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._local = threading.local()
        self.after_compute = None  # CUDA: an event the copy stream waits on before overwriting a slot
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"moeprep-read-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for thread in self._threads:
            thread.start()

    def submit(self, job: ReadJob) -> ReadJob:
        with self._cv:
            heapq.heappush(self._heap, (job.priority, next(self._order), job))
            self._cv.notify()
        return job

    def promote(self, job: ReadJob) -> None:
        """A demand now waits on a queued prefetch: serve it before other prefetches."""
        with self._cv:
            if job.state == "queued" and job.priority != DEMAND:
                job.priority = DEMAND
                heapq.heappush(self._heap, (DEMAND, next(self._order), job))  # the stale entry is skipped
                self._cv.notify()

    def cancel(self, job: ReadJob) -> bool:
        """Cancel a job not yet started; returns whether it was cancelled."""
        with self._cv:
            if job.state != "queued":
                return False
            job.state = "cancelled"
        job._done.set()
        return True

    def _work(self, index: int) -> None:
        self._local.index = index
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if self._closed and not self._heap:
                    return
                priority, _, job = heapq.heappop(self._heap)
                if job.state != "queued" or priority != job.priority:
                    continue  # cancelled, or a stale entry of a promoted job
                job.state = "running"
            try:
                start = time.perf_counter()
                job.nbytes = self._read(job)
                job.seconds = time.perf_counter() - start
                job.state = "done"
            except BaseException as e:  # handed to the waiting thread
                job.error = e
                job.state = "failed"
            job._done.set()

    def _read(self, job: ReadJob) -> int:
        if job.ranges is not None:
            return sum(self._read_range(job, job.arena, job.slot, start, length) for start, length in job.ranges)
        form = job.form
        if form is None or not form.staged:
            n = self._read_range(job, job.arena, job.slot, 0, None)
            if form is not None:
                job.weights = form.make(job.arena.tensor(job.slot, job.store.record_bytes))
            return n
        index = self._local.index
        n = self._read_range(job, self.staging, index, 0, None)
        start = time.perf_counter()
        record = self.staging.tensor(index, job.store.record_bytes)
        region = job.arena.tensor(job.slot, job.arena.slot_bytes)
        if self.staging.device.type == "cuda":
            with torch.cuda.stream(self._local.stream):
                job.weights = form.make(record, region)
                done = torch.cuda.Event()
                done.record(self._local.stream)
            done.synchronize()
        else:
            job.weights = form.make(record, region)
        job.make_seconds = time.perf_counter() - start
        return n

    def _read_range(self, job: ReadJob, arena: SlotArena, slot: int, start: int, length: int | None) -> int:
        if arena.device.type != "cuda":
            return job.store.read_into(job.key, arena.host_view(slot)[start:], start, length)
        pinned = getattr(self._local, "pinned", None)
        if pinned is None or pinned.numel() < arena.slot_bytes:
            pinned = self._local.pinned = torch.empty(arena.slot_bytes, dtype=torch.uint8, pin_memory=True)
        if getattr(self._local, "stream", None) is None:
            self._local.stream = torch.cuda.Stream(device=arena.device)
        n = job.store.read_into(job.key, memoryview(pinned.numpy()), start, length)
        stream = self._local.stream
        with torch.cuda.stream(stream):
            if self.after_compute is not None:
                stream.wait_event(self.after_compute)  # the slot's previous contents may still be in use
            arena.tensor(slot, arena.slot_bytes)[start:start + n].copy_(pinned[:n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # the pinned buffer is reused by this thread's next read
        return n

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for _, _, job in self._heap:
                if job.state == "queued":
                    job.state = "cancelled"
                    job._done.set()
            self._heap.clear()
            self._cv.notify_all()
        for thread in self._threads:
            thread.join()
