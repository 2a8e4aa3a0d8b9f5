"""Where the suite's time goes: every test's set-up, call and teardown, and every fixture's set-up, written to a
file on every run, and a summary that flags what makes the suite slow.

``pytest --times DIR`` writes ``DIR/durations.json`` (one run; under pytest-xdist the controller collects what the
workers report, fixture times riding on each set-up report). ``python -m tests.helpers.timing DIR...`` merges the
runs of one ``make test`` (the parallel part and the part that needs the machine alone) into ``summary.md``: the
30 slowest tests, the time per file and per fixture, and the guard: any test over ``TEST_LIMIT_S`` that is not
marked ``slow``, the ``slow`` tests together over ``SLOW_TOTAL_LIMIT_S``, and any collected test missing from the
file. The guard is a report, not an assertion: a CI machine's noise is not a test failure.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

TEST_LIMIT_S = 60.0
SLOW_TOTAL_LIMIT_S = 300.0
FIXTURES_KEY = "moeprep_fixture_setup"


class Timing:
    """A pytest plugin: on a worker (or a plain run) it times fixture set-ups; on the controller (or a plain run)
    it gathers the reports and writes the file at the end."""

    def __init__(self, config: pytest.Config, out: Path):
        self.config = config
        self.out = out
        self.started = time.time()
        self.current: str | None = None
        self.fixtures: dict[str, list] = defaultdict(list)  # test -> [(fixture, scope, seconds)] set up for it
        self.tests: dict[str, dict] = {}
        self.collected: set[str] = set()

    # ---------------------------------------------------------------- where the test runs

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        self.current = item.nodeid
        try:
            return (yield)
        finally:
            self.current = None

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            if self.current is not None:
                self.fixtures[self.current].append((fixturedef.argname, fixturedef.scope,
                                                    round(time.perf_counter() - start, 4)))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item, call):
        report = yield
        if call.when == "setup":  # user_properties travel from an xdist worker to the controller
            report.user_properties.append((FIXTURES_KEY, self.fixtures.pop(item.nodeid, [])))
        return report

    # ---------------------------------------------------------------- where the reports arrive

    def pytest_collection_finish(self, session):
        self.collected.update(item.nodeid for item in session.items)

    def pytest_xdist_node_collection_finished(self, node, ids):
        self.collected.update(ids)

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid, {"setup": 0.0, "call": 0.0, "teardown": 0.0, "outcome": "passed",
                                                      "slow": "slow" in report.keywords, "fixtures": {}})
        entry[report.when] = round(report.duration, 4)
        if report.failed or (report.skipped and entry["outcome"] == "passed"):
            entry["outcome"] = "failed" if report.failed else "skipped"
        for key, value in report.user_properties:
            if key == FIXTURES_KEY:
                entry["fixtures"] = {f"{name} ({scope})": secs for name, scope, secs in value}

    def pytest_sessionfinish(self, session):
        if hasattr(self.config, "workerinput"):
            return  # a worker: the controller writes
        self.out.mkdir(parents=True, exist_ok=True)
        doc = {"wall_s": round(time.time() - self.started, 2), "args": list(self.config.invocation_params.args),
               "workers": os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(self.config.option, "numprocesses", 0),
               "collected": sorted(self.collected), "tests": self.tests}
        tmp = self.out / "durations.json.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        tmp.replace(self.out / "durations.json")

    def pytest_terminal_summary(self, terminalreporter):
        if not hasattr(self.config, "workerinput"):
            terminalreporter.write_line(f"durations of every test and fixture: {self.out / 'durations.json'}")


def pytest_addoption(parser):
    parser.addoption("--times", metavar="DIR", default=None,
                     help="write every test's and fixture's durations to DIR/durations.json")


def pytest_configure(config):
    out = config.getoption("--times", default=None)
    if out:
        config.pluginmanager.register(Timing(config, Path(out)), "moeprep-timing")


# ------------------------------------------------------------------------------------------ the summary


def total(entry: dict) -> float:
    return entry["setup"] + entry["call"] + entry["teardown"]


def summarize(runs: list[dict]) -> tuple[str, list[str]]:
    """(summary.md's text, the guard's findings) of the runs of one ``make test``."""
    tests = {k: v for run in runs for k, v in run["tests"].items()}
    collected = {k for run in runs for k in run["collected"]}
    wall = sum(run["wall_s"] for run in runs)
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    by_fixture: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for nodeid, entry in tests.items():
        f = by_file[nodeid.split("::")[0]]
        f[0] += total(entry)
        f[1] += 1
        for name, secs in entry["fixtures"].items():
            by_fixture[name][0] += secs
            by_fixture[name][1] += 1
    findings = [f"{nodeid}: {total(e):.1f} s and not marked slow" for nodeid, e in tests.items()
                if total(e) > TEST_LIMIT_S and not e["slow"]]
    slow_total = sum(total(e) for e in tests.values() if e["slow"])
    if slow_total > SLOW_TOTAL_LIMIT_S:
        findings.append(f"the slow tests take {slow_total:.0f} s together, over {SLOW_TOTAL_LIMIT_S:.0f} s")
    missing = sorted(collected - set(tests))
    findings += [f"{nodeid}: collected but missing from the durations" for nodeid in missing]
    outcomes = defaultdict(int)
    for e in tests.values():
        outcomes[e["outcome"]] += 1
    parts = ", ".join(f"{run['wall_s']:.0f} s" for run in runs)
    lines = ["# Where the suite's time goes", "",
             f"- wall time of the pytest runs: {wall:.0f} s ({parts})",
             f"- tests: {len(tests)} ({', '.join(f'{n} {k}' for k, n in sorted(outcomes.items()))}); "
             f"sum of test times {sum(total(e) for e in tests.values()):.0f} s; "
             f"slow tests {sum(e['slow'] for e in tests.values())}, {slow_total:.0f} s together",
             "", "## Guard", ""]
    lines += [f"- {f}" for f in findings] or ["- nothing flagged"]
    lines += ["", "## The 30 slowest tests", "", "| s | setup | call | test |", "| ---: | ---: | ---: | --- |"]
    for nodeid, e in sorted(tests.items(), key=lambda kv: -total(kv[1]))[:30]:
        lines.append(f"| {total(e):.1f} | {e['setup']:.1f} | {e['call']:.1f} | `{nodeid}`{' (slow)' if e['slow'] else ''} |")
    lines += ["", "## Time per file", "", "| s | tests | file |", "| ---: | ---: | --- |"]
    for name, (secs, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"| {secs:.1f} | {n} | `{name}` |")
    lines += ["", "## Time per fixture (set-up)", "", "| s | set-ups | fixture |", "| ---: | ---: | --- |"]
    for name, (secs, n) in sorted(by_fixture.items(), key=lambda kv: -kv[1][0]):
        if secs >= 0.05:
            lines.append(f"| {secs:.1f} | {n} | `{name}` |")
    return "\n".join(lines) + "\n", findings


def main(argv: list[str]) -> int:
    """``python -m tests.helpers.timing DIR [DIR...] [--out FILE]``: summary.md of the runs under the DIRs."""
    out = None
    if "--out" in argv:
        i = argv.index("--out")
        out, argv = Path(argv[i + 1]), argv[:i] + argv[i + 2:]
    files = [Path(d) / "durations.json" for d in argv]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        print(f"no durations file at {', '.join(absent)}: run pytest with --times DIR first", file=sys.stderr)
        return 2
    text, findings = summarize([json.loads(f.read_text()) for f in files])
    out = out or files[0].parent.parent / "summary.md"
    out.write_text(text)
    print(f"summary of {len(files)} run(s): {out}")
    for finding in findings:
        print(f"  flagged: {finding}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
