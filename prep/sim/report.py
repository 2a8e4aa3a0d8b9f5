"""Tables and the plot of simulation results (text for the terminal, markdown for notes, a PNG).

The plot shows the miss rate against the cache capacity (experts per layer), one line per policy and
one panel per eviction group, with Belady (the clairvoyant floor) drawn dashed in black.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

from loader.io import write_bytes_atomic
from prep.sim.simulate import SimResult


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:,.1f}"


def column_label(result: SimResult, num_experts: int | None = None, num_layers: int | None = None) -> str:
    """"4/8 per layer" or "global 128 (4x32)", or "plan" for a plan's capacities."""
    if result.group == "plan" or not isinstance(result.capacity, int):
        return "plan"
    of = f"/{num_experts}" if num_experts else ""
    if result.group == "global":
        total = f"{result.capacity * num_layers} ({result.capacity}x{num_layers})" if num_layers else f"{result.capacity}xL"
        return f"global {total}"
    return f"{result.capacity}{of} per layer"


def capacity_text(result: SimResult) -> str:
    """N experts per layer, or per pool of a plan: its bytes per group and how many records that is."""
    if not isinstance(result.capacity, dict):
        return f"{result.capacity} experts ({'per layer' if result.group == 'layer' else 'per layer, one global pool'})"
    parts = []
    for pool, groups in result.capacity.items():
        sizes = set(groups.values())
        per = f"{sizes.pop():,} bytes" if len(sizes) == 1 else f"{min(groups.values()):,} to {max(groups.values()):,} bytes"
        parts.append(f"{pool}: {per} x {len(groups)} group{'s' if len(groups) > 1 else ''}")
    return "; ".join(parts) + " (plan)"


def format_result(result: SimResult) -> str:
    """One run: a summary, then one row per MoE layer."""
    head = [
        f"trace        {result.source} ({result.sequences} sequences, {result.tokens} tokens, cold start: "
        f"{'yes' if result.cold_start else 'no'})",
        f"policy       {result.policy}" + (f" {result.params}" if result.params else ""),
        f"capacity     {capacity_text(result)}",
        f"requests     {result.requests:,}",
        f"misses       {result.misses:,} ({100 * result.miss_rate:.1f}%)",
        f"bytes read   {_mb(result.bytes_read)} MB ({_mb(result.bytes_read / max(result.tokens, 1))} MB per token)",
    ]
    if result.cpu_misses is not None:
        head.append(f"on the CPU   {result.cpu_computed:,} misses computed there (cpu_misses {result.cpu_misses['mode']}"
                    + (f": {', '.join(result.cpu_misses['prefer'])}" if result.cpu_misses["prefer"] else "") + ")")
    if result.seconds is not None:
        head.append(f"modelled     {result.seconds:.3f} s ({result.seconds / max(result.tokens, 1):.4f} s per token, "
                    f"{result.profile.device})")
    timed = result.seconds is not None
    rows = [f"{'layer':>5} {'requests':>9} {'hits':>7} {'misses':>7} {'miss %':>7} {'MB read':>10}"
            + (f" {'s/token':>9}" if timed else "")]
    for layer, r in enumerate(result.layers):
        rate = 100 * r.misses / r.requests if r.requests else 0.0
        line = f"{layer:>5} {r.requests:>9} {r.hits:>7} {r.misses:>7} {rate:>7.1f} {_mb(r.bytes_read):>10}"
        if timed:
            line += f" {(r.read_seconds + r.compute_seconds) / max(result.tokens, 1):>9.4f}"
        rows.append(line)
    return "\n".join(head + [""] + rows)


def format_sweep(results: Sequence[SimResult], num_experts: int | None = None, num_layers: int | None = None,
                 seconds: bool = False) -> str:
    """A markdown table: one row per policy, one column per (group, capacity), cells the miss rate
    (and modelled seconds per token when ``seconds`` and the runs have a profile)."""
    columns = list(dict.fromkeys(column_label(r, num_experts, num_layers) for r in results))
    policies = list(dict.fromkeys(r.policy for r in results))
    cell: dict = {}
    for r in results:
        text = f"{100 * r.miss_rate:.1f}%"
        if seconds and r.seconds is not None:
            text += f" ({r.seconds / max(r.tokens, 1):.3f} s/tok)"
        cell[(r.policy, column_label(r, num_experts, num_layers))] = text
    lines = ["| policy | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for policy in policies:
        lines.append(f"| {policy} | " + " | ".join(cell.get((policy, c), "") for c in columns) + " |")
    return "\n".join(lines)


def plot_sweep(results: Sequence[SimResult], path: str | Path, title: str = "") -> Path:
    """Miss rate against capacity (experts per layer), one line per policy, a panel per group; Belady dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in results if isinstance(r.capacity, int)]
    groups = list(dict.fromkeys(r.group for r in runs)) or ["layer"]
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4), squeeze=False, sharey=True)
    for ax, group in zip(axes[0], groups, strict=True):
        policies = list(dict.fromkeys(r.policy for r in runs if r.group == group))
        for policy in policies:
            points = sorted((r.capacity, 100 * r.miss_rate) for r in runs if r.group == group and r.policy == policy)
            xs, ys = zip(*points, strict=True) if points else ((), ())
            style = {"color": "black", "linestyle": "--", "linewidth": 2} if policy == "belady" else {}
            ax.plot(xs, ys, marker="o", label=policy + (" (floor)" if policy == "belady" else ""), **style)
        ax.set_xlabel("cache capacity (experts per layer" + (", one global pool)" if group == "global" else ")"))
        ax.set_title(f"{'global' if group == 'global' else 'per-layer'} eviction group")
        ax.set_xticks(sorted({r.capacity for r in runs if r.group == group}))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("miss rate (%)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, png.getvalue())
    return path
