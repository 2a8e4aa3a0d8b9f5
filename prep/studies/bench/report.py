"""The bench's human outputs: ``bench.md`` (tables with ratios) and ``bench.png`` (tokens/s against budget).

Ratios are the point (absolute times only hold on the machine that made them): each row's decode speed
divided by the resident ceiling's (the fastest resident candidate: its table lists them all) and by
accelerate's at the same budget. Loader rows also give the loader's own overhead per MoE layer step, the
simulator's modelled speed beside the measured one (and their ratio), and the fraction of the bound (the
compute floor of the same artifact at budget ``unlimited`` against Belady's I/O floor).
"""

from __future__ import annotations

import io
from pathlib import Path

from loader.io import write_bytes_atomic
from prep.studies.bench.kernels import kernel_lines

TECHNIQUE_ORDER = ("int4", "int4+gating", "int4+dynamic_precision", "int4+path_stats", "int4+allocation")
SYSTEM_ORDER = ("resident", "accelerate", "naive@unlimited", "moeprep@unlimited", "naive", "naive+neuron",
                "naive+next_gates", "naive+path_stats", "naive+first_gate", "naive+neuron_gates", *TECHNIQUE_ORDER,
                "moeprep", "moeprep+tuned", "llama.cpp")
# What the papers report for each technique's accuracy at the setting the techniques subject runs (their own
# models and suites; cited, not measured here: mixtral-shape's weights are random)
CITED_ACCURACY = {
    "int4+gating": "AdapMoE's own log (PKU-SEC-Lab/AdapMoE) for Mixtral-8x7B at T = 0.005: MMLU 5-shot 69.44% "
                   "against 69.38% without gating, 25.8% of decisions single-expert",
    "int4+dynamic_precision": "HOBBIT section 5.3 and Table 3 (Mixtral-8x7B and Phi-MoE, T1 = 0.6, T2 = 0.9: "
                              "67% high, 30% low, 3% skipped, the split used here): GSM8K and TruthfulQA "
                              "\"decrease by no more than 1%\"",
    "int4+path_stats": "EdgeMoE's path-statistics preloading changes when reads land, never an output: lossless",
    "int4+allocation": "AdapMoE's DP cache allocation and HOBBIT's tuned eviction are cache decisions: lossless",
}


def _per_miss(parts: dict | None) -> str:
    """A miss's read / check / make milliseconds on the reader threads ("-" without whole-record reads)."""
    if not parts:
        return "-"
    return " / ".join(f"{parts[k]:.2f}" for k in ("read", "check", "make"))


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ratio(a, b) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _rows(report: dict, subject: str) -> list[dict]:
    return [r for r in report["results"] if r["subject"] == subject]


def _speed(report: dict, subject: str, system: str, budget: str):
    row = next((r for r in _rows(report, subject) if r["system"] == system and r["budget"] == budget), None)
    return (row or {}).get("decode_tokens_per_s")


def _field(report: dict, subject: str, system: str, budget: str, key: str):
    row = next((r for r in _rows(report, subject) if r["system"] == system and r["budget"] == budget), None)
    return (row or {}).get(key)


def _runs_saved(report: dict, subject: str, system: str, budget: str):
    """The share of expert runs the routing policy dropped in a row's decode steps (None: not measured)."""
    gating = ((_field(report, subject, system, budget, "decisions") or {}).get("routing") or {})
    return 1 - gating["runs_after"] / gating["runs_before"] if gating.get("runs_before") else None


def goal_check(report: dict) -> list[str]:
    """The bench's speed goals (moeprep's decode tokens/s against llama.cpp, resident, accelerate and naive),
    each MET / NOT MET with its figures, or why it was not measured."""
    if report.get("decode") is False:
        return prefill_goals(report)
    lines = []

    def goal(text: str, ours, theirs, factor: float, what: str, unit: str = "tok/s") -> None:
        if ours is None or not theirs:
            lines.append(f"{text}: not measured ({what})")
            return
        verdict = "MET" if ours >= factor * theirs else "NOT MET"
        lines.append(f"{text}: {verdict}, {ours:.3g} against {theirs:.3g} {unit} = {ours / theirs:.2f}x")

    shape, own, low = "mixtral-shape", "mixtral-shape-own", "4bit-25%"
    goal(f"offloading regime ({low}, mixtral-shape-own): moeprep >= 3x llama.cpp Q4", _speed(report, own, "moeprep", low),
         _speed(report, own, "llama.cpp", low), 3, "needs mixtral-shape-own, the 4bit-25% budget and the llama.cpp extra")
    goal("25% (mixtral-shape): moeprep >= resident (its fastest candidate)", _speed(report, shape, "moeprep", "25%"),
         _speed(report, shape, "resident", "25%"), 1, "needs mixtral-shape at 25%")
    goal("25% (mixtral-shape): moeprep >= 10x accelerate", _speed(report, shape, "moeprep", "25%"),
         _speed(report, shape, "accelerate", "25%"), 10, "needs mixtral-shape at 25%")
    goal("all in RAM (100%, mixtral-shape-own): moeprep >= 0.5x llama.cpp Q4", _speed(report, own, "moeprep", "100%"),
         _speed(report, own, "llama.cpp", "100%"), 0.5, "needs mixtral-shape-own, the 100% budget and the llama.cpp extra")
    tech = "mixtral-shape-techniques"
    goal(f"{low} ({tech}): moeprep with the techniques >= 3x llama.cpp Q4 (mixtral-shape-own)",
         _speed(report, tech, "moeprep", low), _speed(report, own, "llama.cpp", low), 3,
         f"needs {tech} and mixtral-shape-own at 4bit-25% and the llama.cpp extra")
    goal(f"25% ({tech}): moeprep with the techniques >= 1.5x resident (its fastest candidate)",
         _speed(report, tech, "moeprep", "25%"), _speed(report, tech, "resident", "25%"), 1.5,
         f"needs {tech} at 25%")
    for budget in report["budgets"]:
        goal(f"{budget} ({tech}): dynamic precision reads >= 1.5x fewer bytes per token than uniform int4 "
             "(int4 bytes over int4+dynamic_precision bytes)", _field(report, tech, "int4", budget, "bytes_read_per_token"),
             _field(report, tech, "int4+dynamic_precision", budget, "bytes_read_per_token"), 1.5,
             f"needs {tech} at {budget} with bytes read", "bytes/token")
        saved = _runs_saved(report, tech, "int4+gating", budget)
        goal(f"{budget} ({tech}): gating saves >= 20% of expert runs (measured share saved against 0.20)", saved,
             0.2 if saved is not None else None, 1, f"needs {tech} at {budget}", "of runs")
        goal(f"{budget} ({tech}): gating's wall clock against int4 (>= 1x: it must not slow decoding)",
             _speed(report, tech, "int4+gating", budget), _speed(report, tech, "int4", budget), 1,
             f"needs {tech} at {budget}")
    for budget in report["budgets"]:
        goal(f"lossless mode ({budget}, reference-lossless): moeprep >= 1.25x naive",
             _speed(report, "reference-lossless", "moeprep", budget),
             _speed(report, "reference-lossless", "naive", budget), 1.25, "needs the reference-lossless subject")
    return lines + prefill_goals(report)


def _prefill_row(report: dict, subject: str, tokens: int, system: str, budget: str) -> dict:
    rows = (report.get("prefill") or {}).get("rows", [])
    return next((r for r in rows if (r["subject"], r["prompt_tokens"], r["system"], r["budget"]) ==
                 (subject, tokens, system, budget) and not r.get("error")), {})


def prefill_goals(report: dict) -> list[str]:
    """Issue 43's prefill goals, each MET / NOT MET with its figures, or why it was not measured; none without
    prefill rows."""
    prefill = report.get("prefill")
    if not prefill:
        return []
    lines = []
    subjects = sorted({r["subject"] for r in prefill["rows"]})
    for subject in subjects:
        for tokens in prefill["prompts"]:
            for budget in ("25%", "4bit-25%"):
                row = _prefill_row(report, subject, tokens, "moeprep", budget)
                what = f"prefill of {tokens} tokens at {budget} ({subject}): moeprep >= 0.8 of its bound"
                if row.get("fraction_of_bound") is None:
                    lines.append(f"{what}: not measured ({row.get('bound_error') or 'no such row'})")
                    continue
                verdict = "MET" if row["fraction_of_bound"] >= 0.8 else "NOT MET"
                lines.append(f"{what}: {verdict}, {row['fraction_of_bound']:.2f} ({row['prefill_tokens_per_s']:.3g} "
                             f"against {row['bound_tokens_per_s']:.3g} tok/s, bound by {row['bound_by']})")
    for subject in subjects:
        for tokens in prefill["prompts"]:
            ours = _prefill_row(report, subject, tokens, "moeprep", "4bit-25%").get("ttft_s")
            theirs = _prefill_row(report, subject, tokens, "llama.cpp", "4bit-25%").get("ttft_s")
            what = f"time to first token at 4bit-25% ({tokens} tokens, {subject}): moeprep <= llama.cpp Q4"
            if ours and theirs:
                lines.append(f"{what}: {'MET' if ours <= theirs else 'NOT MET'}, {ours:.3g} s against {theirs:.3g} s "
                             f"= {ours / theirs:.2f}x")
            elif subject == "mixtral-shape-own":
                lines.append(f"{what}: not measured (needs the 4bit-25% budget and the llama.cpp extra)")
            ours = _prefill_row(report, subject, tokens, "moeprep", "100%").get("ttft_s")
            theirs = _prefill_row(report, subject, tokens, "resident", "100%").get("ttft_s")
            what = f"time to first token at 100% ({tokens} tokens, {subject}): moeprep <= 1.2x resident"
            lines.append(f"{what}: " + (f"{'MET' if ours <= 1.2 * theirs else 'NOT MET'}, {ours:.3g} s against "
                                        f"{theirs:.3g} s = {ours / theirs:.2f}x" if ours and theirs else
                                        "not measured (needs the 100% budget and resident)"))
    judged = [r for r in prefill["rows"] if r["system"] == "moeprep" and r.get("within_budget") is not None]
    over = [f"{r['subject']} {r['prompt_tokens']} {r['budget']}: {r['prefill_memory_bytes'] / 1e6:.0f} MB against "
            f"{r['budget_bytes'] / 1e6:.0f} MB" + (f", {r['kv_cache_bytes'] / 1e6:.0f} MB of it the KV cache"
                                                   if r.get("kv_cache_bytes") else "")
            for r in judged if not r["within_budget"]]
    lines.append(f"moeprep's memory within the budget during prefill: {'MET' if judged and not over else 'NOT MET'}, "
                 f"{len(judged) - len(over)} of {len(judged)} rows" + (f" (over: {'; '.join(over)})" if over else ""))
    return lines


def _store_lines(report: dict) -> list[str]:
    """Where the loader's stores lived, and on a GPU with the store in host RAM each miss's two measured
    costs (copy it, or compute it on the CPU) and what the loader chose."""
    store = report.get("store")
    if store is None:
        return []
    lines = [f"Loader expert stores: `{store}`" + (" (host RAM: a miss is a copy)" if store == "host"
                                                   else " (read from the artifact's files)") + ".", ""]
    costs = {}
    for row in report["results"]:
        if row.get("miss_costs"):
            costs.setdefault((row["subject"], row["system"]), row["miss_costs"])
    for (subject, system), c in sorted(costs.items()):
        parts = [f"{p}: CPU {c['cpu_seconds'][p] * 1e3:.2f} ms, copy {c['gpu_seconds'][p] * 1e3:.2f} ms"
                 for p in sorted(c["cpu_seconds"])]
        lines.append(f"- {subject} {system}: a missed expert costs " + "; ".join(parts) +
                     f"; computed on the CPU: {', '.join(c['computed_on_cpu']) or 'none'}.")
    return lines + ([""] if costs else [])


def write_markdown(report: dict) -> str:
    """bench.md: the machine and its measured read costs, the goals, each subject's tables, the prefill rows, and how
    to read them with the run's notes."""
    lines = _header_lines(report) + kernel_lines(report.get("kernels"))
    lines += ["Goals (medians):", ""] + [f"- {line}" for line in goal_check(report)] + [""]
    for subject, facts in report["subjects"].items():
        lines += _subject_lines(report, subject, facts)
    lines += prefill_section(report)
    lines += list(HOW_TO_READ)
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _header_lines(report: dict) -> list[str]:
    """The machine, the run, the disk's read bandwidth, the device profile and where the loader's stores lived."""
    m = report["machine"]
    bw = report["read_bandwidth"]
    profile = report.get("device_profile") or {}
    return [
        "# moeprep bench",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gb']} GB RAM; torch {m['torch']}, transformers "
        f"{m['transformers']}, accelerate {m['accelerate']}; device `{m['device']}`. "
        f"Run {report['created']}, {report['wall_seconds']} s wall{' (--quick)' if report['quick'] else ''}.",
        "",
        f"Disk sequential read bandwidth: **{_num(bw['mb_s'], '.0f')} MB/s** "
        f"({'O_DIRECT' if bw['direct'] else 'page cache dropped, no O_DIRECT'} reads of "
        f"{bw['bytes'] / 1e6:.0f} MB of `{bw['file']}`).",
        "",
        *(_profile_lines(profile) if profile else []),
        *_store_lines(report),
    ]


def _subject_lines(report: dict, subject: str, facts: dict) -> list[str]:
    """One subject's section: what it is, then (with decode rows) its resident candidates, its decode table, why
    rows are not modelled, and its bounds, neuron, prefetch and techniques tables."""
    lines = [f"## {subject}", ""]
    shape = facts.get("shape")
    if shape:
        lines.append(f"Mixtral-8x7B architecture scaled down: {shape['num_hidden_layers']} layers, "
                     f"{shape['num_local_experts']} experts, top-{shape['num_experts_per_tok']}, hidden "
                     f"{shape['hidden_size']}, expert intermediate {shape['intermediate_size']}, "
                     f"{shape['dtype']}, random weights. ")
    lines += [
        f"Expert store: {facts['experts']} experts x {facts['record_bytes'] / 1e6:.2f} MB "
        f"({facts['precision']}) = {facts['store_bytes'] / 1e9:.2f} GB; dense weights "
        f"{facts['dense_bytes'] / 1e6:.0f} MB. Routing: {facts['routing']}. "
        f"Each measurement: a prefill of {facts['prompt_tokens']} tokens, then {facts['decode_tokens']} "
        "decode steps of one token (the same tokens for every system).",
        "",
        f"Accuracy of the artifact against its original (its report): {_accuracy(facts.get('accuracy_delta'))}.",
        *([_llama_line(facts["llama_cpp"]), ""] if facts.get("llama_cpp") else []),
        "",
    ]
    if report.get("decode") is False:
        return lines + ["Decode rows not run (`--no-decode`).", ""]
    rows = _rows(report, subject)
    lines += resident_table(facts.get("resident"))
    lines += decode_table(report, rows)
    lines += bounds_table(report.get("bounds", {}).get(subject, {}), report["budgets"])
    lines += neuron_table(rows, report["budgets"])
    lines += prefetch_table(rows, report["budgets"])
    lines += techniques_table(report, subject)
    return lines


def decode_table(report: dict, rows: list[dict]) -> list[str]:
    """A subject's decode rows at every budget in ``SYSTEM_ORDER``, then why the unmodelled ones are not modelled."""
    lines = [
        "| budget | system | decode tok/s (median) | min - max (runs) | vs resident | vs accelerate | of bound "
        "| modelled tok/s | modelled / measured | calibrated model / measured | overhead us/layer | prefill s "
        "| MB read/token | hit rate | stall fraction | read / check / make ms per miss | peak RSS MB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    resident = next((r for r in rows if r["system"] == "resident"), {}).get("decode_tokens_per_s")
    unmodelled = {}  # why a row has no modelled speed -> the rows
    for budget in report["budgets"]:
        at = {r["system"]: r for r in rows if r["budget"] == budget}
        acc = (at.get("accelerate") or {}).get("decode_tokens_per_s")
        for system in SYSTEM_ORDER:
            r = at.get(system)
            if r is None:
                continue
            if r.get("error"):
                lines.append(f"| {budget} | {system} | failed: {_error_message(r['error'])} |" + "  |" * 14)
                continue
            if r.get("modelled_error"):
                unmodelled.setdefault(r["modelled_error"], []).append(f"{system} {budget}")
            lines.append(_decode_row(r, budget, system, resident, acc))
    lines.append("")
    lines += [f"Not modelled ({', '.join(where)}): {why}." for why, where in unmodelled.items()]
    return lines + ([""] if unmodelled else [])


def _decode_row(r: dict, budget: str, system: str, resident, accelerate) -> str:
    speed = r["decode_tokens_per_s"]
    mb = r["bytes_read_per_token"] / 1e6 if r["bytes_read_per_token"] is not None else None
    return (f"| {budget} | {system}{' (budget-free)' if r.get('measured_once') else ''} | {speed:.3g} | "
            f"{r['decode_tokens_per_s_min']:.3g} - {r['decode_tokens_per_s_max']:.3g} ({r['repeats']}) | "
            f"{_ratio(speed, resident)} | {_ratio(speed, accelerate)} | {_num(r.get('fraction_of_bound'), '.2f')} | "
            f"{_num(r.get('modelled_tokens_per_s'), '.3g')} | {_num(r.get('modelled_over_measured'), '.2f')} | "
            f"{_num(r.get('modelled_calibrated_over_measured'), '.2f')} | "
            f"{_num(r.get('overhead_us_per_layer'), '.1f')} | "
            f"{r['prefill_s']:.2f} | {_num(mb, '.1f')} | "
            f"{_num(r['hit_rate'], '.3f')} | {_num(r['stall_fraction'], '.3f')} | {_per_miss(r.get('per_miss_ms'))} "
            f"| {r['peak_rss_mb']:.0f} |")


HOW_TO_READ = (
    "## How to read this",
    "",
    "- A budget `p%` is the dense weights + p% of the source model's expert bytes in their original dtype "
    "(the loader's read buffers included), in bytes; accelerate gets the same bytes as `max_memory`. "
    "`4bit-25%` is the dense weights + 25% of the experts' bytes at 4 bits (the codec's int4 format): below "
    "a 4-bit model's size. A quantized artifact at the same bytes holds more experts than accelerate (which "
    "offloads the original weights).",
    "- Every configuration ran `repeats` times, interleaved (each round runs every configuration once); a "
    "row gives the median decode speed, and min - max over the runs; its other figures are the median run's.",
    "- `resident`: transformers, every weight in memory (the ceiling), in the fastest of its candidates on this "
    "device (dtype x transformers' experts implementation, each timed on a short decode in its own process "
    "before the subject's first round; the table above each subject lists them); budget-free, measured once "
    "per round and its row repeated at each budget; every `vs resident` is against it. `accelerate`: "
    "`from_pretrained(dtype=\"auto\", device_map=\"auto\", max_memory={\"cpu\": budget}, offload_folder=...)`, "
    "the overflow offloaded to disk, with transformers' default experts implementation.",
    "- `naive@unlimited` / `moeprep@unlimited`: that loader system on its artifact at the budget `unlimited` "
    "(every expert cached in its held form, the sequence run once untimed first; budget-free): the compute "
    "floor of the bound. `of bound`: a loader row's speed over 1 / max(that floor's seconds per token, Belady's "
    "I/O floor per token) of its artifact and plan at that budget (the physical bounds table; `naive+<x>` rows "
    "against naive's; `-` for neuron-level loading, which reads and computes parts of experts).",
    "- `modelled tok/s`: the simulator (`prep.sim.simulate`) replaying the same artifact, plan, budget and "
    "routing decisions (the replayed trace, or what the resident model's routers did) with the device profile "
    "above scaled to the subject's experts: decode tokens over the modelled seconds of the decode steps. Its "
    "cost model counts expert reads and expert compute only (no attention, no dense layers, no loader "
    "overhead), so `modelled / measured` above 1 is what the rest of the model and the loader cost. "
    "`calibrated model / measured`: the same replay with the profile calibrated against this run "
    "(`device-calibrated.json`: reads overlap the hits' compute, plus the median measured loader overhead per "
    "MoE layer call), the simulator's model of the loader's step. "
    "`overhead us/layer`: the loader's own time per MoE layer step during decode (the step's wall time less "
    "expert compute and waiting for reads, from `stats()[\"decode_timing\"]`); `-` where the loader does not "
    "count it.",
    "- `naive`: the loader (`loader.runtime.load`) on the subject's lossless artifact (experts as they are) "
    "with per-layer LRU caches sized by the budget, no prediction, exact routing, experts read with "
    "O_DIRECT. `moeprep`: the loader on the recipe's artifact with its whole plan (`plan.json`: precisions, "
    "pools, eviction policy, predictors, routing and miss policies) scaled to the budget, and the compute "
    "path's `auto` held form (loader/README.md, \"Compute path\"). For `reference-lossless` both run the "
    "lossless artifact (`moeprep` is the lossless mode), for `reference-neuron` both run the neuron-layout "
    "artifact.",
    "- Page cache: the loader bypasses it (O_DIRECT). For accelerate the page cache of its offload folder "
    "and of the model's safetensors files is dropped (`posix_fadvise(DONTNEED)` on each file, after a "
    "sync) before the prefill and before every decode step, outside the timed region; otherwise the "
    "offloaded weights would stay in RAM beyond the budget after the first token.",
    "- MB read/token: the loader's own count of expert bytes read during decode; for accelerate the "
    "kernel's count of bytes fetched from storage (`/proc/self/io` read_bytes, readahead included). "
    "Hit rate: the loader's cache hits per expert lookup during decode; for accelerate the share of MoE "
    "layers whose experts it kept in RAM. Stall fraction: seconds waiting for reads / decode seconds; "
    "for accelerate the seconds in its weight-loading pre-forward hooks.",
    "- Peak RSS: VmHWM of the measuring process (one process per system and budget), loading included.",
    "- Decode tokens are teacher-forced (the given continuation, not the argmax), so every system runs the "
    "same tokens and the replayed routing lines up with them.",
)


PREFILL_ORDER = ("resident", "moeprep@unlimited", "accelerate", "naive", "moeprep", "llama.cpp")


def prefill_section(report: dict) -> list[str]:
    """The prefill rows (``prep/studies/bench/prefill.py``): one table per subject, prompt by prompt."""
    prefill = report.get("prefill")
    if not prefill:
        return []
    bandwidth = prefill.get("read_bandwidth_bytes_per_s")
    lines = ["## Prefill", "",
             f"Prompts of {', '.join(str(t) for t in prefill['prompts'])} tokens, each system loaded fresh in its own "
             "process and the prompt run once from a cold cache (nothing decoded); rows give the median of "
             f"{report['repeats']} interleaved rounds. TTFT: seconds to the first token's logits. Bound (moeprep "
             "rows): tokens / max(the compute floor, the bytes its chunks read / the disk's read bandwidth "
             f"{_num(bandwidth / 1e6 if bandwidth else None, '.0f')} MB/s), the floor being `moeprep@unlimited`'s "
             "TTFT (every expert held). Memory: peak RSS during the prompt less the process's RSS before the "
             "model was loaded (llama.cpp: its cgroup's peak during the prompt), against the budget."
             + (" Load average (1, 5, 15 min) before the prefill rows: {}, after: {}.".format(
                 *(", ".join(f"{x:.2f}" for x in prefill["load_average"][k]) for k in ("before", "after")))
                if prefill.get("load_average") else ""), ""]
    rows = prefill["rows"]
    for subject in dict.fromkeys(r["subject"] for r in rows):
        lines += [f"### {subject}", "",
                  "| prompt | budget | system | TTFT s | prompt tok/s | vs resident | chunks x largest | MB read "
                  "| most reads of an expert per layer step | bound tok/s (bound by) | of bound | peak RSS MB "
                  "| prompt memory MB (KV cache) | budget MB | within budget |",
                  "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for tokens in prefill["prompts"]:
            resident = _prefill_row(report, subject, tokens, "resident", prefill["budgets"][0]).get("prefill_tokens_per_s")
            for budget in prefill["budgets"]:
                at = {r["system"]: r for r in rows
                      if (r["subject"], r["prompt_tokens"], r["budget"]) == (subject, tokens, budget)}
                for system in PREFILL_ORDER:
                    r = at.get(system)
                    if r is None:
                        continue
                    name = f"{system}{' (budget-free)' if r.get('measured_once') else ''}"
                    if r.get("error"):
                        lines.append(f"| {tokens} | {budget} | {name} | failed: {_error_message(r['error'])} |"
                                     + "  |" * 11)
                        continue
                    mb = r.get("bytes_read", r.get("disk_read_bytes"))
                    bound = r.get("bound_tokens_per_s")
                    most = (r.get("prefill_timing") or {}).get("most_reads_per_layer_step")
                    lines.append(
                        f"| {tokens} | {budget} | {name} | {r['ttft_s']:.2f} | {r['prefill_tokens_per_s']:.3g} | "
                        f"{_ratio(r['prefill_tokens_per_s'], resident)} | {r['chunks']} x {r['largest_chunk']} | "
                        f"{_num(mb / 1e6 if mb is not None else None, '.0f')} | {_num(most, 'd')} | "
                        + (f"{bound:.3g} ({r['bound_by']}) | " if bound else "- | ")
                        + f"{_num(r.get('fraction_of_bound'), '.2f')} | {r['peak_rss_mb']:.0f} | "
                        f"{_num(r['prefill_memory_bytes'] / 1e6 if r.get('prefill_memory_bytes') else None, '.0f')}"
                        + (f" ({r['kv_cache_bytes'] / 1e6:.0f}) | " if r.get("kv_cache_bytes") else " | ")
                        +
                        f"{'-' if r.get('measured_once') else _num(r['budget_bytes'] / 1e6, '.0f')} | "
                        f"{ {True: 'yes', False: 'NO', None: '-'}[r.get('within_budget')] } |")
        lines.append("")
        candidates = (prefill.get("resident") or {}).get(subject)
        if candidates and candidates.get("chosen"):
            chosen = candidates["chosen"]
            lines += [f"Resident for the prompts: {chosen['dtype']} with experts implementation "
                      f"{chosen['experts_implementation']}, the fastest of "
                      f"{sum(1 for c in candidates['candidates'] if not c.get('error'))} candidates on the "
                      f"{prefill['prompts'][0]}-token prompt.", ""]
    lines += [
        "- MB read: the loader's expert bytes read during the prompt; accelerate and llama.cpp: the kernel's count "
        "of bytes the process fetched from storage (`/proc/self/io`, readahead included). A `most reads` of 1: "
        "each expert read at most once per layer per chunk.",
        "- The loader's chunks are the plan's `prefill.chunk` (256 by default) cut to the budget's prefill reserve; "
        "llama.cpp's are its `n_batch`; resident and accelerate run the prompt as one forward.", ""]
    return lines


def _error_message(error: str) -> str:
    """The message of a failed measurement (the last line its worker wrote, without the exception's module)."""
    last = error.split(" | ")[-1].split(" (log: ")[0]
    return last.split("Error: ", 1)[-1][:200]


def _llama_line(llama: dict) -> str:
    return (f"llama.cpp: the model converted to GGUF and quantized to {llama['quant']} "
            f"({llama['file_bytes'] / 1e6:.0f} MB); its float32 conversion's logits are within "
            f"{llama['f32_logit_max_abs_diff']:.2g} of transformers' on the prompt. It runs in a memory cgroup "
            "(v1, page cache counted) of the budget + 64 MiB, weights memory-mapped, an f32 KV cache, weight "
            "repacking off, the model's own routing.")


def _accuracy(delta: dict | None) -> str:
    if not delta:
        return "none measured (the report has no accuracy check: random weights, or a recipe that turns it off)"
    return ", ".join(f"{name} {d['delta_points']:+.1f} pt (n={d['n']})" for name, d in delta.items())


def _profile_lines(profile: dict) -> list[str]:
    compute = profile.get("compute_seconds_per_expert") or {}
    shape = profile.get("expert_shape") or {}
    per = ", ".join(f"{p} {s * 1e3:.3g} ms" for p, s in compute.items() if p in ("float32", "bfloat16", "int8", "int4"))
    return [f"Device profile for the simulator (`device.json`, {profile.get('device', '')}): reads "
            f"{profile['read_bandwidth_bytes_per_s'] / 1e6:.0f} MB/s + {profile['read_latency_s'] * 1e6:.0f} us each "
            f"({profile.get('reads', 'disk')}); one token through one expert of {shape.get('hidden')} x "
            f"{shape.get('intermediate')}: {per} (scaled to each subject's experts by their weights).", ""]


def resident_table(resident: dict | None) -> list[str]:
    """The resident candidates (dtype x experts implementation) with their decode speed; the chosen one marked."""
    if not resident:
        return []
    chosen = resident.get("chosen") or {}
    lines = [f"Resident candidates (each: a prefill, then {resident.get('decode_tokens')} decode steps, in its own "
             "process; the fastest runs as `resident`):", "",
             "| dtype | experts implementation | decode tok/s | chosen |", "| --- | --- | ---: | --- |"]
    for c in resident.get("candidates", []):
        mark = "**resident**" if (c["dtype"], c["experts_implementation"]) == (
            chosen.get("dtype"), chosen.get("experts_implementation")) else ""
        speed = (f"failed: {_error_message(c['error'])}" if c.get("error") else
                 c.get("note") or _num(c.get("decode_tokens_per_s"), ".3g"))
        lines.append(f"| {c['dtype']} | {c['experts_implementation']} | {speed} | {mark} |")
    if not chosen:
        lines.append("")
        lines.append("Every candidate failed: `resident` runs transformers' defaults.")
    return lines + [""]


def bounds_table(bounds: dict, budgets: list[str]) -> list[str]:
    """The physical bounds at each budget: the compute floor (the loader at budget ``unlimited``), Belady's I/O
    floor, the bound they make; in naive's cache and, where it differs, in moeprep's."""
    if not bounds:
        return []
    lines = ["Physical bounds (`of bound` above is each loader row's speed over the bound of its artifact; llama.cpp "
             "against moeprep's, the same 4-bit class): compute = the loader on that artifact at budget `unlimited` "
             "(every expert cached in its held form); I/O floor = Belady's demand bytes per decode token in that "
             "artifact's cache at that budget over the device profile's read bandwidth; bound = 1 / max(compute, "
             "I/O) per token (reads hidden perfectly).", "",
             "| budget | cache of | compute floor tok/s (from) | Belady MB/token | I/O floor ms/token | bound tok/s |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for budget in budgets:
        b = bounds.get(budget) or {}
        for who, e in (("naive", b), ("moeprep", b.get("moeprep"))):
            if e is None:
                continue
            compute = f"{_num(e.get('compute_tokens_per_s'), '.3g')} ({e.get('compute_system', '-')})"
            if e.get("error"):
                lines.append(f"| {budget} | {who} | {compute} | does not fit: {e['error'][:100]} |  |  |")
                continue
            mb = e.get("belady_bytes_per_token")
            floor = e.get("io_floor_s_per_token")
            lines.append(f"| {budget} | {who} | {compute} | "
                         f"{_num(mb / 1e6 if mb is not None else None, '.2f')} | "
                         f"{_num(floor * 1e3 if floor is not None else None, '.2f')} | "
                         f"{_num(e.get('bound_tokens_per_s'), '.3g')} |")
    return lines + [""]


def neuron_table(rows: list[dict], budgets: list[str]) -> list[str]:
    """Neuron-level loading against whole-expert reads of the same records (``naive``); nothing when none ran."""
    runs = [r for r in rows if r.get("neuron") and not r.get("error")]
    if not runs:
        return []
    lines = ["Neuron-level loading (CORM), decode steps (`naive`: whole-expert reads of the same neuron-layout "
             "records; `naive+neuron`: only the active neurons' rows; `moeprep`: with the neuron_gates predictor and "
             "the rest of the plan):", "",
             "| budget | system | decode tok/s | vs naive | MB read/token | x fewer bytes | active share | partial / whole "
             "reads | neuron recall |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for budget in budgets:
        at = {r["system"]: r for r in rows if r["budget"] == budget and not r.get("error")}
        naive = at.get("naive") or {}
        for system in ("naive", "naive+neuron", "moeprep"):
            r = at.get(system)
            if r is None:
                continue
            n = r.get("neuron") or {}
            mb = r["bytes_read_per_token"]
            fewer = _ratio(naive.get("bytes_read_per_token"), mb) if mb else "-"
            lines.append(f"| {budget} | {system} | {r['decode_tokens_per_s']:.3g} | "
                         f"{_ratio(r['decode_tokens_per_s'], naive.get('decode_tokens_per_s'))} | "
                         f"{_num(mb / 1e6 if mb is not None else None, '.3f')} | {fewer} | "
                         f"{_num(n.get('active_share'), '.3f')} | {n.get('partial_reads', '-')} / "
                         f"{n.get('whole_reads', '-')} | {_num(n.get('neuron_recall'), '.3f')} |")
    return lines + [""]


def prefetch_table(rows: list[dict], budgets: list[str]) -> list[str]:
    """Each predictor against ``naive`` at every budget (decode steps only); nothing when none ran."""
    predicted = [r for r in rows if r["system"].startswith("naive+") or r["system"] == "moeprep"]
    if not any((r.get("prefetch") or {}).get("issued") for r in predicted):
        return []
    lines = ["Prefetching, decode steps only (`naive+<predictor>`: naive plus that predictor alone; `moeprep`: the "
             "whole plan):", "",
             "| budget | system | decode tok/s | vs naive | misses/token | prefetches issued | used | wasted | "
             "cancelled | read s saved |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for budget in budgets:
        at = {r["system"]: r for r in rows if r["budget"] == budget and not r.get("error")}
        naive = (at.get("naive") or {}).get("decode_tokens_per_s")
        for system in ("naive", *(s for s in SYSTEM_ORDER if s.startswith("naive+")), "moeprep"):
            r = at.get(system)
            if r is None:
                continue
            p = r.get("prefetch") or {}
            lines.append(f"| {budget} | {system} | {r['decode_tokens_per_s']:.3g} | {_ratio(r['decode_tokens_per_s'], naive)} | "
                         f"{_num(r.get('misses_per_token'), '.2f')} | {p.get('issued', 0)} | {p.get('used', 0)} | "
                         f"{p.get('wasted', 0)} | {p.get('cancelled', 0)} | {_num(p.get('saved_seconds'), '.3f')} |")
    return lines + [""]


def _reference_deltas(report: dict) -> str:
    """The reference model's measured accuracy deltas, where the report has the reference subject."""
    delta = (report["subjects"].get("reference") or {}).get("accuracy_delta")
    return _accuracy(delta) if delta else "not in this run (bench the reference subject, or read its report.md)"


def techniques_table(report: dict, subject: str) -> list[str]:
    """mixtral-shape-techniques: each technique alone on uniform int4, and all together, against naive, int4 and
    llama.cpp Q4 (from mixtral-shape-own at the same budget), with bytes, misses, what each policy decided and the
    simulator's model beside the measured speed; then the accuracy each technique costs, cited."""
    rows = _rows(report, subject)
    if not any(r["system"] in TECHNIQUE_ORDER for r in rows):
        return []
    lines = ["Techniques at Mixtral's shape, on Mixtral's decisions (decode steps; `int4+<technique>`: that technique "
             "alone on uniform int4; `moeprep`: all of them, as the planning stages kept them). llama.cpp Q4 runs "
             "mixtral-shape-own at the same budget: its own (random) routers, since llama.cpp cannot replay routing.",
             "", "| budget | system | decode tok/s | vs naive | vs int4 | vs llama.cpp Q4 | modelled tok/s | "
             "MB read/token | misses/token | expert runs saved | misses high / low / skipped |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for budget in report["budgets"]:
        at = {r["system"]: r for r in rows if r["budget"] == budget and not r.get("error")}
        naive, int4 = ((at.get(x) or {}).get("decode_tokens_per_s") for x in ("naive", "int4"))
        llama = _speed(report, "mixtral-shape-own", "llama.cpp", budget)
        for system in ("naive", *TECHNIQUE_ORDER, "moeprep", "moeprep+tuned"):
            r = at.get(system)
            if r is None:
                continue
            speed = r["decode_tokens_per_s"]
            decided = r.get("decisions") or {}
            gating, miss = decided.get("routing") or {}, decided.get("miss_policy") or {}
            saved = (1 - gating["runs_after"] / gating["runs_before"]) if gating.get("runs_before") else None
            split = (f"{miss.get('high', 0)} / {miss.get('low', 0)} / {miss.get('skip', 0)}"
                     if "high" in miss else "-")
            mb = r["bytes_read_per_token"] / 1e6 if r.get("bytes_read_per_token") is not None else None
            lines.append(f"| {budget} | {system} | {speed:.3g} | {_ratio(speed, naive)} | {_ratio(speed, int4)} | "
                         f"{_ratio(speed, llama)} | {_num(r.get('modelled_tokens_per_s'), '.3g')} | {_num(mb, '.2f')} | "
                         f"{_num(r.get('misses_per_token'), '.2f')} | {_num(saved, '.1%')} | {split} |")
    lines += ["", "Accuracy at these settings (mixtral-shape's weights are random, so none is measured here):", ""]
    lines += [f"- `{system}`: {text}." for system, text in CITED_ACCURACY.items()]
    lines += [f"- The reference model at the same kinds of setting (its recipe's gating, dynamic precision and "
              f"plan), measured against its original: {_reference_deltas(report)}.", ""]
    return lines


def write_plot(report: dict, path: Path) -> None:
    """Decode tokens/s against budget, one line per system, one panel per subject; written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    subjects = list(report["subjects"])
    fig, axes = plt.subplots(1, max(1, len(subjects)), figsize=(6 * max(1, len(subjects)), 4.2), squeeze=False)
    budgets = report["budgets"]
    for ax, subject in zip(axes[0], subjects, strict=False):
        rows = _rows(report, subject)
        shares = report.get("bounds", {}).get(subject, {})
        x = [shares.get(b, {}).get("budget_share") or float(b.removesuffix("%").split("-")[-1]) for b in budgets]
        for system in SYSTEM_ORDER:
            by_budget = {r["budget"]: r.get("decode_tokens_per_s") for r in rows if r["system"] == system}
            ys = [by_budget.get(b) for b in budgets]
            if any(y for y in ys):
                ax.plot(x, [y if y else float("nan") for y in ys], marker="o", label=system,
                        linestyle="--" if system == "resident" or "@" in system else "-")
        ax.set_title(subject)
        ax.set_xlabel("memory budget (% of the expert store)")
        ax.set_ylabel("decode tokens/s")
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, budgets)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomic(path, png.getvalue())
