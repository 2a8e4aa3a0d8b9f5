"""The README's "How fast" block, from a bench run: ``make how-fast`` runs the bench, then this.

    python -m prep.studies.bench.readme --bench artifacts/how-fast --readme README.md

reads ``bench.json`` in the bench's output folder, copies its ``bench.png`` beside the README
(``docs/bench.png``) and rewrites the block between ``MARKERS`` (``prep/readme_block.py``, the mechanism of
``moeprep inspect-model --readme``): the headline decode rows (resident, accelerate and moeprep on
``mixtral-shape``; resident, llama.cpp and moeprep on ``mixtral-shape-own``; at 100%, 25% and 4bit-25%) with
their median tokens/s and the bench's ratio against resident, the command that ran the bench, the machine,
the date, the commit and the wall time. Every figure comes from ``bench.json``; a headline row the run did not
measure (llama.cpp without its extra, a subject skipped) reads "not measured".
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import textwrap
from pathlib import Path

import click

from loader.errors import MoeError, user_error
from loader.io import write_bytes_atomic
from prep.errors import MoeprepError
from prep.readme_block import update_readme

MARKERS = ("<!-- how-fast:start (make how-fast) -->", "<!-- how-fast:end -->")
HEADLINE_BUDGETS = ("100%", "25%", "4bit-25%")
# (subject, system, label): each a row of the table, its cells the budgets
HEADLINE = (("mixtral-shape", "resident", "resident (every weight in memory, budget-free)"),
            ("mixtral-shape", "accelerate", "accelerate (offloads to disk)"),
            ("mixtral-shape", "moeprep", "**moeprep**"),
            ("mixtral-shape-own", "resident", "resident (budget-free)"),
            ("mixtral-shape-own", "llama.cpp", "llama.cpp"),
            ("mixtral-shape-own", "moeprep", "**moeprep**"))
REQUIRED = ("results", "machine", "created", "budgets", "subjects", "repeats")
DEFAULT_TRACES = "../shared/data/traces"  # moeprep bench's default --traces
WIDTH = 110  # the README's prose lines


def load_bench(path: str | Path) -> tuple[Path, dict]:
    """(the bench.json, its report) of a bench output folder or a bench.json; refuses, naming the file, anything
    that is not a decode bench's report."""

    path = Path(path)
    file = path / "bench.json" if path.is_dir() else path
    if not file.is_file():
        raise MoeprepError(f"{file} not found: run the bench first (`make how-fast`, or `moeprep bench --output DIR`)")
    try:
        report = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MoeprepError(f"{file} is not a bench.json of `moeprep bench`: not JSON ({e})") from None
    missing = [k for k in REQUIRED if k not in report] if isinstance(report, dict) else list(REQUIRED)
    if missing:
        raise MoeprepError(f"{file} is not a bench.json of `moeprep bench`: it has no {', '.join(missing)}")
    rows = report["results"]
    if not isinstance(rows, list) or not all(isinstance(r, dict) and {"subject", "system", "budget"} <= set(r)
                                             for r in rows):
        raise MoeprepError(f"{file} is not a bench.json of `moeprep bench`: its results are not rows of subject, "
                           "system and budget")
    if report.get("decode") is False:
        raise MoeprepError(f"{file} has no decode rows (its bench ran --no-decode); run the bench with them")
    return file, report


def bench_command(report: dict) -> str:
    """The ``moeprep bench`` command that wrote the report (its recorded options; a report from before they were
    recorded: rebuilt from its subjects, budgets and repeats)."""

    o = report.get("options")
    if o is None:
        args = ["--subject", ",".join(report["subjects"]), "--budgets", ",".join(report["budgets"]),
                "--repeats", str(report["repeats"])] + (["--quick"] if report.get("quick") else [])
        return shlex.join(["moeprep", "bench", *args])
    args = []
    for flag, value, default in (("--subject", o.get("subject"), "all"), ("--budgets", o.get("budgets"), None),
                                 ("--repeats", o.get("repeats"), None), ("--device", o.get("device"), "cpu"),
                                 ("--store", o.get("store"), "auto"), ("--systems", o.get("systems"), None),
                                 ("--prefill", o.get("prefill"), None), ("--output", o.get("output"), None),
                                 ("--traces", o.get("traces"), DEFAULT_TRACES)):
        if value is not None and value != default:
            args += [flag, str(value)]
    args += ["--quick"] if o.get("quick") else []
    args += ["--no-decode"] if o.get("decode") is False else []
    return shlex.join(["moeprep", "bench", *args])


def _row(report: dict, subject: str, system: str, budget: str) -> dict | None:
    return next((r for r in report["results"] if (r["subject"], r["system"], r["budget"]) == (subject, system, budget)),
                None)


def _cell(report: dict, subject: str, system: str, budget: str) -> str:
    """Median decode tokens/s and, but for resident itself, its ratio to the subject's resident (bench.md's
    "vs resident")."""
    row = _row(report, subject, system, budget)
    if row is None:
        return "not measured"
    speed = row.get("decode_tokens_per_s")
    if not speed:
        return "failed (bench.md says why)" if row.get("error") else "not measured"
    resident = (_row(report, subject, "resident", budget) or {}).get("decode_tokens_per_s")
    if system == "resident" or not resident:
        return f"{speed:.3g}"
    return f"{speed:.3g} ({speed / resident:.2f}x)"


def _subjects_line(report: dict) -> str:
    """What the two subjects are, in the report's own figures."""
    subjects = report["subjects"]
    facts = subjects.get("mixtral-shape") or subjects.get("mixtral-shape-own") or {}
    model = "the bench's Mixtral-shaped model"
    if dims := facts.get("shape"):
        model = (f"a random model with Mixtral-8x7B's {dims['num_hidden_layers']} layers, {dims['num_local_experts']} "
                 f"experts and top-{dims['num_experts_per_tok']} at hidden size {dims['hidden_size']}")
        if lossless := (facts.get("lossless") or {}).get("store_bytes"):
            model += f", {lossless / 1e9:.1f} GB of {dims['dtype']} experts"
        if facts.get("precision") and facts.get("store_bytes"):
            model += f" ({facts['store_bytes'] / 1e9:.1f} GB at {facts['precision']} in moeprep's artifact)"
    routing = str((subjects.get("mixtral-shape") or {}).get("routing"))
    routed = (", its routing replayed from the real Mixtral-8x7B GSM8K traces" if routing.startswith("replayed")
              else "")
    tokens = next((f" Each measurement: a {f['prompt_tokens']}-token prompt, then {f['decode_tokens']} decode steps."
                   for f in subjects.values() if f.get("decode_tokens")), "")
    return (f"`mixtral-shape` is {model}{routed}; `mixtral-shape-own` the same model with its own routers, which "
            f"llama.cpp runs.{tokens}")


def _machine(report: dict) -> str:
    m = report["machine"]
    gpu = f", {m['gpu']}" if m.get("gpu") else ""
    return (f"{m.get('cpu', 'an unnamed CPU')} ({m.get('cores', '?')} cores, {m.get('ram_gb', '?')} GB RAM{gpu}; "
            f"torch {m.get('torch', '?')}, device `{m.get('device', '?')}`)")


def _commit(report: dict) -> str:
    commit = report.get("commit")
    if not commit:
        return "commit not recorded"
    if commit == "unknown":
        return "commit unknown (not run from a git checkout)"
    dirty = commit.endswith("-dirty")
    return f"commit `{commit.removesuffix('-dirty')[:12]}`" + (" with uncommitted changes to prep/ or loader/"
                                                                if dirty else "")


def _date(created: str) -> str:
    """2026-11-27T07:10:00Z -> 2026-11-27 07:10 UTC (anything else as written)."""
    if len(created) >= 16 and created[10] == "T" and created.endswith("Z"):
        return f"{created[:10]} {created[11:16]} UTC"
    return created


def _wrap(text: str) -> str:
    """A paragraph in lines of at most ``WIDTH`` (a code span may break at a space: markdown joins it back)."""
    return textwrap.fill(text, WIDTH, break_on_hyphens=False, break_long_words=False)


def how_fast_block(report: dict, image: str) -> str:
    """The README block (markdown, ending in a newline) for ``report``, its plot linked as ``image``."""

    budgets = HEADLINE_BUDGETS
    rounds = report["repeats"]
    lines = [_wrap(f"Decode tokens/s, the median of {rounds} interleaved round{'s' if rounds != 1 else ''}, and in "
                   "parentheses against `resident` of the same subject. " + _subjects_line(report) + " A budget is the "
                   "dense weights plus that share of the experts' original bytes; `4bit-25%` a quarter of them at 4 "
                   "bits."), "",
             "| system | subject | " + " | ".join(budgets) + " |",
             "| --- | --- | " + " | ".join("---:" for _ in budgets) + " |"]
    for subject, system, label in HEADLINE:
        if system == "llama.cpp":
            quant = ((report["subjects"].get(subject) or {}).get("llama_cpp") or {}).get("quant")
            label = f"{label} {quant}" if quant else label
        cells = [_cell(report, subject, system, b) for b in budgets]
        lines.append(f"| {label} | `{subject}` | " + " | ".join(cells) + " |")
    lines.append("")
    absent = [s for s in dict.fromkeys(s for s, _, _ in HEADLINE) if s not in report["subjects"]]
    skipped = [n for n in report.get("notes", []) if " skipped: " in n]
    why = skipped + [f"{s} was not in this run" for s in absent if not any(n.startswith(s + " ") for n in skipped)]
    if why:
        lines += [_wrap("Not measured: " + "; ".join(n.rstrip(".") for n in why) + "."), ""]
    minutes = report.get("wall_seconds")
    took = f"; the bench took {minutes / 60:.0f} minutes" if minutes else ""
    lines += [f"![decode tokens/s against the memory budget, per subject and system]({image})", "",
              _wrap(f"Run by `{bench_command(report)}` on {_machine(report)}, {_date(str(report['created']))}, "
                    f"{_commit(report)}{took}. The run's `bench.md`, beside its `bench.json`, has every row and ratio, "
                    "the bounds and the goals."), ""]
    return "\n".join(lines)


def render(bench: str | Path, readme: str | Path, png: str = "docs/bench.png") -> bool:
    """Rewrite ``readme``'s How fast block from the bench output ``bench`` (a folder or its bench.json), its plot
    copied to ``png`` (relative to the README's folder); returns whether the README changed."""

    file, report = load_bench(bench)
    plot = file.parent / "bench.png"
    if not plot.is_file():
        raise MoeprepError(f"{plot} not found beside {file}: the bench writes both; run it again")
    readme = Path(readme)
    target = readme.parent / png
    target.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(target, plot.read_bytes())
    image = Path(os.path.relpath(target, readme.parent)).as_posix()
    return update_readme(readme, how_fast_block(report, image), MARKERS)


@click.command()
@click.option("--bench", "bench", default="artifacts/how-fast", show_default=True, type=click.Path(),
              help="The bench's output folder (or its bench.json).")
@click.option("--readme", default="README.md", show_default=True, type=click.Path(dir_okay=False, exists=True),
              help="The README whose How fast block is rewritten.")
@click.option("--png", default="docs/bench.png", show_default=True,
              help="Where the plot is copied, relative to the README's folder.")
def main(bench: str, readme: str, png: str) -> None:
    """Rewrite the README's How fast block from a bench run (bench.json and bench.png)."""
    try:
        changed = render(bench, readme, png)
    except (MoeError, OSError) as e:  # as the moeprep group does: a user's error, without a traceback
        if (error := user_error(e)) is None:
            raise
        click.echo(f"error: {error}", err=True)
        sys.exit(1)
    click.echo(f"{readme}: how-fast block {'updated' if changed else 'already current'}")


if __name__ == "__main__":
    main()
