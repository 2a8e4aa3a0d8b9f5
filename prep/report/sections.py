"""The markdown (and plot) of the report sections the stages write: prediction, operating points, neuron-level
loading. Functions of report.json's data only, so the report can be rendered again whenever a section changes
(evaluate fills the operating points' accuracy after packaging)."""

from __future__ import annotations

import io

PLAN_PLOT = "reports/report-plan.png"


def _recall_key(row: dict) -> str:
    return next(k for k in row if k.endswith("_recall"))


def prediction_markdown(prediction: dict) -> str:
    """The report.md section of the predict stage's figures (report.json ``prediction``)."""
    seqs = prediction["sequences"]
    lines = ["## Prediction", "",
             f"Predictors in the plan: {', '.join(prediction['predictors'])}. Measured on the last "
             f"{seqs['held_out']} calibration sequences ({seqs['tokens_held_out']} tokens), never fitted on; "
             f"the baseline ranks each layer's experts by their frequency in the other {seqs['fitted']}.", ""]
    gates = prediction["next_gates"]
    if gates["layers"]:
        key = _recall_key(gates["layers"][0]["gate"])
        k = key.removeprefix("top").removesuffix("_recall")
        lines += ["Next-layer gates (layer l+d's router on layer l's router input), mean over layers:", "",
                  f"| distance | top-1 | top-{k} recall | marginal top-1 | marginal top-{k} recall |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for d, m in gates["by_distance"].items():
            lines.append(f"| {d} | {m['gate']['top1']:.3f} | {m['gate'][key]:.3f} | {m['marginal']['top1']:.3f} | "
                         f"{m['marginal'][key]:.3f} |")
        lines += ["", "Per layer and distance:", "",
                  f"| layer | d | target | top-1 | top-{k} recall | marginal top-1 | marginal top-{k} recall |",
                  "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in gates["layers"]:
            lines.append(f"| {r['layer']} | {r['distance']} | {r['target']} | {r['gate']['top1']:.3f} | "
                         f"{r['gate'][key]:.3f} | {r['marginal']['top1']:.3f} | {r['marginal'][key]:.3f} |")
        lines.append("")
    path = prediction["path_stats"]
    if path["layers"]:
        key = _recall_key(path["layers"][0]["path"])
        k = key.removeprefix("top").removesuffix("_recall")
        lines += ["Path statistics P(E_l | E_l-2, E_l-1) with backoff, per layer:", "",
                  f"| layer | top-1 | top-{k} recall | marginal top-1 | marginal top-{k} recall | answered by "
                  "full key / previous layer / marginal |", "| ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in path["layers"]:
            t = r["tables"]
            lines.append(f"| {r['layer']} | {r['path']['top1']:.3f} | {r['path'][key]:.3f} | "
                         f"{r['marginal']['top1']:.3f} | {r['marginal'][key]:.3f} | "
                         f"{t['prev2']:.2f} / {t['prev1']:.2f} / {t['marginal']:.2f} |")
        lines.append("")
    first = prediction.get("first_gate")
    if first:
        held, base = first["held_out"], first["marginal"]
        key = _recall_key(held)
        lines += [f"First-layer gate (init {first['init']}, {first['epochs']} epochs, best {first['best_epoch']}; "
                  f"{first['pairs']['train']} training pairs, {first['pairs']['held_out']} held out): "
                  f"KL {held['kl']:.4f}, top-1 {held['top1']:.3f}, {key.replace('_', ' ')} {held[key]:.3f}; the "
                  f"marginal: KL {base['kl']:.4f}, top-1 {base['top1']:.3f}, {key.replace('_', ' ')} {base[key]:.3f}.", ""]
    return "\n".join(lines)


def neuron_markdown(neuron: dict) -> str:
    """report.md's neuron-level loading section: the stage's theta, crossover and profile, and the study's
    table when one was merged in."""
    profile = neuron["profile"]
    lines = ["## Neuron-level loading (CORM)", "",
             f"theta {neuron['theta']:g}, crossover {neuron['crossover']:.0%} of the neurons"
             + (" (measured on the preparing machine's disk)" if neuron.get("crossover_measured") else " (given)")
             + f", compute {neuron['knobs']['compute']}, predictor {'on' if neuron['predictor'] else 'off'}"
             + (f"; theta trail (theta, KL): {neuron['trail']}" if neuron.get("trail") else "") + ".", "",
             "Share of the selected experts' neurons active (|act(W1 x)| > theta) on the calibration traces:", "",
             "| theta | " + " | ".join(f"layer {i}" for i in range(len(profile["layers"]))) + " | mean |",
             "| ---: | " + " | ".join("---:" for _ in profile["layers"]) + " | ---: |"]
    for i, theta in enumerate(profile["thetas"]):
        lines.append(f"| {theta:g} | " + " | ".join(f"{row[i]:.3f}" for row in profile["layers"])
                     + f" | {profile['mean'][i]:.3f} |")
    if neuron.get("study"):
        lines += ["", neuron["study"]["markdown"]]
    return "\n".join(lines)


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


def accuracy_markdown(report: dict) -> str:
    """The accuracy check (report.json ``eval``) as a paired test per suite: the delta, McNemar's p on the flips,
    the tolerance (the plan's, points per suite) and what the suite can resolve (``prep.evals.power``)."""
    from prep.evals.power import paired_verdict

    check = report["eval"]
    tolerance = (report.get("planning") or {}).get("tolerance")
    lines = ["## Accuracy check", "",
             f"The prepared model through the loader (budget {check.get('memory_budget') or 'the plan default'}) "
             "against its original, item by item on the same prompts. A suite of n items moves 100/n points per "
             "item; McNemar's exact test on the flips says whether a delta is more than noise; the last column is "
             "how many items would resolve a one-point difference (alpha 0.05, power 0.8) at the flip rate measured "
             "here. " + (f"Tolerance: |delta| <= {tolerance:g} points per suite." if tolerance is not None
                         else "No tolerance is stated (plan.tolerance)."), "",
             "| suite | n | points per item | delta (points) | right->wrong | wrong->right | McNemar p | within "
             "tolerance | items to resolve 1 point |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for name, s in check["suites"].items():
        t = paired_verdict(s["delta"], s["flips"], s["n"], s["mcnemar_p"], tolerance)
        within = "-" if t["within_tolerance"] is None else ("yes" if t["within_tolerance"] else "**no**")
        lines.append(f"| {name} | {s['n']} | {t['resolution_points']:.2f} | {t['delta_points']:+.2f} | "
                     f"{s['flips']['right_to_wrong']} | {s['flips']['wrong_to_right']} | {s['mcnemar_p']:.3g} | "
                     f"{within} | {t['items_for_one_point'] if t['items_for_one_point'] is not None else 'no flips'} |")
    return "\n".join(lines)


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
        return f"{entry['cost']:.4g}" if entry and "cost" in entry else "refused"

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
