"""The `moeprep` command line: a thin click layer over the library.

Each command parses its options and calls one library function. Errors a user can cause arrive
as `MoeprepError`; the group catches them for every command, prints `error: <message>` to stderr
and exits with status 1, without a traceback. Other exceptions are bugs and keep their traceback.
"""

from __future__ import annotations

import json

import click

from prep.errors import MoeprepError


class MoeprepGroup(click.Group):
    """A click group that turns MoeprepError from any subcommand into a clean error exit."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except MoeprepError as e:
            click.echo(f"error: {e}", err=True)
            ctx.exit(1)


@click.group(cls=MoeprepGroup)
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
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def inspect_model_command(model: str, as_json: bool) -> None:
    """Show how moeprep sees MODEL (a local directory or hub id): MoE layers, experts, sizes."""
    from prep.adapters import inspect_model

    info = inspect_model(model)
    click.echo(json.dumps(info, indent=2) if as_json else _format_table(info))


@main.command("prepare")
@click.option("--recipe", "recipe_path", required=True, type=click.Path(dir_okay=False),
              help="Recipe YAML, e.g. recipes/reference.yaml.")
@click.option("--set", "overrides", multiple=True, metavar="SECTION.KEY=VALUE",
              help="Override one recipe value (repeatable).")
@click.option("--output", type=click.Path(file_okay=False), default=None,
              help="Artifact directory (default artifacts/<recipe name>/artifact).")
@click.option("--until", default=None, help="Stop after this stage.")
@click.option("--force", default=None, help="Rerun this stage and every stage after it.")
def prepare_command(recipe_path: str, overrides: tuple[str, ...], output: str | None, until: str | None,
                    force: str | None) -> None:
    """Run the preparation pipeline of a recipe and write its artifact."""
    from prep.pipeline import prepare
    from prep.recipe import load_recipe

    summary = prepare(load_recipe(recipe_path, overrides), root=".", output=output, until=until, force=force)
    for stage, info in summary.items():
        if stage != "artifact":
            state = "cached" if info["cached"] else f"{info['seconds']:.1f} s"
            click.echo(f"{stage:10s} {info['key']}  {state}")
    if summary["artifact"]:
        click.echo(f"artifact: {summary['artifact']}")


@main.command("reference-model")
@click.option("--out", default="recipes/reference", show_default=True, type=click.Path(file_okay=False),
              help="Where model/, suites/ and training.json are written.")
@click.option("--device", default="auto", show_default=True, help="auto, cpu or cuda.")
def reference_model_command(out: str, device: str) -> None:
    """Generate the reference data and train the reference MoE from scratch (seeded)."""
    from prep.reference.train import build_reference

    report = build_reference(out, device=device)
    click.echo(f"trained in {report['train_seconds']} s on {report['device']}; wrote {out}/model")


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


if __name__ == "__main__":
    main()
