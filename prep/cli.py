"""The `moeprep` command line: a thin click layer over the library.

Each command parses its options and calls one library function. Errors a user can cause arrive as a
`loader.errors.MoeError` (`MoeprepError` from prep, `ArtifactError`/`PlanError` from the loader that
eval and bench use); the group catches them for every command, prints `error: <message>` to stderr
and exits with status 1, without a traceback. Other exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import click

from loader.cli_group import LoaderGroup
from loader.vocab import GROUPS

# the studies' and eval's number options are bounded where a larger value would only hang or overflow
MAX_SEED = 2**32 - 1  # what numpy's and Optuna's seeded generators take
MAX_ITEMS = 10_000_000  # items per suite (evaluate.limit's bound)
MAX_RANK = 1024  # experts cache-conditional routing re-ranks (--max-rank)


@click.group(cls=LoaderGroup)
def main() -> None:
    """moeprep: prepare Mixture-of-Experts models for offloaded inference on small devices."""


def _format_table(info: dict) -> str:
    width = max(len(key) for key in info)
    lines = []
    for key, value in info.items():
        if isinstance(value, int) and not isinstance(value, bool) and value >= 10_000:
            value = f"{value:,}"
        elif isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        lines.append(f"{key.ljust(width)}  {value}")
    return "\n".join(lines)


@main.command("inspect-model")
@click.argument("models", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--table", "recipes_table", is_flag=True,
              help="MODELS are real-model recipes: print the supported-models table (markdown) from their configs.")
@click.option("--data", default=None, type=click.Path(file_okay=False, exists=True),
              help="With --table: also the wall-time floor of `moeprep eval` per suite on these benchmark files.")
@click.option("--readme", default=None, type=click.Path(dir_okay=False, exists=True),
              help="With --table: rewrite the table blocks of this file (README.md) instead of printing them.")
def inspect_model_command(models: tuple[str, ...], as_json: bool, recipes_table: bool, data: str | None,
                          readme: str | None) -> None:
    """Show how moeprep sees MODEL (a local directory, its config.json, or a hub id): MoE layers, experts,
    sizes. With --table, MODELS are recipes and the output is the README's table of supported models."""
    from prep.adapters import inspect_model

    if recipes_table:
        from prep.inspect import EVAL_MARKERS, MARKERS, eval_time_table, models_table, update_readme

        tables = [("models table", models_table(list(models)), MARKERS)]
        if data is not None:
            tables.append(("eval wall times", eval_time_table(list(models), data), EVAL_MARKERS))
        for what, table, markers in tables:
            if readme is None:
                click.echo(table)
            else:
                changed = update_readme(readme, table, markers)
                click.echo(f"{readme}: {what} {'updated' if changed else 'already current'}")
        return
    if len(models) != 1 or readme is not None or data is not None:
        raise click.UsageError("give one MODEL (several, --data and --readme only with --table)")
    info = inspect_model(models[0])
    click.echo(json.dumps(info, indent=2) if as_json else _format_table(info))


def _executor_options(what: str):
    """--executor and --ray-address (the recipe's executor section) for a command whose ``what`` runs as work units."""
    def decorate(command):
        command = click.option("--ray-address", default=None, metavar="ADDR",
                               help="With --executor ray: auto (the cluster of `ray start`), local (a Ray instance on "
                               "this machine only) or ray://head:10001 (the recipe's executor.address).")(command)
        return click.option("--executor", type=click.Choice(["local", "ray"]), default=None,
                            help=f"Where {what} run: one after another in this process, or side by side on a Ray "
                            "cluster (the recipe's executor.kind; needs `pip install -e '.[ray]'`). Changes no "
                            "output.")(command)
    return decorate


@main.command("prepare")
@click.option("--recipe", "recipe_path", required=True, type=click.Path(dir_okay=False),
              help="Recipe YAML, e.g. recipes/reference.yaml.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one recipe value (repeatable).")
@click.option("--output", type=click.Path(file_okay=False), default=None,
              help="Artifact directory (default artifacts/<recipe name>/artifact).")
@click.option("--until", default=None, help="Stop after this stage.")
@click.option("--force", default=None, help="Rerun this stage and every stage after it.")
@click.option("--overwrite", is_flag=True,
              help="Replace --output even when it is not a moeprep artifact (deleting what it holds).")
@click.option("--device", default="cpu", show_default=True,
              help="Where the stages run the model: cpu or cuda (every forward; HQQ stays on the CPU, so the "
              "records are the same bytes either way).")
@click.option("--expert-memory", default="auto", show_default=True,
              help="Routed-expert bytes kept in memory between uses (e.g. 8GiB); 0: one MoE layer at a time; "
              "all: every layer once read; auto: what fits in half the memory available. The dense weights "
              "always load whole. Changes no result, only memory and re-reads of the checkpoint.")
@click.option("--device-profile", "device_profile", default=None, type=click.Path(dir_okay=False),
              help="Plan for this device: a profile from `moeload profile-device` run there (the recipe's plan.device "
              "in its place; the artifact carries it, and `moeload plan` predicts with it).")
@_executor_options("the stages' work units")
@click.option("--dry-run", is_flag=True,
              help="Read no weights: print the model (from the recipe's shipped config), the stages that would run, "
              "the sizes and what the budgets cache, then every refusal the run would make (exit 1 if any).")
def prepare_command(recipe_path: str, overrides: tuple[str, ...], output: str | None, until: str | None,
                    force: str | None, overwrite: bool, device: str, expert_memory: str, device_profile: str | None,
                    executor: str | None, ray_address: str | None, dry_run: bool) -> None:
    """Run the preparation pipeline of a recipe and write its artifact."""
    from prep.executor import executor_overrides
    from prep.pipeline import prepare
    from prep.recipe import load_recipe

    overrides += executor_overrides(executor, ray_address)
    if device_profile is not None:
        from loader.device import load_profile

        load_profile(device_profile)  # a damaged profile is refused here, naming the file, before any stage runs
        overrides += (f"plan.device={Path(device_profile).resolve()}",)
    memory = _expert_memory(expert_memory)  # before the dry run, which refuses what the run refuses

    if dry_run:
        from prep.inspect import dry_run as describe
        from prep.pipeline import preflight

        recipe = load_recipe(recipe_path, overrides)
        click.echo(describe(recipe), nl=False)
        problems = preflight(recipe, ".", output, overwrite, device, until, force)
        for problem in problems:  # what the run would refuse, before reading a weight
            click.echo(f"error: {problem}", err=True)
        if problems:
            raise SystemExit(1)
        return

    summary = prepare(load_recipe(recipe_path, overrides), root=".", output=output, until=until, force=force,
                      overwrite=overwrite, device=device, expert_memory=memory)
    for stage, info in summary.items():
        if stage != "artifact":
            state = "skipped" if info.get("skipped") else "cached" if info["cached"] else f"{info['seconds']:.1f} s"
            click.echo(f"{stage:10s} {info['key']}  {state}")
    if summary["artifact"]:
        click.echo(f"artifact: {summary['artifact']}")


def _expert_memory(text: str) -> int | str | None:
    """--expert-memory: "auto" -> "auto", "all" -> None, "0" -> 0, a size like 8GiB -> bytes."""
    from loader.plan import PlanError, parse_budget

    if text.strip().lower() in ("all", "auto"):
        return None if text.strip().lower() == "all" else "auto"
    if text.strip() == "0":
        return 0
    try:
        kind, value = parse_budget(text)
    except PlanError:
        kind = None
    if kind != "bytes":
        raise click.BadParameter(f"{text!r}: give bytes or a size like 8GiB, 0 for one layer at a time, all or auto",
                                 param_hint="--expert-memory")
    return int(value)


@main.command("eval")
@click.option("--artifact", required=True, type=click.Path(file_okay=False), help="The prepared artifact.")
@click.option("--model", "original", default=None, help="The original model (default: the manifest's source).")
@click.option("--suites", default="gsm8k,mmlu,truthfulqa", show_default=True, help="Comma-separated suites.")
@click.option("--data", default=None, help="Suites directory (reference or original layout), or hf: for the hub. "
              "Default: suites/ beside the original model.")
@click.option("--limit", type=click.IntRange(max=MAX_ITEMS), default=None,  # below 1: check_settings' message
              help="First N items of each suite.")
@click.option("--num-fewshot", type=click.IntRange(max=64), default=None,
              help="Override every suite's shot count (0 allowed).")
@click.option("--gsm8k-format", type=click.Choice(["cot", "plain"]), default="cot", show_default=True,
              help="cot: the harness's gsm8k_cot (8-shot Q:/A:); plain: gsm8k (5-shot, #### N).")
@click.option("--memory-budget", default=None, help="Loader budget for the prepared model.")
@click.option("--output", default=None, type=click.Path(dir_okay=False),
              help="Report JSON (a .md summary is written beside it). Default: <artifact>/../eval.json.")
@click.option("--reuse-original", default=None, type=click.Path(file_okay=False),
              help="Directory keeping the original model's per-item results (keyed by its content, the items and "
              "the settings): comparing several artifacts of one model then runs the original once.")
@click.option("--expert-memory", default="auto", show_default=True,
              help="The original's routed-expert bytes kept in memory between forwards (as for prepare; 0 rereads "
              "the checkpoint every forward).")
@click.option("--divergence-sequences", default=64, show_default=True, type=click.IntRange(0, 100_000),
              help="Held-out windows (after the text the artifact was calibrated on) for the divergence: mean KL, "
              "top-token agreement and perplexity with 95% intervals; 0 skips it.")
@click.option("--divergence-length", default=None, type=click.IntRange(2, 1 << 17),
              help="Tokens per held-out window [default: 256, or the model's context if shorter].")
def eval_command(artifact, original, suites, data, limit, num_fewshot, gsm8k_format, memory_budget, output,
                 reuse_original, expert_memory, divergence_sequences, divergence_length):
    """Compare the prepared model (through the loader) with the original: its divergence on held-out text, then
    item by item on the suites; the artifact's report.json and report.md show both afterwards."""
    import time
    from pathlib import Path

    from prep.evals.compare import check_settings, evaluate_artifact, summary_markdown
    from prep.stages.divergence import divergence_markdown, divergence_of_existing
    from prep.stages.table import REPORT

    check_settings(limit, num_fewshot, gsm8k_format)  # bad settings are refused before the divergence's minutes
    if divergence_sequences:
        if divergence_sequences < 4:
            raise click.BadParameter("at least 4 (the interval is a bootstrap over windows), or 0 to skip",
                                     param_hint="--divergence-sequences")
        started = time.perf_counter()
        found = divergence_of_existing(artifact, original, divergence_sequences, divergence_length, memory_budget,
                                       _expert_memory(expert_memory), layout=REPORT)
        click.echo(divergence_markdown(found.report_entry()) +
                   f"\n\n(divergence measured in {time.perf_counter() - started:.1f} s)\n")

    output = output or str(Path(artifact).parent / "eval.json")
    report = evaluate_artifact(artifact, original, _names(suites), data,
                               limit, num_fewshot, memory_budget, gsm8k_format, output=output,
                               reuse_original=reuse_original, expert_memory=_expert_memory(expert_memory),
                               layout=REPORT)
    click.echo(summary_markdown(report))
    click.echo(f"wrote {output}")


@main.command("accuracy")
@click.option("--artifact", default="artifacts/reference/artifact", show_default=True,
              type=click.Path(file_okay=False), help="The prepared artifact (its report.json holds the check to size from).")
@click.option("--work", default=None, type=click.Path(file_okay=False),
              help="Where the suites, the original's rows, accuracy.json and accuracy.md go. Default: "
              "<artifact>/../accuracy.")
@click.option("--data", default=None, help="Suites to score instead of generating held-out items (needed for an "
              "artifact not prepared from the reference model).")
@click.option("--model", "original", default=None, help="The original model (default: the manifest's source).")
@click.option("--gsm8k", default=None, type=click.IntRange(1, 1_000_000),
              help="GSM8K's cap in items (it generates text, the slow suite). Default: what ~30 minutes on 2 CPU "
              "cores afford.")
@click.option("--mmlu", default=None, type=click.IntRange(1, 1_000_000),
              help="MMLU items instead of the items that resolve one point at the check's flip rate.")
@click.option("--truthfulqa", default=None, type=click.IntRange(1, 1_000_000),
              help="TruthfulQA items instead of the items that resolve one point at the check's MC1 flip rate.")
@click.option("--memory-budget", default=None, help="Loader budget for the prepared model (default: the check's).")
@click.option("--seed", default=2026, show_default=True, type=click.IntRange(0, MAX_SEED), help="The held-out generator's seed.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
              help="Where both models run.")
@click.option("--suites", default=None, help="Comma-separated suites to resolve [default: every suite the check "
              "scored].")
def accuracy_command(artifact, work, data, original, gsm8k, mmlu, truthfulqa, memory_budget, seed, device, suites):
    """Resolve the artifact's accuracy to one point: size each suite from the check's flips, score that many
    held-out items, and state each delta with its 95% interval (accuracy.json, accuracy.md, report.json's
    resolved_accuracy and report.md)."""
    from prep.evals.resolved import GSM8K_ITEMS, resolve_accuracy, resolved_markdown
    from prep.stages.table import REPORT

    entry = resolve_accuracy(artifact, work, data, original, gsm8k or GSM8K_ITEMS,
                             {"mmlu": mmlu, "truthfulqa": truthfulqa}, memory_budget, seed, REPORT, say=click.echo,
                             device=device, suites=None if suites is None else _names(suites))
    click.echo(resolved_markdown({"resolved_accuracy": entry}))
    click.echo(f"wrote {Path(work or Path(artifact).parent / 'accuracy') / 'accuracy.json'}, accuracy.md; "
               f"merged into {artifact}/report.json")


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated list of names (suites, budgets), blanks dropped."""
    return tuple(n.strip() for n in text.split(",") if n.strip())


def _study_suites(command):
    """The studies' accuracy options: --suites, --data and --limit (each study scores with `moeprep eval`)."""
    for option in reversed((
            click.option("--suites", default="gsm8k,mmlu,truthfulqa", show_default=True, help="Comma-separated suites."),
            click.option("--data", default=None, help="Suites directory (default: suites/ beside the original model)."),
            click.option("--limit", type=click.IntRange(1, MAX_ITEMS), default=None,
                         help="First N items of each suite (default: all)."))):
        command = option(command)
    return command


def _floats(text: str, what: str, low: float = 0.0, high: float = math.inf) -> tuple[float, ...]:
    """Comma-separated numbers, each finite and in [low, high]: a bad one is refused before the study's work."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{what} must be comma-separated numbers, got {text!r}") from None
    if bad := [v for v in values if not (math.isfinite(v) and low <= v <= high)]:
        where = f"from {low:g} to {high:g}" if math.isfinite(high) else f"finite and at least {low:g}"
        raise click.BadParameter(f"{what}: each number must be {where}, got {bad[0]!r}")
    return values


@main.command("bitwidth-study")
@click.option("--recipe", "recipe_path", default="recipes/reference.yaml", show_default=True,
              type=click.Path(dir_okay=False), help="The recipe every row derives from.")
@click.option("--output", default="artifacts/bitwidth-study", show_default=True, type=click.Path(file_okay=False),
              help="Where the rows' artifacts and evals, study.json, study.md and study.png go.")
@click.option("--tolerances", default="0.0015,0.002,0.003,0.004,0.005", show_default=True,
              help="edgemoe tolerances (mean next-token KL, nats); the middle one sets the random row's bytes.")
@click.option("--shares", default="0.25,0.5", show_default=True, help="frequency shares q.")
@_study_suites
@click.option("--memory-budget", default=None, help="Loader budget for every row (default: each plan's).")
@click.option("--into", default=None, type=click.Path(file_okay=False),
              help="Also put the study into this artifact: report.json's bitwidth_study, report.md and report.png.")
@_executor_options("the rows, one work unit each,")
def bitwidth_study_command(recipe_path, output, tolerances, shares, suites, data, limit, memory_budget, into,
                           executor, ray_address):
    """Prepare and evaluate every bit-width configuration: uniform int8/int4/int3/int2, edgemoe at each
    tolerance, frequency at each share, and a random control with the middle edgemoe row's bytes."""
    from pathlib import Path

    from prep.studies.bitwidth import merge_study_into, run_study

    study = run_study(recipe_path, output, tolerances=_floats(tolerances, "--tolerances", 1e-9),
                      shares=_floats(shares, "--shares", 1e-9, 1.0), suites=_names(suites),
                      limit=limit, data=data, memory_budget=memory_budget, executor=executor,
                      ray_address=ray_address, echo=lambda m: click.echo(m, err=True))
    if into:
        merge_study_into(into, study)
    click.echo((Path(output) / "study.md").read_text())
    click.echo(f"wrote {Path(output) / 'study.json'}, study.md, study.png" + (f"; merged into {into}" if into else ""))


@main.command("prediction-study")
@click.option("--recipe", "recipe_path", default="recipes/reference-lossless.yaml", show_default=True,
              type=click.Path(dir_okay=False), help="The recipe whose model makes the fresh trace.")
@click.option("--artifact", default=None, type=click.Path(file_okay=False),
              help="The prepared artifact whose predictors to replay [default: artifacts/<recipe name>/artifact].")
@click.option("--budgets", default="25%,50%", show_default=True, help="Comma-separated memory budgets.")
@click.option("--seed", default=1, show_default=True, type=click.IntRange(0, MAX_SEED),
              help="Calibration seed of the fresh text (not the recipe's own, which the predictors were fitted on).")
@click.option("--sequences", default=8, show_default=True, type=click.IntRange(1, 10_000),
              help="Sequences of fresh text (each calibration.sequence_length tokens).")
@click.option("--profile", default=None, type=click.Path(dir_okay=False),
              help="Device profile JSON (moeprep profile-device) for modelled stall seconds.")
@click.option("--output", default="artifacts/prediction-study", show_default=True, type=click.Path(file_okay=False),
              help="Where the fresh trace and study.json go.")
@click.option("--traces", default="../shared/data/traces", show_default=True, type=click.Path(),
              help="The real routing traces: path statistics fitted on one Mixtral problem, measured on the other.")
@click.option("--bench", "bench", default=None, type=click.Path(dir_okay=False),
              help="A bench.json of `moeprep bench --subject <recipe name>`: its prefetch rows go into the study.")
@click.option("--into", is_flag=True, help="Also merge the study into the artifact's report.json and report.md.")
def prediction_study_command(recipe_path, artifact, budgets, seed, sequences, profile, traces, bench, output, into):
    """Replay the artifact's prefetch predictors through the simulator on fresh text: demand misses, modelled
    stall and prefetches used/wasted, per budget, each predictor alone and all together, against none."""
    from pathlib import Path

    from loader.device import load_profile
    from loader.io import write_json_atomic
    from prep.errors import MoeprepError
    from prep.recipe import load_recipe
    from prep.sim.simulate import parse_list
    from prep.studies.common import fresh_trace
    from prep.studies.prediction import merge_into, prediction_study_markdown, run_study

    recipe = load_recipe(recipe_path)
    artifact = Path(artifact or Path("artifacts") / recipe.name / "artifact")
    if not (artifact / "manifest.json").is_file():
        raise MoeprepError(f"{artifact} is not a prepared artifact; run `moeprep prepare --recipe {recipe_path}` first")
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    trace = fresh_trace(recipe_path, Path("."), out, seed, sequences)
    study = run_study(artifact, trace, parse_list(budgets, "--budgets"), load_profile(profile) if profile else None,
                      mixtral_traces=traces, bench=bench, subject=recipe.name)
    write_json_atomic(out / "study.json", study)
    if into:
        merge_into(artifact, study)
    click.echo(prediction_study_markdown(study))
    click.echo(f"wrote {out / 'study.json'}" + (f"; merged into {artifact}" if into else ""))


@main.command("policy-study")
@click.option("--trace", default="../shared/data/traces", show_default=True, type=click.Path(),
              help="A routing trace with two or more sequences: the real Mixtral GSM8K traces, or a project trace.")
@click.option("--capacity", default="2,4,6", show_default=True, help="Records per layer the caches hold.")
@click.option("--trials", default=40, show_default=True, type=click.IntRange(1, 10000), help="Optuna trials per fit.")
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0, MAX_SEED))
@click.option("--output", default=None, type=click.Path(dir_okay=False), help="Also write the study as JSON here.")
def policy_study_command(trace, capacity, trials, seed, output):
    """HOBBIT's cache weights tuned on one sequence and tested on another, against LRU, LFU and EdgeMoE."""
    from pathlib import Path

    from loader.io import write_json_atomic
    from prep.sim.simulate import parse_list
    from prep.studies.policy import run_study, study_markdown

    study = run_study(trace, parse_list(capacity, "--capacity", int), trials=trials, seed=seed)
    if output:
        write_json_atomic(Path(output), study)
    click.echo(study_markdown(study))


@main.command("routing-study")
@click.option("--recipe", "recipe_path", default="recipes/reference-lossless.yaml", show_default=True,
              type=click.Path(dir_okay=False), help="The recipe the study's artifact is prepared from.")
@click.option("--output", default="artifacts/routing-study", show_default=True, type=click.Path(file_okay=False),
              help="Where the study's artifact, the fresh trace, study.json, study.md and study.png go.")
@click.option("--budgets", default="25%,50%", show_default=True, help="Comma-separated memory budgets.")
@click.option("--gating", default="0.1,0.25,0.4", show_default=True, help="Target single-expert shares.")
@click.option("--dynamic", default="0.85/0,0.67/0.03,0.5/0.1", show_default=True,
              help="Target high/skip splits of dynamic precision.")
@click.option("--lambdas", default="0.25,0.5,1", show_default=True, help="Cache-prior lambdas.")
@click.option("--max-rank", default="3,4", show_default=True, help="Max-rank m values.")
@_study_suites
@click.option("--low", default="int4", show_default=True, help="Precision of dynamic precision's low copies.")
@click.option("--into", default=None, type=click.Path(file_okay=False),
              help="Also put the curves into this artifact: report.json routing_curves, report.md, report-routing.png.")
@_executor_options("the points, one work unit each,")
def routing_study_command(recipe_path, output, budgets, gating, dynamic, lambdas, max_rank, suites, data, limit, low,
                          into, executor, ray_address):
    """Accuracy against miss rate and bytes per token for adaptive gating, dynamic precision and
    cache-conditional routing, each swept across its knob, at each budget."""
    from pathlib import Path

    from prep.studies.routing import merge_into, run_study

    try:
        knobs = {"gating": _floats(gating, "--gating", 0.0, 1.0) if gating else (),
                 "dynamic_precision": tuple(_floats(pair.replace("/", ","), "--dynamic", 0.0, 1.0)
                                            for pair in dynamic.split(",") if pair),
                 "cache_prior": _floats(lambdas, "--lambdas", 0.0, 1e6) if lambdas else (),
                 "max_rank": tuple(int(m) for m in max_rank.split(",") if m.strip())}
    except ValueError:
        raise click.BadParameter("--dynamic is high/skip pairs like 0.67/0.03, --max-rank whole numbers") from None
    if any(len(pair) != 2 for pair in knobs["dynamic_precision"]):
        raise click.BadParameter("--dynamic is high/skip pairs like 0.67/0.03")
    if any(not 1 <= m <= MAX_RANK for m in knobs["max_rank"]):
        raise click.BadParameter(f"--max-rank values must be from 1 to {MAX_RANK} (experts re-ranked), got {max_rank!r}")
    study = run_study(recipe_path, output, budgets=_names(budgets),
                      knobs=knobs, suites=_names(suites), limit=limit,
                      data=data, low=low, executor=executor, ray_address=ray_address,
                      echo=lambda m: click.echo(m, err=True))
    if into:
        merge_into(into, study, (Path(output) / "study.png").read_bytes())
    click.echo((Path(output) / "study.md").read_text())
    click.echo(f"wrote {Path(output) / 'study.json'}, study.md, study.png" + (f"; merged into {into}" if into else ""))


@main.command("neuron-study")
@click.option("--recipe", "recipe_path", default="recipes/reference-lossless.yaml", show_default=True,
              type=click.Path(dir_okay=False), help="The recipe the study's neuron-layout artifact is prepared from.")
@click.option("--output", default="artifacts/neuron-study", show_default=True, type=click.Path(file_okay=False),
              help="Where the study's artifact, study.json and study.md go.")
@click.option("--thetas", default="0,0.05,0.1,0.2,0.3", show_default=True, help="Comma-separated activity thresholds.")
@click.option("--budget", default="25%", show_default=True, help="The memory budget of every decode run.")
@_study_suites
@click.option("--sequences", type=click.IntRange(1, 1000), default=4, show_default=True,
              help="Sequences of fresh text decoded one token per call.")
@click.option("--sequence-length", type=click.IntRange(2, 100000), default=64, show_default=True)
@click.option("--trust-theta", type=click.FloatRange(0, 1e6), default=None,
              help="theta of the trust_prediction point (default: the stage's theta).")
@click.option("--into", is_flag=True, help="Also merge the study into the study artifact's report.json and report.md.")
def neuron_study_command(recipe_path, output, thetas, budget, suites, data, limit, sequences, sequence_length,
                         trust_theta, into):
    """Bytes read per decoded token, tokens/s and accuracy across theta, with and without CORM's predictor,
    against whole-expert loading at the same budget."""
    from pathlib import Path

    from prep.studies.neuron import merge_into, run_study

    if trust_theta is not None and not math.isfinite(trust_theta):  # click's range lets NaN through
        raise click.BadParameter(f"must be a finite number >= 0, got {trust_theta}", param_hint="--trust-theta")
    study = run_study(recipe_path, output, thetas=_floats(thetas, "--thetas", 0.0, 1e6), budget=budget,
                      suites=_names(suites), limit=limit, data=data,
                      sequences=sequences, sequence_length=sequence_length, trust_theta=trust_theta,
                      echo=lambda m: click.echo(m, err=True))
    if into:
        merge_into(Path(output) / "artifact", study)
    click.echo((Path(output) / "study.md").read_text())
    click.echo(f"wrote {Path(output) / 'study.json'}, study.md" + (f"; merged into {Path(output) / 'artifact'}" if into else ""))


@main.command("reference-model")
@click.option("--out", default="recipes/reference", show_default=True, type=click.Path(file_okay=False),
              help="Where model/, suites/ and training.json are written.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
def reference_model_command(out: str, device: str) -> None:
    """Generate the reference data and train the reference MoE from scratch (seeded)."""
    from prep.reference.train import build_reference

    report = build_reference(out, device=device)
    click.echo(f"trained in {report['train_seconds']} s on {report['device']}; wrote {out}/model")


@main.command("reference-suites")
@click.option("--dir", "ref_dir", default="recipes/reference", show_default=True,
              type=click.Path(file_okay=False, exists=True), help="Directory holding training.json and suites/.")
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="Where the extended suites go (then `moeprep eval --data OUT`).")
@click.option("--seed", default=2026, show_default=True, type=click.IntRange(0, MAX_SEED),
              help="The generator's seed (not the training seed).")
@click.option("--gsm8k", default=700, show_default=True, type=click.IntRange(0, 100_000), help="GSM8K items to add.")
@click.option("--mmlu", default=600, show_default=True, type=click.IntRange(0, 100_000), help="MMLU items to add.")
@click.option("--truthfulqa", default=300, show_default=True, type=click.IntRange(0, 100_000),
              help="TruthfulQA items to add.")
@click.option("--replace", is_flag=True,
              help="Replace --out even when it holds other files or is the shipped suites/ (by default both are refused).")
def reference_suites_command(ref_dir: str, out: str, seed: int, gsm8k: int, mmlu: int, truthfulqa: int,
                             replace: bool) -> None:
    """Extend the reference model's held-out suites with items from its own generator that are in neither its
    training corpus nor the shipped suites, so a paired check can resolve smaller differences."""
    from prep.reference.train import write_extended_suites

    stats = write_extended_suites(ref_dir, out, seed, {"gsm8k": gsm8k, "mmlu": mmlu, "truthfulqa": truthfulqa},
                                  replace=replace)
    for name, s in stats.items():
        click.echo(f"{name:10s} added {s['made']} of {s['asked']} (rejected: {s['in_training']} in the training "
                   f"corpus, {s['duplicate']} already in the suites)")
    click.echo(f"wrote {out}; score with `moeprep eval --data {out}`")


@main.command("reference-metrics")
@click.option("--dir", "ref_dir", default="recipes/reference", show_default=True,
              type=click.Path(file_okay=False, exists=True), help="Directory holding model/ and suites/.")
def reference_metrics_command(ref_dir: str) -> None:
    """Score the reference model on its held-out suites and write metrics.json."""
    from prep.reference.metrics import TARGETS, measure_reference

    metrics = measure_reference(ref_dir)
    for key in TARGETS:
        mark = "ok" if metrics["meets_targets"][key] else "BELOW TARGET"
        click.echo(f"{key:28s} {metrics[key]:.4f}  (target {TARGETS[key]})  {mark}")
    noise = ", ".join(f"{level}: {acc:.3f}" for level, acc in metrics["expert_noise_mmlu_acc"].items())
    click.echo(f"MMLU with experts zeroed {metrics['experts_zeroed_mmlu_acc']:.3f}; with expert noise (x std) {noise}; "
               f"INT2 relative error {metrics['int2_expert_relative_error']:.3f}")
    click.echo(f"with INT2 experts: MMLU {metrics['int2_mmlu_acc']:.3f}, TruthfulQA MC1 {metrics['int2_truthfulqa_mc1']:.3f}, "
               f"GSM8K {metrics['int2_gsm8k_exact_match']:.3f}")


@main.command("bench")
@click.option("--subject", default="all", show_default=True,
              help="What to measure: all, or a comma-separated subset of reference, reference-lossless, "
                   "reference-neuron, mixtral-shape, mixtral-shape-own, mixtral-shape-techniques.")
@click.option("--budgets", default=None,
              help="Comma-separated shares of the source model's expert bytes, and 4bit-25% (dense + 25% of the "
                   "experts at 4 bits). [default: 100%,50%,25%,12.5%,4bit-25%; with --quick: 25%]")
@click.option("--repeats", default=None, type=click.IntRange(1, 1000),
              help="Runs of every configuration, interleaved; rows give the median, min and max. [default: 3; "
                   "with --quick: 1]")
@click.option("--quick", is_flag=True, help="Smoke-sized: tiny mixtral-shape, one budget, a few tokens.")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--store", type=click.Choice(["auto", "disk", "host"]), default="auto", show_default=True,
              help="Where the loader's expert stores live: auto is host RAM on CUDA (pinned) and the disk on a CPU.")
@click.option("--systems", "only", default=None,
              help="Comma-separated systems to run (e.g. naive,moeprep); without resident its candidates are "
                   "skipped too. [default: all]")
@click.option("--output", default="artifacts/bench", show_default=True, type=click.Path(file_okay=False),
              help="Where bench.json, bench.md, bench.png (and the mixtral-shape model) go.")
@click.option("--traces", default="../shared/data/traces", show_default=True, type=click.Path(),
              help="The real routing traces (holding mixtral-8x7b/gsm8k_routing.jsonl).")
@click.option("--prefill", default=None,
              help="Comma-separated prompt lengths in tokens (e.g. 512,2048): adds prefill rows (time to first token, "
                   "prompt tokens/s, moeprep's bound, peak RSS) on mixtral-shape and mixtral-shape-own, at --budgets "
                   "where given, else 100%,25%,4bit-25%. About 10 minutes per subject for 512,2048 on 2 cores. "
                   "[default: none]")
@click.option("--decode/--no-decode", default=True, show_default=True,
              help="Run the decode rows; --no-decode with --prefill measures the prompts alone.")
@click.option("--tune-minutes", default=3.0, show_default=True, type=click.FloatRange(0.05, 600),
              help="`moeload tune`'s time limit per subject and budget for the moeprep+tuned rows.")
def bench_command(subject, budgets, repeats, quick, device, store, only, output, traces, prefill, decode,
                  tune_minutes) -> None:
    """Decode (and with --prefill, prompt) speed of resident, accelerate offloading, naive offloading and moeprep
    at each budget."""
    from pathlib import Path

    from prep.studies.bench.report import goal_check
    from prep.studies.bench.run import run_bench

    report = run_bench(subject, budgets, quick, device, output, traces, echo=lambda m: click.echo(m, err=True),
                       repeats=repeats, store=store, only=only, prefill=prefill, decode=decode,
                       tune_minutes=tune_minutes)
    for r in report["results"]:
        speed = (f"{r['decode_tokens_per_s']:.3g} tok/s (min {r['decode_tokens_per_s_min']:.3g}, max "
                 f"{r['decode_tokens_per_s_max']:.3g}, {r['repeats']} runs)") if r.get("decode_tokens_per_s") \
            else r.get("error")
        click.echo(f"{r['subject']:24s} {r['budget']:>8s} {r['system']:22s} {speed}")
    for r in (report.get("prefill") or {}).get("rows", []):
        speed = (f"ttft {r['ttft_s']:.3g} s, {r['prefill_tokens_per_s']:.3g} tok/s"
                 + (f", {r['fraction_of_bound']:.2f} of bound" if r.get("fraction_of_bound") else "")
                 if r.get("prefill_tokens_per_s") else r.get("error"))
        click.echo(f"{r['subject']:24s} {r['budget']:>8s} prefill {r['prompt_tokens']:<6d} {r['system']:22s} {speed}")
    for line in goal_check(report):
        click.echo(f"goal: {line}")
    out = Path(output)
    click.echo(f"wrote {out / 'bench.json'}, {out / 'bench.md'}, {out / 'bench.png'} "
               f"in {report['wall_seconds']:.0f} s")


@main.command("simulate")
@click.option("--trace", required=True, type=click.Path(),
              help="A trace directory (index.json) or the real Mixtral traces (gsm8k_routing.jsonl, its directory, or "
              "../shared/data/traces).")
@click.option("--plan", "plan", default=None, type=click.Path(),
              help="plan.json or an artifact directory: capacities from the plan and --budget, as the loader builds them.")
@click.option("--budget", default=None, help="With --plan: memory budget (bytes, 1.5GiB, 25%; default: the plan's).")
@click.option("--policy", default=None,
              help="Eviction policy: lru, lfu, lfu-global, lhu, fld, edgemoe, hobbit, belady; comma-separated or 'all' "
              "for a sweep. Default: the plan's, else lru.")
@click.option("--capacity", default=None, help="Experts cached per layer, e.g. 4, or 2,4,6 for a sweep.")
@click.option("--group", type=click.Choice([*GROUPS, "both"]), default="layer", show_default=True,
              help="One eviction group per layer, or one global pool of N x layers records.")
@click.option("--param", "params", multiple=True, metavar="KEY=VALUE", help="A policy parameter (JSON value), repeatable.")
@click.option("--record-bytes", type=int, default=None,
              help="Bytes of one expert record when there is no artifact [default: 99090432, one Mixtral-8x7B expert "
              "at int4 with group-64 float16 scales and zeros; 1 byte to 1 TiB].")
@click.option("--profile", default=None, type=click.Path(dir_okay=False),
              help="Device profile JSON (moeprep profile-device) for modelled seconds.")
@click.option("--warm", is_flag=True, help="Keep the cache across sequences (reset only), instead of a cold start each.")
@click.option("--predictors", default=None,
              help="With --plan ARTIFACT and a project trace: prefetch predictors to replay (next_gates, path_stats, "
              "first_gate, comma-separated, or 'plan'); a prefetch is modelled as landing before its layer runs.")
@click.option("--cpu-misses", default=None,
              help="The loader's load(cpu_misses=...) rule: never (default), always, or the precisions whose misses "
              "the CPU computes from the host store (e.g. int4,int2: what auto measured); counted as cpu_computed.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (a single run, or {'runs': [...]}).")
@click.option("--plot", default=None, type=click.Path(dir_okay=False),
              help="Write miss rate against capacity (one line per policy, Belady the floor) to this PNG.")
@click.option("--prefill", "prefill_tokens", default=None, type=int,
              help="Model a prompt of this many tokens of the trace instead (the loader's chunked prefill, "
                   "prep/sim/prefill.py): needs --plan ARTIFACT and --profile.")
def simulate_command(trace, plan, budget, policy, capacity, group, params, record_bytes, profile, warm, predictors,
                     cpu_misses, as_json, plot, prefill_tokens):
    """Replay a routing trace through the loader's expert cache and report hits, misses, bytes and seconds."""
    from prep.sim.report import format_result, format_sweep, plot_sweep
    from prep.sim.simulate import parse_params, simulate_trace

    if prefill_tokens is not None:
        from prep.sim.prefill import artifact_prefill

        model = artifact_prefill(trace, plan, budget, profile, prefill_tokens)
        if as_json:
            click.echo(json.dumps(model.to_json(), indent=2))
        else:
            click.echo(f"prefill of {model.tokens} tokens in {model.chunks} chunk(s): {model.seconds:.3f} s to the first "
                       f"token, {model.tokens_per_second:.1f} tokens/s; {model.reads} reads ({model.read_bytes:,} B, "
                       f"{model.read_seconds:.3f} s), expert compute {model.compute_seconds:.3f} s, overhead "
                       f"{model.layer_overhead_seconds + model.token_overhead_seconds:.3f} s")
            from loader.device import load_profile

            if not load_profile(profile).prefill_seconds:
                click.echo("note: the profile has no prefill timings, so each expert's compute is counted as that many "
                           "decode steps (an upper bound); measure it again with `moeprep profile-device`")
        return

    groups = GROUPS if group == "both" else (group,)
    replay, runs = simulate_trace(trace, plan, budget, policy, capacity, groups, parse_params(params), record_bytes,
                                  profile=profile, cold_start=not warm, predictors=predictors, cpu_misses=cpu_misses)
    if plot:
        plot_sweep(runs, plot, title=f"{replay.source}: miss rate, {replay.num_layers} layers x {replay.num_experts} experts")
    if as_json:
        out = runs[0].to_json() if len(runs) == 1 else {"trace": replay.source, "runs": [r.to_json() for r in runs]}
        click.echo(json.dumps(out, indent=2))
    elif len(runs) == 1:
        click.echo(format_result(runs[0]))
    else:
        click.echo(format_sweep(runs, replay.num_experts, replay.num_layers, seconds=profile is not None))
    if plot and not as_json:
        click.echo(f"wrote {plot}")


@main.command("profile-device")
@click.option("--output", default="device.json", show_default=True, type=click.Path(dir_okay=False),
              help="Where the profile JSON goes.")
@click.option("--dir", "directory", default=None, type=click.Path(file_okay=False, exists=True),
              help="Measure reads on this directory's disk (default: the temp directory); put it where artifacts live.")
@click.option("--file-mb", default=256, show_default=True, type=click.IntRange(16, 4096),
              help="Size of the temporary read-test file.")
@click.option("--device", default="cpu", show_default=True, help="Where expert compute is timed: cpu or cuda.")
@click.option("--artifact", default=None, type=click.Path(file_okay=False, exists=True),
              help="Time record reads at this artifact's largest record (default: 2 MiB reads) and calibrate against "
                   "the loader running it.")
def profile_device_command(output, directory, file_mb, device, artifact):
    """Measure this machine's read bandwidth and latency (page cache bypassed), the record reads in flight
    that read fastest, and per-expert compute; with --artifact, calibrate against the loader on it (the same
    command as `moeload profile-device`)."""
    from loader.calibrate import profile_device

    profile_device(output, directory, file_mb, device, artifact, echo=click.echo)


@main.command("kernel-study")
@click.option("--hidden", default=768, show_default=True, type=click.IntRange(16, 16384),
              help="Expert hidden size (default: the bench's mixtral-shape).")
@click.option("--intermediate", default=1792, show_default=True, type=click.IntRange(16, 65536),
              help="Expert intermediate size (a multiple of 64).")
@click.option("--prefill-tokens", default=16, show_default=True, type=click.IntRange(2, 4096))
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(3, 1000))
@click.option("--output", default="artifacts/kernel-study", show_default=True, type=click.Path(file_okay=False))
def kernel_study_command(hidden, intermediate, prefill_tokens, repeats, output):
    """Time one expert in each compute form here: decoding, float and low-bit products (loader/forms.py)."""
    from prep.studies.kernel import run_kernel_study

    if hidden % 64 or intermediate % 64:
        raise click.UsageError("--hidden and --intermediate must be multiples of 64 (the int4 group size)")
    run_kernel_study(hidden, intermediate, prefill_tokens, repeats, output, echo=click.echo)
    click.echo(f"wrote {output}/kernels.json and kernels.md")


if __name__ == "__main__":
    main()
