"""Expert stores and the reader: where a miss or a prefetch reads a record from, and into what.

One ``ExpertStore`` per precision (``experts-<precision>.safetensors``). ``disk`` mode reads the
artifact file with positioned reads that bypass the page cache (O_DIRECT when the filesystem allows
it, else plain reads followed by ``posix_fadvise(DONTNEED)``), so a miss costs what it costs on a
device reading from flash; ``host`` mode reads the whole store into RAM once at load (pinned memory on
a GPU, so a miss is one asynchronous copy straight from it) and checks each record's xxh3_64 the first time
it is used; the runtime reports those bytes beside the budget.

Records land in memory allocated once (``SlotArena``: page-aligned, so O_DIRECT reads straight into
it): the caches' slots, the read buffers, and one staging buffer per reader thread. No read allocates. A
job with a held form that is made (``loader/forms.py``) reads into its thread's staging buffer, and the
same thread makes the form into the target slot: the compute thread never decodes. A job of the record
form reads into the target slot directly. On a GPU (``loader/transfer.py``) the reader copies to the device
on its own stream (from the pinned host store, or from one of its two pinned bounce buffers after a disk
read), makes the form on that stream, and hands the compute thread an event to wait on (``ReadJob.ready``):
no host synchronization per expert.

``Reader`` runs the reads on worker threads from one priority queue: demand reads before queued
prefetch reads; a queued prefetch can be cancelled, and a demand for a queued prefetch promotes it.
Every full-record read is checked against the record's xxh3_64 from the manifest (``check``).
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
from xxhash import xxh3_64_intdigest

from loader.errors import PREPARE_AGAIN, ArtifactError
from loader.hashing import BLOCK
from loader.io import read_record_offsets
from loader.transfer import Link, link_for

DEMAND, PREFETCH = 0, 1


class ExpertStore:
    """Read-only access to the records of one ``experts-<precision>.safetensors`` file."""

    def __init__(self, path: str | Path, precision: str, mode: str = "disk",
                 check: Callable[[str, memoryview], None] | None = None, pinned: bool = False,
                 blocks: tuple[dict, object] | None = None) -> None:
        """check(key, data): raises when a full record read does not match the manifest (its xxh3_64).
        pinned: host mode holds the store in page-locked memory (a GPU's copies then run asynchronously).
        blocks: a neuron store's (record key -> row, uint64 [records, blocks]) xxh3 hash of every 4 KiB block
        (``loader.hashing.read_block_table``): its partial reads cover whole blocks, each checked."""
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
        self._checked: set = set()  # host mode: records (and blocks) whose hash matched (private RAM: once is enough)
        self.block_rows, self.blocks = blocks if blocks is not None else (None, None)
        self.check_seconds = 0.0  # spent checking the blocks of partial reads
        # whole-record reads from the disk: how many, the seconds in the read calls and in checking their hashes
        # (the reader threads add to them; a float add under the GIL loses nothing)
        self.records_read = 0
        self.read_seconds = 0.0
        self.record_check_seconds = 0.0
        self._fd = -1
        self._plain_fd = -1
        if mode == "host":
            self._host = self._read_whole(pinned)
        else:
            self._fd, self.direct_io = self._open()
            self._plain_fd = os.open(self.path, os.O_RDONLY) if self.direct_io else self._fd

    @property
    def host_bytes(self) -> int:
        """Bytes this store holds in RAM (the whole file in host mode)."""
        return self.size if self._host is not None else 0

    def _read_whole(self, pinned: bool) -> torch.Tensor:
        """The whole file in (pinned) host memory: a private copy, so a later change of the file is not seen."""
        data = torch.empty(self.size, dtype=torch.uint8, pin_memory=pinned)
        view = memoryview(data.numpy())
        with open(self.path, "rb") as f:
            done = 0
            while done < self.size:
                n = f.readinto(view[done:])
                if not n:
                    raise ArtifactError(f"{self.path.name} shrank while it was read ({done} of {self.size} bytes); "
                                        "copy the artifact again or rerun `moeprep prepare`")
                done += n
        return data

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
        """The byte ranges a read of ``ranges`` of one record actually fetches: with O_DIRECT, or with block
        checksums (a neuron store: each block read is checked), each widened to whole 4 KiB blocks (clipped to the
        record) and merged where they touch, so a dense set of small ranges is a few large reads; otherwise the
        ranges themselves."""
        if not self.direct_io and self.blocks is None:
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
        number of useful bytes. A full-record read is checked against the manifest's xxh3_64."""
        length = self.record_bytes - start if length is None else length
        if start < 0 or length <= 0 or start + length > self.record_bytes:
            raise ArtifactError(f"byte range [{start}, {start + length}) is outside the {self.record_bytes}-byte "
                                f"records of {self.path.name}")
        offset = self.offset(key) + start
        if self._host is not None:
            if start == 0 and length == self.record_bytes:
                self.host_record(key)  # checked the first time
            else:
                self._check_blocks(key, memoryview(self._host.numpy())[offset:offset + length], start, once=True)
            dest[:length] = memoryview(self._host.numpy())[offset:offset + length]
            return length
        began = time.perf_counter()
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
        if start == 0 and length == self.record_bytes:
            read = time.perf_counter()
            if self.check is not None:
                self.check(key, dest[:length])
            self.records_read += 1
            self.read_seconds += read - began
            self.record_check_seconds += time.perf_counter() - read
        else:
            self._check_blocks(key, dest[:length], start)
        return length

    def _check_blocks(self, key: str, data: memoryview, start: int, once: bool = False) -> None:
        """A partial read of record ``key`` (``data``, from byte ``start``) against its blocks' hashes; the read
        must cover whole blocks (``spans``). ``once``: host RAM, each block is checked the first time only."""
        if self.blocks is None:
            return
        began = time.perf_counter()
        if start % BLOCK or (start + data.nbytes != self.record_bytes and data.nbytes % BLOCK):
            raise ArtifactError(f"{self.path.name}: a partial read of {key} at [{start}, {start + data.nbytes}) does "
                                "not cover whole 4 KiB blocks, so it cannot be checked; read the spans the store gives")
        first = start // BLOCK
        if once:
            fresh = [b for b in range(first, first + -(-data.nbytes // BLOCK)) if (key, b) not in self._checked]
            if not fresh:
                return
        got = [xxh3_64_intdigest(data[i:i + BLOCK]) for i in range(0, data.nbytes, BLOCK)]
        want = self.blocks[self.block_rows[key], first:first + len(got)].tolist()
        if got != want:
            block = first + next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
            raise ArtifactError(f"record {key} of {self.path} is damaged in its 4 KiB block {block} (its hash "
                                f"differs from the block table); {PREPARE_AGAIN}", file=self.path.name)
        if once:
            self._checked.update((key, b) for b in fresh)
        self.check_seconds += time.perf_counter() - began

    def host_record(self, key: str) -> torch.Tensor | None:
        """Record ``key`` as a view of the host copy (host mode; None on disk), checked against its xxh3_64 the
        first time."""
        if self._host is None:
            return None
        offset = self.offset(key)
        record = self._host[offset:offset + self.record_bytes]
        if self.check is not None and key not in self._checked:
            self.check(key, memoryview(record.numpy()))
            self._checked.add(key)
        return record

    def host_slice(self, key: str, start: int = 0, length: int | None = None) -> torch.Tensor | None:
        """Bytes [start, start + length) of record ``key`` in the host copy (host mode; None on disk); a whole
        record is checked against its xxh3_64 the first time."""
        if self._host is None:
            return None
        length = self.record_bytes - start if length is None else length
        if start < 0 or length <= 0 or start + length > self.record_bytes:
            raise ArtifactError(f"byte range [{start}, {start + length}) is outside the {self.record_bytes}-byte "
                                f"records of {self.path.name}")
        record = self.host_record(key) if start == 0 and length == self.record_bytes else None
        if record is not None:
            return record
        offset = self.offset(key) + start
        part = self._host[offset:offset + length]
        self._check_blocks(key, memoryview(part.numpy()), start, once=True)
        return part

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
    ``weights`` is what the form made, for the compute thread; ``ready``: on a GPU, the event the compute
    stream waits on before it uses the slot (the copy and the making are queued, not finished, when the job is
    done)."""

    def __init__(self, store: ExpertStore, key: str, into: tuple[SlotArena, int], priority: int,
                 ranges: list[tuple[int, int]] | None = None, form=None) -> None:
        """into: the arena and the slot of it the record lands in. ranges: (start, length) byte ranges of the
        record, each landing at its own place in the slot (a neuron read); None reads the whole record."""
        self.store, self.key = store, key
        self.arena, self.slot = into
        self.priority = priority
        self.ranges = ranges
        self.form = form
        self.weights = None
        self.ready = None
        self.state = "queued"  # queued -> running -> done | failed; or queued -> cancelled
        self.seconds = 0.0
        self.make_seconds = 0.0  # of ``seconds``, the time spent making the form (on a GPU: queueing it)
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

    def __init__(self, workers: int = 2, device: torch.device | None = None, staging: SlotArena | None = None,
                 link: Link | None = None) -> None:
        """staging: one slot per worker (``workers`` of them), where reads of a made form land. link: how bytes
        reach the device (``loader/transfer.py``; by default the device's own)."""
        self.device = device or torch.device("cpu")
        self.link = link if link is not None else link_for(self.device)
        self.staging = staging
        self._heap: list = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._closed = False
        self._local = threading.local()
        self.after_compute = None  # GPU: an event the copy streams wait on before overwriting a slot
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
        link = self.link
        if job.ranges is not None:
            n = sum(self._read_range(job, job.arena, job.slot, start, length) for start, length in job.ranges)
            job.ready = link.event(self._stream())
            return n
        form = job.form
        if form is None or not form.staged:
            n = self._read_range(job, job.arena, job.slot, 0, None)
            if form is not None:
                job.weights = form.make(job.arena.tensor(job.slot, job.store.record_bytes))
            job.ready = link.event(self._stream())
            return n
        index = self._local.index
        n = self._read_range(job, self.staging, index, 0, None)
        start = time.perf_counter()
        record = self.staging.tensor(index, job.store.record_bytes)
        region = job.arena.tensor(job.slot, job.arena.slot_bytes)
        stream = self._stream()
        with link.on(stream):  # after the copy into staging on the same stream; the next copy queues after it
            job.weights = form.make(record, region)
        job.ready = link.event(stream)
        job.make_seconds = time.perf_counter() - start
        return n

    def _stream(self):
        """This reader thread's copy stream (None on a CPU)."""
        if not hasattr(self._local, "stream"):
            self._local.stream = self.link.stream()
        return self._local.stream

    def _bounce(self, nbytes: int) -> torch.Tensor:
        """The next of this thread's two pinned bounce buffers for a disk read, once its last copy has finished
        (the other one's copy may still run while the disk fills this one)."""
        local = self._local
        if not hasattr(local, "bounce"):
            local.bounce, local.bounce_done, local.turn = [None, None], [None, None], 0
        local.turn ^= 1
        turn = local.turn
        self.link.synchronize(local.bounce_done[turn])
        local.bounce_done[turn] = None
        if local.bounce[turn] is None or local.bounce[turn].numel() < nbytes:
            local.bounce[turn] = self.link.pinned(nbytes)
        return local.bounce[turn]

    def _read_range(self, job: ReadJob, arena: SlotArena, slot: int, start: int, length: int | None) -> int:
        link = self.link
        if not link.accelerated:
            return job.store.read_into(job.key, arena.host_view(slot)[start:], start, length)
        stream = self._stream()
        link.wait(self.after_compute, stream)  # the slot's previous contents may still be read by queued compute
        target = arena.tensor(slot, arena.slot_bytes)
        source = job.store.host_slice(job.key, start, length)  # the pinned host store: one copy, no bounce
        if source is not None:
            link.copy(target[start:start + source.numel()], source, stream)
            return source.numel()
        bounce = self._bounce(arena.slot_bytes)
        n = job.store.read_into(job.key, memoryview(bounce.numpy()), start, length)
        link.copy(target[start:start + n], bounce[:n], stream)
        self._local.bounce_done[self._local.turn] = link.event(stream)
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
