"""A fake GPU link for the loader's stream and event code (``loader/transfer.py``) on a machine without one.

``FakeLink`` runs the accelerated path with CPU tensors: reads go through bounce buffers or the host store's
slices, copies go onto streams, and compute waits on events. A copy is *deferred*: it runs only when an event
recorded after it is waited on or synchronized (or when later work is queued on its stream, which runs in
order). So a compute that forgets to wait for its read computes on stale bytes, and a reader that refills a
bounce buffer before its last copy has run corrupts that copy: both show up as wrong logits.

It also counts host synchronizations by thread, so a test can assert the compute thread never blocks on a copy.
"""

from __future__ import annotations

import contextlib
import mmap
import threading

import torch


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.ops: list = []  # queued callables, run in order
        self.ran = 0  # how many of ``ops`` have run


class FakeEvent:
    def __init__(self, stream: FakeStream | None, position: int) -> None:
        self.stream, self.position = stream, position  # stream None: the compute stream (always complete)


class FakeLink:
    accelerated = True

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.streams: list[FakeStream] = []
        self.copies = 0
        self.waits = 0
        self.syncs_by_thread: dict[str, int] = {}
        self._buffers: list = []

    def pinned(self, nbytes: int) -> torch.Tensor:
        """Page-aligned, as pinned CUDA memory is (an O_DIRECT read lands in it)."""
        buffer = mmap.mmap(-1, nbytes)
        self._buffers.append(buffer)
        return torch.frombuffer(buffer, dtype=torch.uint8)

    def stream(self) -> FakeStream:
        with self._lock:
            stream = FakeStream(f"copy-{len(self.streams)}")
            self.streams.append(stream)
            return stream

    def _run(self, stream: FakeStream | None, upto: int | None = None) -> None:
        if stream is None:
            return
        with self._lock:
            end = len(stream.ops) if upto is None else upto
            while stream.ran < end:
                op = stream.ops[stream.ran]
                stream.ran += 1
                op()

    @contextlib.contextmanager
    def on(self, stream):
        self._run(stream)  # work issued on the stream runs after what was queued before it
        yield

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with self._lock:
            self.copies += 1
            stream.ops.append(lambda: dst.copy_(src))

    def event(self, stream=None) -> FakeEvent:
        with self._lock:
            return FakeEvent(stream, len(stream.ops) if stream is not None else 0)

    def wait(self, event, stream=None) -> None:
        if event is None:
            return
        self.waits += 1
        if stream is None:  # the compute stream waits: what the event covers has run before compute goes on
            self._run(event.stream, event.position)
        # a copy stream waiting on the compute stream: compute here is synchronous, nothing to do

    def synchronize(self, event) -> None:
        if event is None:
            return
        name = threading.current_thread().name
        with self._lock:
            self.syncs_by_thread[name] = self.syncs_by_thread.get(name, 0) + 1
        self._run(event.stream, event.position)

    def compute_thread_syncs(self) -> int:
        """Host synchronizations made outside the reader threads."""
        return sum(n for name, n in self.syncs_by_thread.items() if not name.startswith("moeprep-read-"))
