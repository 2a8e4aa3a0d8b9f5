"""``--memory-budget auto``: the largest budget that fits the memory free for this process.

Free memory is read where the kernel enforces it:

- on a GPU, the device's free memory (``torch.cuda.mem_get_info``);
- else the memory cgroup this process runs in, where it has a limit: the limit less what the cgroup uses now,
  page cache excepted (reclaimable: the kernel drops it before it kills), the smallest such room over the cgroup and
  its ancestors (cgroup v2 ``memory.max``/``memory.current``, v1 ``memory.limit_in_bytes``/``memory.usage_in_bytes``);
- and ``MemAvailable`` of ``/proc/meminfo`` (the smaller of the two where both exist).

The budget is that free memory less a margin for the process itself, which the budget does not count: the KV cache,
transformers' and torch's allocations while a forward runs, the tokenizer. ``MARGIN_BYTES`` plus ``MARGIN_SHARE`` of the
free memory; ``moeload plan --memory-budget auto`` and ``generate`` print the numbers and their source.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loader.errors import BudgetError

MARGIN_BYTES = 384 << 20  # the runtime beside the budget: KV cache, a forward's temporaries, the tokenizer
MARGIN_SHARE = 0.10  # and a tenth of what is free, for what grows with it (allocator slack, page tables)
CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
SELF_CGROUP = Path("/proc/self/cgroup")
_NO_LIMIT = 1 << 60  # v1 writes "no limit" as a number near 2**63


@dataclass(frozen=True)
class FreeMemory:
    """Bytes free for this process and where the number came from (printed beside the budget)."""

    bytes: int
    source: str


@dataclass(frozen=True)
class AutoBudget:
    """What ``auto`` chose: the budget, the free memory it came from and the margin kept for the process."""

    budget_bytes: int
    free: FreeMemory
    margin_bytes: int

    def describe(self) -> str:
        return (f"memory budget auto: {self.budget_bytes:,} bytes ({self.budget_bytes / 2**30:.2f} GiB) = "
                f"{self.free.bytes:,} bytes free ({self.free.source}) less a margin of {self.margin_bytes:,} bytes "
                "for the process itself")

    def to_json(self) -> dict:
        return {"budget_bytes": self.budget_bytes, "free_bytes": self.free.bytes, "source": self.free.source,
                "margin_bytes": self.margin_bytes}


def is_auto(budget) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == "auto"


def margin(free_bytes: int) -> int:
    return MARGIN_BYTES + int(MARGIN_SHARE * free_bytes)


def auto_budget(device: str = "cpu") -> AutoBudget:
    """The budget ``auto`` means here and now (from ``CGROUP_ROOT``, ``MEMINFO`` and ``SELF_CGROUP``, read when called:
    a test points them at fakes)."""
    free = free_memory(device, CGROUP_ROOT, MEMINFO, SELF_CGROUP)
    keep = margin(free.bytes)
    if free.bytes <= keep:
        raise BudgetError(f"memory budget auto: only {free.bytes:,} bytes are free ({free.source}), not more than the "
                          f"margin of {keep:,} bytes the process itself needs; free memory, raise the limit, or give "
                          "--memory-budget in bytes")
    return AutoBudget(free.bytes - keep, free, keep)


def free_memory(device: str = "cpu", cgroup_root: Path = CGROUP_ROOT, meminfo: Path = MEMINFO,
                self_cgroup: Path = SELF_CGROUP) -> FreeMemory:
    if str(device).startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return FreeMemory(int(free), f"{device}: {free:,} of {total:,} bytes free")
    found = [f for f in (cgroup_free(cgroup_root, self_cgroup), available_ram(meminfo)) if f is not None]
    if not found:
        raise BudgetError(f"memory budget auto: neither a memory cgroup limit nor {meminfo} could be read here; give "
                          "--memory-budget in bytes or as a share like 25%")
    return min(found, key=lambda f: f.bytes)


def available_ram(meminfo: Path = MEMINFO) -> FreeMemory | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            key, _, value = line.partition(":")
            if key == "MemAvailable":
                number, *unit = value.split()
                return FreeMemory(int(number) * (1024 if unit == ["kB"] else 1), f"MemAvailable of {meminfo}")
    except (OSError, ValueError):
        return None
    return None


def cgroup_free(cgroup_root: Path = CGROUP_ROOT, self_cgroup: Path = SELF_CGROUP) -> FreeMemory | None:
    """The smallest room under a memory limit over this process's cgroup and its ancestors; None without a limit."""
    best = None
    for directory, version in _cgroup_dirs(Path(cgroup_root), Path(self_cgroup)):
        room = _room(directory, version)
        if room is not None and (best is None or room.bytes < best.bytes):
            best = room
    return best


def _cgroup_dirs(root: Path, self_cgroup: Path) -> list[tuple[Path, int]]:
    """The cgroup directories that hold this process's memory limits, innermost first."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and (root / "cgroup.controllers").exists():
            base, version = root, 2
        elif "memory" in controllers.split(","):
            base, version = root / "memory", 1
        else:
            continue
        leaf = base / path.lstrip("/")
        if not leaf.is_dir():  # a cgroup namespace: the mount is this process's own cgroup
            leaf = base
        while True:
            out.append((leaf, version))
            if leaf == base or base not in leaf.parents:
                break
            leaf = leaf.parent
    return out


def _room(directory: Path, version: int) -> FreeMemory | None:
    limit_file, usage_file = (("memory.max", "memory.current") if version == 2
                              else ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    try:
        text = (directory / limit_file).read_text().strip()
        if text == "max" or int(text) >= _NO_LIMIT:
            return None
        limit, usage = int(text), int((directory / usage_file).read_text().strip())
    except (OSError, ValueError):
        return None
    cache = _stat(directory / "memory.stat", "file" if version == 2 else "cache")
    used = max(0, usage - cache)
    return FreeMemory(max(0, limit - used), f"cgroup {directory}: limit {limit:,} bytes, {used:,} in use "
                                            "besides page cache")


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0
