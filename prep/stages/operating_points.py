"""The operating points in the report: report.md's table of the allocation's points (and the tuned policy) and its
plot, both functions of report.json (``operating_points``, ``planning``), so evaluate draws them again once it has
measured each point's accuracy. The allocate_cache stage declares the section; tune_policy and evaluate fill it."""

from __future__ import annotations

import io

from prep.report import ReportSection

PLAN_PLOT = "reports/report-plan.png"
# what report.json keeps of a point's score (``allocate_cache.score_plan``) beside the allocation
FIGURES = ("modeled_tokens_per_s", "modeled_prefill", "cost", "miss_rate", "demand_bytes_per_token")


def point_figures(scored: dict) -> dict:
    """A point's modelled figures in report.json, from its score (a refused one's are None)."""
    return {k: scored.get(k) for k in FIGURES}


def operating_points_plot(report: dict) -> bytes:
    """Modelled tokens/s and miss rate against the budget: the allocation, the plan without one, the closed
    form; each point labelled with its worst suite's accuracy delta once evaluate has measured it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = report["operating_points"]
    xs = [p["budget_bytes"] / 2**20 for p in points]
    fig, (tps_ax, miss_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label, style in (("allocated", "the plan (DP, tuned policy)", "o-"),
                              ("allocated_default_policy", "DP, default policy", "d-"),
                              ("uniform", "without allocation, default policy", "s--"),
                              ("closed_form", "closed-form DP, default policy", "^:")):
        rows = [p if key == "allocated" else p.get(key) for p in points]
        got = [(x, r) for x, r in zip(xs, rows, strict=True) if r and "cost" in r]
        if not got:
            continue
        tps = [r.get("modeled_tokens_per_s") for _, r in got]
        if all(t is not None for t in tps):
            tps_ax.plot([x for x, _ in got], tps, style, label=label)
        miss_ax.plot([x for x, _ in got], [r["miss_rate"] for _, r in got], style, label=label)
    for x, p in zip(xs, points, strict=True):
        if p.get("accuracy_delta") and p.get("modeled_tokens_per_s"):
            worst = min(p["accuracy_delta"].values()) * 100
            tps_ax.annotate(f"{worst:+.1f} pt", (x, p["modeled_tokens_per_s"]), textcoords="offset points",
                            xytext=(0, 8), ha="center", fontsize=8)
    tps_ax.set_ylabel("modelled tokens/s")
    miss_ax.set_ylabel("miss rate (calibration traces)")
    for ax in (tps_ax, miss_ax):
        ax.set_xlabel("memory budget (MiB)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return png.getvalue()


def operating_points_markdown(report: dict) -> str:
    """The operating points table (and the tuned policy) of report.md."""
    planning = report.get("planning") or {}
    unit = (planning.get("allocate_cache") or {}).get("unit", "")
    lines = ["## Operating points", "",
             f"The plan holds one cache allocation per budget (AdapMoE's DP on {unit} measured by the simulator "
             "on the calibration traces); the loader takes the point of the largest budget it is given. Records "
             "per cell follow the cells of `planning.allocate_cache.cells` in report.json. Cost is the plan's "
             "(with its tuned policy); the next three columns share the plan's default policy (per-layer LRU): "
             "the DP allocation, the same plan without an allocation (pools by expert bytes, layers equal; "
             "refused where a group would hold less than one record) and the paper's closed-form DP.", "",
             "Modelled prefill: a prompt of the calibration traces in the budget's chunks (prep/sim/prefill.py), "
             "its tokens/s and time to first token.", "",
             "| budget | share of experts | records per cell | modelled tokens/s | modelled prefill | miss rate | cost | "
             "DP, default policy | without allocation | closed form | accuracy delta |",
             "| ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]

    def cost(entry):
        return f"{entry['cost']:.4g}" if entry and entry.get("cost") is not None else "refused"

    for p in report["operating_points"]:
        tps = f"{p['modeled_tokens_per_s']:.1f}" if p.get("modeled_tokens_per_s") else "-"
        pre = p.get("modeled_prefill")
        pre = (f"{pre['tokens']} tokens: {pre['tokens_per_second']:.1f} tok/s, first token {pre['seconds']:.3g} s"
               if pre else "-")
        miss = f"{p['miss_rate']:.3f}" if p.get("miss_rate") is not None else "-"
        delta, tests = p.get("accuracy_delta"), p.get("accuracy_test") or {}
        acc = ", ".join(f"{s} {d * 100:+.1f} pt" + (f" (p {tests[s]['mcnemar_p']:.2g})" if s in tests else "")
                        for s, d in delta.items()) if delta else "not measured"
        if p.get("within_tolerance") is not None:
            acc += " (within tolerance)" if p["within_tolerance"] else " (**beyond tolerance**)"
        lines.append(f"| {p['budget_bytes'] / 2**20:.2f} MiB | {p['share']:.0%} | {p['slots']} | {tps} | {pre} | {miss} | "
                     f"{cost(p)} | {cost(p.get('allocated_default_policy'))} | {cost(p['uniform'])} | "
                     f"{cost(p['closed_form'])} | {acc} |")
    tuned = planning.get("tune_policy")
    if tuned:
        values = ", ".join(f"{k} {v:.4g}" if v is not None else f"{k} refused" for k, v in tuned["objective"].items())
        lines += ["", f"Eviction policy: {tuned['chosen']} ({tuned['eviction']['name']} "
                      f"{ {k: round(v, 3) for k, v in tuned['eviction']['params'].items()} }, group {tuned['group']}, "
                      f"prefetch depth {tuned['depth']}), searched over {tuned['trials']} trials at "
                      f"{tuned['budget_bytes'] / 2**20:.2f} MiB; {tuned['unit']}: {values}."]
    return "\n".join(lines)



OPERATING_POINTS = ReportSection(
    "operating_points", 50, lambda report: [operating_points_markdown(report), "", f"![operating points]({PLAN_PLOT})", ""]
    if report.get("operating_points") else [])
