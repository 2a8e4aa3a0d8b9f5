"""Expert stores: where a cache miss reads one expert's packed record from.

``disk``: positioned reads of the artifact file on worker threads. Reads bypass the page cache
(O_DIRECT into a 4 KiB-aligned buffer; where the filesystem refuses O_DIRECT, plain reads followed by
``posix_fadvise(DONTNEED)``), so a miss costs what it costs on a device reading from flash.
``host``: the whole store held in RAM (pinned when the device is CUDA), a miss is one copy.

Either way a read returns the record as a uint8 tensor on the compute device.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from loader.format import ArtifactError, read_record_offsets


class ExpertStore:
    """Read-only access to the records of one ``experts-<precision>.safetensors`` file."""

    def __init__(self, path: str | Path, mode: str = "disk", device: str | torch.device = "cpu",
                 workers: int = 2) -> None:
        if mode not in ("disk", "host"):
            raise ArtifactError(f"store mode {mode!r} unknown; use 'disk' or 'host'")
        self.path = Path(path)
        self.mode = mode
        self.device = torch.device(device)
        self.offsets, self.record_bytes, self.stride = read_record_offsets(self.path)
        size = self.path.stat().st_size
        end = max(self.offsets.values(), default=0) + self.stride
        if size < end:
            raise ArtifactError(
                f"{self.path.name} is truncated: {size} bytes, its records need {end}. "
                "Copy the artifact again or rerun `moeprep prepare`"
            )
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moeprep-read")
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.read_seconds = 0.0
        self.direct_io = False
        self._host: torch.Tensor | None = None
        if mode == "host":
            data = torch.from_file(str(self.path), shared=False, size=size, dtype=torch.uint8)
            self._host = data.pin_memory() if self.device.type == "cuda" else data
        else:
            self._fd, self.direct_io = self._open()

    def _open(self) -> tuple[int, bool]:
        flag = getattr(os, "O_DIRECT", 0)
        if flag:
            try:
                fd = os.open(self.path, os.O_RDONLY | flag)
                buf = mmap.mmap(-1, self.stride)
                os.preadv(fd, [buf], next(iter(self.offsets.values()), 0))  # the filesystem may refuse here
                buf.close()
                return fd, True
            except OSError:
                try:
                    os.close(fd)
                except (OSError, UnboundLocalError):
                    pass
        return os.open(self.path, os.O_RDONLY), False

    def _buffer(self) -> mmap.mmap:
        buf = getattr(self._local, "buf", None)
        if buf is None:
            buf = mmap.mmap(-1, self.stride)  # page-aligned, as O_DIRECT needs
            self._local.buf = buf
        return buf

    def read(self, key: str) -> torch.Tensor:
        """The record ``key`` (``layers.{l}.experts.{e}``) as a uint8 tensor on the store's device."""
        try:
            offset = self.offsets[key]
        except KeyError:
            raise ArtifactError(f"{self.path.name} has no record {key}; the artifact is incomplete") from None
        start = time.perf_counter()
        if self._host is not None:
            record = self._to_device(self._host[offset : offset + self.record_bytes])
        else:
            buf = self._buffer()
            n = os.preadv(self._fd, [buf], offset)
            if n < self.record_bytes:
                raise ArtifactError(f"{self.path.name}: short read at {key}; the file is truncated")
            if not self.direct_io and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd, offset, self.stride, os.POSIX_FADV_DONTNEED)
            host = torch.frombuffer(buf, dtype=torch.uint8, count=self.record_bytes)
            if self.device.type == "cuda":
                staged = torch.empty(self.record_bytes, dtype=torch.uint8, pin_memory=True)
                record = self._to_device(staged.copy_(host))
            else:
                record = host.clone()
        with self._lock:
            self.bytes_read += self.record_bytes
            self.read_seconds += time.perf_counter() - start
        return record

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """Copy a (pinned) host record to the device on this thread's own stream, and wait for it there.

        The wait blocks the reader thread, not the compute stream, so copies overlap compute.
        """
        if self.device.type != "cuda":
            return host
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(device=self.device)
        with torch.cuda.stream(stream):
            record = host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        record.record_stream(torch.cuda.default_stream(self.device))  # compute uses it there
        return record

    def read_timed(self, key: str) -> tuple[torch.Tensor, float]:
        """``read`` plus the seconds it took (on the calling thread)."""
        start = time.perf_counter()
        record = self.read(key)
        return record, time.perf_counter() - start

    def submit(self, key: str) -> Future:
        """Read ``key`` on a worker thread; the future gives (record, seconds)."""
        return self._pool.submit(self.read_timed, key)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self._host is None:
            os.close(self._fd)
