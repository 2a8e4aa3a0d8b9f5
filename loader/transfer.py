"""How expert bytes reach an accelerator: copies on the readers' own streams, ordered against compute by events.

On a CPU the slots are host memory and a read lands in place (``HostLink``: no streams, no copies). On a GPU
(``CudaLink``) a reader thread copies a record into a device slot on its own stream, makes the held form on
that stream, and records an event; the compute stream waits on that event before it computes the expert, so
the compute thread never blocks the host on a copy. The copy stream in turn waits on the compute stream's
last mark before it overwrites a slot whose old contents queued kernels may still read.

Every stream and event operation of the loader goes through a link, so the same code runs against a fake
in the tests (``tests/helpers/loader_fakes.py``): one that defers each copy until an event says it is needed, so a
missing wait shows up as wrong output on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch


class Link(Protocol):
    """The stream and event operations the loader uses. ``accelerated``: slots live apart from host memory,
    so reads go through pinned host memory and a copy."""

    accelerated: bool

    def pinned(self, nbytes: int) -> torch.Tensor: ...

    def stream(self): ...

    def on(self, stream): ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None: ...

    def event(self, stream=None): ...

    def wait(self, event, stream=None) -> None: ...

    def synchronize(self, event) -> None: ...


class HostLink:
    """A CPU: reads land in the slots themselves; nothing to order."""

    accelerated = False

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def stream(self):
        return None

    def on(self, stream):
        return contextlib.nullcontext()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        dst.copy_(src)

    def event(self, stream=None):
        return None

    def wait(self, event, stream=None) -> None:
        pass

    def synchronize(self, event) -> None:
        pass


class CudaLink:
    """One CUDA device: pinned host buffers, side streams, events. ``stream=None`` means the compute stream
    (the current stream of the calling thread)."""

    accelerated = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def stream(self):
        return torch.cuda.Stream(device=self.device)

    def on(self, stream):
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def event(self, stream=None):
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, event, stream=None) -> None:
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)).wait_event(event)

    def synchronize(self, event) -> None:
        if event is not None:
            event.synchronize()


def link_for(device: torch.device) -> Link:
    """The link of a device: CUDA streams and events on a GPU, in-place reads on a CPU."""
    return CudaLink(device) if device.type == "cuda" else HostLink()
