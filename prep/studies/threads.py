"""``python -m prep.studies.threads``: does a reader thread slow a decode step's expert products, and how does that
depend on torch's intra-op threads? (``loader/README.md``, "Threads", and ``loader.runtime.compute_threads``.)

One expert of the reference model's shape (H 256, I 384, float32) computes for one token, many times, on the main
thread: alone, then beside a reader thread that reads 1.2 MB records of a scratch file with O_DIRECT (plain reads
where the filesystem refuses it), checks each (none, crc32 or xxh3_64) and pauses 0.5 ms, as the loader's reader
threads do during prefetching. Printed per torch thread count and check: microseconds per expert alone and beside
the reader. The scratch file goes to ``--dir`` (default: the temp dir) and is removed.
"""

from __future__ import annotations

import argparse
import mmap
import os
import tempfile
import threading
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from xxhash import xxh3_64_intdigest

from loader.options import max_threads
from prep.studies import bounded

HIDDEN, INTER = 256, 384
RECORDS = 64


def _expert_seconds(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, n: int) -> float:
    def expert():
        gate, up = F.linear(x, w1).chunk(2, -1)
        return F.linear(F.silu(gate) * up, w2)

    for _ in range(100):
        expert()
    start = time.perf_counter()
    for _ in range(n):
        expert()
    return (time.perf_counter() - start) / n


def measure(path: Path, threads: int, check: str, n: int = 3000) -> tuple[float, float]:
    """(seconds per expert alone, beside the reader) with ``threads`` torch threads and the reader's ``check``."""
    torch.set_num_threads(threads)
    w1, w2, x = torch.randn(2 * INTER, HIDDEN), torch.randn(HIDDEN, INTER), torch.randn(1, HIDDEN)
    record = 3 * INTER * HIDDEN * 4
    stride = -(-record // 4096) * 4096
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
        buf = mmap.mmap(-1, stride)
        os.preadv(fd, [buf], 0)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        buf = mmap.mmap(-1, stride)
    stop = threading.Event()

    def reader():
        i = 0
        while not stop.is_set():
            os.preadv(fd, [buf], (i % RECORDS) * stride)
            i += 1
            if check == "crc32":
                zlib.crc32(memoryview(buf)[:record])
            elif check == "xxh3":
                xxh3_64_intdigest(memoryview(buf)[:record])
            time.sleep(0.0005)

    try:
        alone = _expert_seconds(w1, w2, x, n)
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        beside = _expert_seconds(w1, w2, x, n)
        stop.set()
        thread.join()
    finally:
        os.close(fd)
    return alone, beside


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m prep.studies.threads", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the scratch file of reads goes (default: the temp dir)")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to try (default 1,2)")
    args = parser.parse_args(argv)
    try:
        counts = [bounded(int, 1, max_threads())(t) for t in args.threads.split(",")]
    except argparse.ArgumentTypeError as e:
        parser.error(f"--threads: {e} (torch thread counts, comma-separated)")
    before = torch.get_num_threads()
    stride = -(-3 * INTER * HIDDEN * 4 // 4096) * 4096
    with tempfile.TemporaryDirectory(prefix="moeprep-threads-", dir=args.dir) as tmp:
        path = Path(tmp) / "records.bin"
        path.write_bytes(os.urandom(stride * RECORDS))
        print("| torch threads | reader's check | expert alone us | beside the reader us | ratio |")
        print("| ---: | --- | ---: | ---: | ---: |")
        for threads in counts:
            for check in ("none", "crc32", "xxh3"):
                alone, beside = measure(path, threads, check)
                print(f"| {threads} | {check} | {alone * 1e6:.0f} | {beside * 1e6:.0f} | {beside / alone:.2f}x |",
                      flush=True)
    torch.set_num_threads(before)


if __name__ == "__main__":
    main()
