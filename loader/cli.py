"""`moeload`: the device team's command line: plan, generate, tune, profile-device, verify, info.

Every project error (``loader.errors.MoeError``: a damaged artifact, a bad budget, a bad option) prints
as ``error: <message>`` without a traceback and exits 1; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import re
import sys

import click

from loader import __version__
from loader.cli_group import LoaderGroup
from loader.codec import RecordLayout
from loader.errors import MoeError
from loader.format import read_manifest
from loader.plan import read_plan
from loader.verify import verify
from loader.vocab import EXPERT_DTYPES


@click.group(cls=LoaderGroup)
@click.version_option(__version__, prog_name="moeload")
def main() -> None:
    """Run and check moeprep artifacts on a device."""


@main.command("verify")
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help='Print one JSON object {"ok", "bad"}.')
def verify_command(artifact: str, as_json: bool) -> None:
    """Check the schema, every file size and every sha256; exit 1 naming each bad file."""
    bad = verify(artifact)
    if as_json:
        click.echo(json.dumps({"artifact": str(artifact), "ok": not bad, "bad": bad}))
        sys.exit(1 if bad else 0)
    if bad:
        for line in bad:
            click.echo(f"BAD  {line}", err=True)
        sys.exit(1)
    click.echo(f"ok: {artifact}: every file matches its manifest")


@main.command("info")
@click.argument("artifact", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info_command(artifact: str, as_json: bool) -> None:
    """Summarize an artifact: source model, MoE geometry, stores, plan, sizes."""
    from loader.artifact import read_report

    manifest = read_manifest(artifact)
    raw = manifest.raw
    report = read_report(manifest)  # sealed and checked: plan and verify read it through the same reader
    info = {
        "schema_version": raw["schema_version"],
        "producer": raw["producer"],
        "source_model": raw["source_model"],
        "architecture": manifest.moe.architecture,
        "moe_layers": len(manifest.moe.layers),
        "num_experts": manifest.moe.num_experts,
        "top_k": manifest.moe.top_k,
        "stores": _store_summary(manifest),
        "plan": raw["plan_summary"],
        "neuron": read_plan(manifest.root).neuron.to_json(),  # CORM's neuron-level loading ("off" or its knobs)
        "total_bytes": sum(f["bytes"] for f in raw["files"].values()),
        "sizes": report.get("sizes", {}),
        "compression": report.get("compression", {}),
        # the loader takes the point of the largest budget_bytes the memory budget covers
        "operating_points": [{k: p.get(k) for k in ("budget_bytes", "modeled_tokens_per_s", "accuracy_delta")}
                             for p in report.get("operating_points") or []],
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    for key, value in info.items():
        click.echo(f"{key:16s} {json.dumps(value) if isinstance(value, dict | list) else value}")


def _store_summary(manifest) -> dict:
    """Per precision: the experts planned at it, their bytes, and the stored bits per weight (metadata in)."""
    planned = [p for row in read_plan(manifest.root).expert_precision for p in row]
    out = {}
    for precision, store in manifest.stores.items():
        experts = planned.count(precision)
        out[precision] = {"file": store.file, "experts": experts, "records": len(store.xxh3),
                          "record_bytes": store.record_bytes, "expert_bytes": experts * store.record_bytes,
                          "bits_per_weight": round(RecordLayout.from_json(store.layout).bits_per_weight, 4),
                          "layout": ("neuron" if store.neuron is not None
                                     else RecordLayout.from_json(store.layout).kernel or "expert")}
    return out


BUDGET_HELP = ("Bytes, a size like 1.5GiB, a share like 25%, unlimited, or auto (the memory free for this process less "
               "a margin). Default: the plan's.")


@main.command("plan")
@click.argument("artifact", type=click.Path())
@click.option("--memory-budget", default=None, help=BUDGET_HELP)
@click.option("--device", default="cpu", show_default=True)
@click.option("--store", default="disk", show_default=True, type=click.Choice(["disk", "host"]))
@click.option("--device-profile", "device_profile", default=None, type=click.Path(dir_okay=False),
              help="A profile from `moeload profile-device` on this device (default: the one the artifact was planned "
                   "with, its device.json).")
@click.option("--prompt-tokens", default=512, show_default=True, type=click.IntRange(1, 1 << 20),
              help="The prompt whose time to first token is predicted.")
@click.option("--sample-tokens", default=256, show_default=True, type=click.IntRange(1, 1 << 20),
              help="Decode steps the prediction replays: the routing's first tokens (more: slower, steadier).")
@click.option("--routing", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Replay this routing (a safetensors of expert_ids and weights [T, L, K], e.g. recorded on your "
                   "workload) instead of the sample the artifact carries.")
@click.option("--expert-dtype", type=click.Choice(list(EXPERT_DTYPES)), default="auto", show_default=True,
              help="The held form of a cached expert, as for generate.")
@click.option("--ignore-device-file", is_flag=True,
              help="Model the plan as prepared, not with the techniques `moeload tune` switched off (tuning.json).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan_command(artifact: str, memory_budget: str | None, device: str, store: str, device_profile: str | None,
                 prompt_tokens: int, sample_tokens: int, routing: str | None, expert_dtype: str,
                 ignore_device_file: bool, as_json: bool) -> None:
    """What a load would hold where and how fast it would run, without loading the weights; exit 1 if it does not fit."""
    from loader.fit import describe, preview

    check_device(device)
    view = preview(artifact, memory_budget, device, store, device_profile, prompt_tokens, expert_dtype,
                   routing=routing, sample_tokens=sample_tokens, ignore_device_file=ignore_device_file)
    if as_json:
        click.echo(json.dumps(view, indent=2, sort_keys=True, allow_nan=False))  # strict JSON: preview makes it finite
    else:
        for line in describe(view):
            click.echo(line)
    if not view["fits"]:
        if as_json:
            click.echo(f"error: {view['error']}", err=True)
        sys.exit(1)


@main.command("profile-device")
@click.option("--output", default="device.json", show_default=True, type=click.Path(dir_okay=False),
              help="Where the profile JSON goes (give it to `moeload plan --device-profile` and `moeprep prepare "
                   "--device-profile`).")
@click.option("--artifact", default=None, type=click.Path(file_okay=False, exists=True),
              help="Time reads at this artifact's record size on its disk, and calibrate against the loader running it "
                   "(every expert held): the loader's overhead per layer and per token. Without it: reads of 2 MiB "
                   "and compute only.")
@click.option("--dir", "directory", default=None, type=click.Path(file_okay=False, exists=True),
              help="Measure reads on this directory's disk (default: the artifact's, else the temp directory).")
@click.option("--file-mb", default=256, show_default=True, type=click.IntRange(16, 4096),
              help="Size of the temporary read-test file.")
@click.option("--device", default="cpu", show_default=True, help="Where compute is timed: cpu or cuda.")
def profile_device_command(output, artifact, directory, file_mb, device) -> None:
    """Measure what the cost model needs on this device: reads at the loader's sizes and depths, each held form's
    compute, and with --artifact the loader's own overhead; writes device.json."""
    from loader.calibrate import profile_device

    check_device(device)
    profile_device(output, directory, file_mb, device, artifact, echo=click.echo)


@main.command("tune")
@click.argument("artifact", type=click.Path())
@click.option("--memory-budget", default=None, help=BUDGET_HELP)
@click.option("--minutes", default=5.0, show_default=True, type=click.FloatRange(0.05, 24 * 60),
              help="The time limit: rounds stop before it, and the decisions are made on the rounds done.")
@click.option("--tokens", default="auto", show_default=True,
              help="Tokens of the routing sample each run times (after a few untimed): a number from 8, or auto (sized "
                   "from one probe run so that three rounds of every variant fit --minutes).")
@click.option("--device", default="cpu", show_default=True)
@click.option("--store", default="disk", show_default=True, type=click.Choice(["disk", "host"]))
@click.option("--routing", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Replay this routing (a safetensors of expert_ids and weights [T, L, K], e.g. recorded on your "
                   "workload) instead of the sample the artifact carries.")
@click.option("--device-profile", "device_profile", default=None, type=click.Path(dir_okay=False, exists=True),
              help="Also write the decisions into this device profile (from `moeload profile-device` on this device): "
                   "`moeprep prepare --device-profile` then ships a plan with them.")
@click.option("--dry-run", is_flag=True, help="Measure and print the decisions; do not write the device file.")
@click.option("--json", "as_json", is_flag=True, help="Print the decisions as one JSON object.")
def tune_command(artifact, memory_budget, minutes, tokens, device, store, routing, device_profile, dry_run,
                 as_json) -> None:
    """Measure each technique of the plan on this device (each switched off in turn, in fresh processes) and keep only
    those that pay here; writes the artifact's device file (tuning.json), which load, generate and plan then use."""
    from loader.tune import tune

    check_device(device)
    if tokens != "auto":
        tokens = bounded_count(tokens, "--tokens", 1 << 16, "auto or a number of tokens")
        if tokens < 8:
            raise MoeError(f"--tokens {tokens}: time at least 8 tokens per run (or auto)")
    point = tune(artifact, memory_budget, minutes, device, store, routing, tokens,
                 echo=lambda line: click.echo(line, err=True), write=not dry_run)
    if device_profile is not None:
        from loader.tune import add_to_profile

        add_to_profile(device_profile, point)
        click.echo(f"wrote the decisions into {device_profile}", err=True)
    if as_json:
        click.echo(json.dumps(point.to_json(), indent=2))
        return
    click.echo(f"kept: {', '.join(point.kept) or 'none'}; switched off: {', '.join(point.off) or 'none'}")
    for name, d in point.decisions.items():
        figures = (f"{d['ratio']:.3f}x [{d['low']:.3f}, {d['high']:.3f}]" if "ratio" in d else d.get("why", ""))
        click.echo(f"  {name:20s} {d['verdict']:28s} time without it / with it {figures}")
    check = point.measured.get("check")
    if check and "ratio" in check:
        click.echo(f"  the tuned plan against plain: plain/tuned {check['ratio']:.3f}x [{check['low']:.3f}, "
                   f"{check['high']:.3f}] ({check['verdict']})")


MAX_NEW_TOKENS = 1_000_000  # a bound before the model's context (unknown to some configs) says more


def bounded_count(text: str, option: str, most: int, use: str) -> int:
    """``text`` as a whole number from 1 to ``most`` (ASCII digits only: ``int`` takes other scripts' digits,
    and a 31-digit count reaches torch as an overflow or a crash), else one error naming the option."""
    if not (text.isascii() and text.isdigit() and len(text) <= 9 and 1 <= int(text) <= most):
        raise MoeError(f"{option} {text!r}: use {use} from 1 to {most}")
    return int(text)


def check_device(device: str) -> None:
    """``cpu``, ``cuda`` or ``cuda:N`` (an existing GPU); anything else is a MoeError listing those."""
    import torch

    match = re.fullmatch(r"cpu|cuda(?::(\d+))?", device)
    if not match:
        raise MoeError(f"--device {device!r} is not supported; use cpu, cuda or cuda:N (N a GPU index)")
    if device.startswith("cuda"):
        count = torch.cuda.device_count()
        if count == 0:
            raise MoeError(f"--device {device}: torch sees no CUDA GPU here; use --device cpu")
        if match.group(1) is not None and int(match.group(1)) >= count:
            raise MoeError(f"--device {device}: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}")


def context_length(config) -> int | None:
    """The model's context (``max_position_embeddings``), None where the config does not say."""
    value = getattr(config.get_text_config(), "max_position_embeddings", None)
    return value if isinstance(value, int) and value > 0 else None


def fit_context(ids, max_new_tokens: int, context: int | None, truncate: bool):
    """``ids`` [1, T] checked against the context: prompt plus new tokens must fit; with ``truncate`` a prompt that
    does not keeps its last tokens. An empty prompt, or new tokens alone past the context, is an error."""
    if ids.numel() == 0:
        raise MoeError("--prompt encodes to no tokens; give some text to continue")
    if context is None:
        return ids
    if max_new_tokens >= context:
        raise MoeError(f"--max-new-tokens {max_new_tokens} leaves no room for the prompt in the model's context of "
                       f"{context} tokens; ask for fewer")
    room = context - max_new_tokens
    if ids.shape[1] > room:
        if not truncate:
            raise MoeError(f"the prompt is {ids.shape[1]} tokens and the model's context is {context}: with "
                           f"--max-new-tokens {max_new_tokens} it may be {room} at most. Shorten it, or pass "
                           "--truncate to keep its last tokens")
        ids = ids[:, -room:]
    return ids


def neuron_switch(artifact: str, neuron: str, theta: float | None):
    """``load``'s neuron argument for ``--neuron`` and ``--theta``: None (the plan), False, True or a config."""
    if theta is None:
        return {"plan": None, "on": True, "off": False}[neuron]
    if neuron == "off":
        raise MoeError("--theta sets neuron-level loading's threshold; it cannot go with --neuron off")
    import dataclasses

    from loader.neuron import NeuronConfig
    from loader.plan import read_plan

    plan = read_plan(artifact)
    base = NeuronConfig.from_params(plan.neuron.params) if plan.neuron.name == "sparse" else NeuronConfig()
    return dataclasses.replace(base, theta=NeuronConfig.from_params({"theta": theta}).theta)


@main.command("generate")
@click.argument("artifact", type=click.Path())
@click.option("--prompt", required=True, help="Text to continue.")
@click.option("--max-new-tokens", default=32, show_default=True, type=int)
@click.option("--memory-budget", default=None, help=BUDGET_HELP)
@click.option("--device", default="cpu", show_default=True)
@click.option("--store", default="disk", show_default=True, type=click.Choice(["disk", "host"]))
@click.option("--device-profile", "device_profile", default=None, type=click.Path(dir_okay=False),
              help="The profile the prediction printed at the end uses (default: the artifact's device.json).")
@click.option("--predictors", default=None,
              help="Prefetch predictors to run, comma-separated (next_gates, path_stats, first_gate), or 'none'; "
                   "default: the plan's. Prefetching never changes the output.")
@click.option("--exact-routing", is_flag=True,
              help="Route with the model's own top-k, not the plan's routing policy (adaptive gating, cache routing).")
@click.option("--planned-precision", is_flag=True,
              help="Read every miss at its planned precision, not as the plan's miss policy says (dynamic precision).")
@click.option("--neuron", type=click.Choice(["plan", "on", "off"]), default="plan", show_default=True,
              help="Neuron-level loading (CORM; needs a neuron-layout artifact): as the plan says, on, or off.")
@click.option("--theta", type=float, default=None,
              help="Neuron activity threshold, overriding the plan's (implies --neuron on).")
@click.option("--expert-dtype", type=click.Choice(list(EXPERT_DTYPES)), default="auto", show_default=True,
              help="The held form of a cached expert (loader/forms.py): auto (MOEPREP_EXPERT_DTYPE, else the "
                   "plan's, else int4pack on a CPU where it fits and bfloat16 otherwise), a decoded copy in "
                   "that dtype, int4pack (torch's CPU int4 kernel), or packed (the record, decoded on every "
                   "use: the smallest).")
@click.option("--threads", default="auto", show_default=True,
              help="torch's intra-op threads: auto (on a CPU, decode steps on the cores the reader threads leave "
                   "free and a prompt on torch's own count: see loader/README.md, 'Threads'), keep (torch's own "
                   "setting throughout), or a number.")
@click.option("--workers", default="auto", show_default=True,
              help="Reader threads, the expert reads in flight: auto (the plan's read_depth, measured best by "
                   "`moeprep profile-device`; else 2) or a number.")
@click.option("--ignore-device-file", is_flag=True,
              help="Run the plan as prepared, not with the techniques `moeload tune` switched off on this device "
                   "(tuning.json).")
@click.option("--dense", type=click.Choice(["plan", "int8", "float"]), default="plan", show_default=True,
              help="The dense weights' held form (loader/dense.py): the plan's, int8 (attention, shared experts "
                   "and the LM head computed from int8 codes by the compiled kernels, on a CPU) or float (as stored).")
@click.option("--truncate", is_flag=True,
              help="A prompt that leaves no room for --max-new-tokens in the model's context keeps its last tokens "
                   "(default: it is an error).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object {text, token_ids, stats}.")
def generate_command(artifact: str, prompt: str, max_new_tokens: int, memory_budget: str | None, device: str,
                     store: str, device_profile: str | None, predictors: str | None, exact_routing: bool, planned_precision: bool,
                     neuron: str, theta: float | None, expert_dtype: str, threads: str, workers: str,
                     ignore_device_file: bool, dense: str, truncate: bool, as_json: bool) -> None:
    """Greedy generation through the offloading runtime; streams the text, then prints the stats."""
    import torch
    from transformers import TextStreamer

    from loader.fit import prediction_inputs, preview
    from loader.memory import auto_budget, is_auto
    from loader.prefill import decode
    from loader.routing import MissPolicy, RoutingPolicy
    from loader.runtime import MAX_WORKERS, load, max_threads

    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise MoeError(f"--max-new-tokens must be from 1 to {MAX_NEW_TOKENS:,}, got {max_new_tokens}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise MoeError("--prompt is not valid UTF-8 text; pass the prompt as UTF-8") from None
    check_device(device)
    threads_arg = None if threads == "keep" else (threads if threads == "auto" else bounded_count(
        threads, "--threads", max_threads(), "auto, keep or a number of torch threads"))
    if workers != "auto":
        bounded_count(workers, "--workers", MAX_WORKERS, "auto or a number of reader threads")
    chosen = None if predictors is None else [p for p in predictors.replace(" ", "").split(",") if p and p != "none"]
    chosen_auto = None
    # the files the closing prediction reads, through the readers `moeload plan` and `verify` use: a refused device
    # profile or routing sample is refused here, before the load, with their message
    prediction_inputs(read_manifest(artifact), device_profile)
    if memory_budget is not None and is_auto(memory_budget):
        chosen_auto = auto_budget(device)  # once: the load and the prediction take the same number
        click.echo(chosen_auto.describe(), err=True)
        memory_budget = chosen_auto.budget_bytes
    loaded = load(artifact, device=device, memory_budget=memory_budget, store=store, predictors=chosen,
                  routing=RoutingPolicy() if exact_routing else None,
                  miss_policy=MissPolicy() if planned_precision else None,
                  neuron=neuron_switch(artifact, neuron, theta), expert_dtype=expert_dtype, threads=threads_arg,
                  workers=workers if workers == "auto" else int(workers), ignore_device_file=ignore_device_file,
                  dense=None if dense == "plan" else dense)
    if chosen_auto is not None:
        loaded.budget |= {"requested": "auto", "auto": chosen_auto.to_json()}
    if not as_json:
        click.echo(_tuning_line(loaded.budget["tuning"]), err=True)
    tok = loaded.tokenizer
    try:
        ids = torch.tensor([tok(prompt)["input_ids"]], dtype=torch.long, device=device)
        ids = fit_context(ids, max_new_tokens, context_length(loaded.model.config), truncate)
    except MoeError:
        loaded.close()
        raise
    streamer = None if as_json else TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)
    try:
        new, seconds = decode(loaded, ids, max_new_tokens, streamer)
    except BaseException:
        loaded.close()
        raise
    stats = loaded.stats()
    # what `moeload plan` predicts for this budget and this prompt's length (nothing loaded: a replay of the routing
    # sample the artifact carries), beside what was measured
    try:
        stats["predicted"] = preview(artifact, memory_budget, device, store, device_profile, ids.shape[1],
                                     expert_dtype, workers if workers == "auto" else int(workers),
                                     ignore_device_file=ignore_device_file)["prediction"]
    except MoeError as e:  # a prediction never fails a run that worked
        stats["predicted"] = {"available": False, "why": str(e)}
    stats["generate"] = {"time_to_first_token_s": loaded.last_prefill.seconds,
                         "prefill_tokens_per_second": loaded.last_prefill.tokens_per_second,
                         "decode_tokens": len(new) - 1, "decode_seconds": seconds,
                         "decode_tokens_per_second": (len(new) - 1) / seconds if len(new) > 1 and seconds > 0 else None}
    loaded.close()
    if as_json:
        click.echo(json.dumps({"text": tok.decode(new, skip_special_tokens=True), "token_ids": new,
                               "stats": stats}))
        return
    click.echo()
    _print_generate_stats(stats)


def _tuning_line(tuning: dict) -> str:
    """One line on the device file's decisions a load runs with (``loader.tuning.Applied.to_json``)."""
    if not tuning.get("applied"):
        return f"device file: {tuning.get('why')}"
    return (f"device file: tuned on {tuning['device']} at {tuning['budget_bytes']:,} B: kept "
            f"{', '.join(tuning['kept']) or 'none'}; switched off {', '.join(tuning['off']) or 'none'}")


def _print_generate_stats(stats: dict) -> None:
    """``moeload generate``'s summary of a run, for a person: speeds, the cache, each technique, each layer, and
    what ``moeload plan`` predicted beside what was measured."""
    g, pre = stats["generate"], stats["prefill"]
    click.echo(f"time to first token {g['time_to_first_token_s']:.3f} s  prefill {pre['tokens']} tokens at "
               f"{pre['tokens_per_second'] or 0:.1f} tokens/s in {pre['chunks']} chunk(s)  decode {g['decode_tokens']} "
               f"tokens at {g['decode_tokens_per_second'] or 0:.1f} tokens/s")
    click.echo(f"tokens {stats['tokens']}  tokens/s {stats['tokens_per_second'] or 0:.1f}  "
               f"hit rate {stats['hit_rate'] or 0:.3f}  read {stats['bytes_read']:,} B in "
               f"{stats['read_seconds']:.3f} s  stall {stats['stall_seconds']:.3f} s  "
               f"peak cache {stats['peak_cache_bytes']:,} B  direct I/O {stats['direct_io']}")
    for what in ("routing", "miss_policy", "neuron", "compute"):
        if stats.get(what):
            click.echo(f"{what.replace('_', ' ')}: " + "  ".join(f"{k} {v}" for k, v in stats[what].items()))
    pf = stats["prefetch"]
    if pf["predictors"]:
        click.echo(f"prefetch ({', '.join(pf['predictors'])}): issued {pf['issued']} used {pf['used']} "
                   f"wasted {pf['wasted']} cancelled {pf['cancelled']}  read time saved {pf['saved_seconds']:.3f} s")
    for layer, s in stats["layers"].items():
        click.echo(f"  layer {layer}: hits {s['hits']} misses {s['misses']} "
                   f"read {s['bytes_read']:,} B stall {s['stall_seconds']:.3f} s")
    p = stats["predicted"]
    if p["available"] and p["decode_tokens_per_s"] is not None:
        click.echo(f"predicted (moeload plan) decode {p['decode_tokens_per_s']:.2f} tok/s, measured "
                   f"{g['decode_tokens_per_second'] or 0:.2f}; time to first token "
                   + (f"{p['time_to_first_token_s']:.3f} s" if p["time_to_first_token_s"] is not None else "n/a")
                   + f", measured {g['time_to_first_token_s']:.3f} s (profile: {p['profile']})")
    else:
        click.echo(f"predicted (moeload plan): none, {p.get('why') or p.get('decode_why')}")


if __name__ == "__main__":
    main()
