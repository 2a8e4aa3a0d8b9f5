"""``make gpu-check``: the CUDA path checked and measured on a GPU machine in one command, inside a short lease.

It runs with the machine's own ``python3`` and the packages such a machine has (torch with CUDA, transformers,
accelerate, safetensors, click, pyyaml, tqdm, pytest), plus the wheels carried in ``.gpu/whl`` by ``make
gpu-carry`` (hqq), installed into ``.gpu/site``. No virtualenv, no network. Steps, each writing what it found
before the next starts, so a run cut off by its lease still returns what it measured:

1. CUDA present? If not, ``gpu-check.md`` says "no CUDA" and the exit status is 2.
2. The carried wheels, installed where the machine lacks them.
3. ``pytest -m gpu`` (its JUnit XML is kept, and the table goes into ``gpu-check.md``).
4. The CUDA bench of mixtral-shape at 100%, 25% and 4bit-25%, 2 repeats: the host store with every system,
   then the disk store with naive and moeprep only (the model built by the first run is reused).
5. ``gpu-check.md``: the tests, a table per store, and the CUDA path's goals, met or not.

Bulky outputs (the bench's models and artifacts) stay under ``--work``; ``--out`` (``$OUT`` when set) gets
only ``gpu-check.md``, ``gpu-check.json``, the test XML and each bench's ``bench.md``/``bench.json``/``raw.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from prep.studies import bounded

BUDGETS = "100%,25%,4bit-25%"
REPEATS = 2
STORES = (("host", None), ("disk", "naive,moeprep"))  # (store, systems; None = every system)
REPORT_SECONDS = 15  # kept back at the end for writing the report


class Check:
    """The run's state, written to ``gpu-check.json`` and ``gpu-check.md`` after every step."""

    def __init__(self, out: Path, deadline: float) -> None:
        self.out, self.deadline = out, deadline
        self.started = time.time()
        self.state: dict = {"cuda": None, "tests": None, "bench": {}, "steps": []}

    def left(self) -> float:
        return self.deadline - time.time() - REPORT_SECONDS

    def step(self, name: str, **facts) -> None:
        self.state["steps"].append({"step": name, "at_s": round(time.time() - self.started, 1)} | facts)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.out / "gpu-check.json", json.dumps(self.state, indent=2) + "\n")
        _write_atomic(self.out / "gpu-check.md", render(self.state))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def cuda_device(python: str, env: dict) -> str | None:
    """The GPU's name, or None where torch is missing or sees no CUDA device."""
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    try:
        done = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    name = done.stdout.strip()
    return name if done.returncode == 0 and name else None


def install_wheels(python: str, root: Path, env: dict) -> str:
    """Install ``.gpu/whl/*.whl`` into ``.gpu/site`` unless hqq and xxhash (the record hashes) import already;
    returns what was done."""
    if subprocess.run([python, "-c", "import hqq, xxhash"], env=env, capture_output=True).returncode == 0:
        return "hqq and xxhash already importable"
    wheels = sorted((root / ".gpu" / "whl").glob("*.whl"))
    if not wheels:
        return "no wheels in .gpu/whl (run `make gpu-carry` on the machine that prepares the carry)"
    done = subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target",
                           str(root / ".gpu" / "site"), *map(str, wheels)], env=env, capture_output=True, text=True)
    return f"installed {len(wheels)} wheels" if done.returncode == 0 else f"pip failed: {done.stderr[-500:]}"


def read_junit(path: Path) -> dict:
    """{"passed", "failed", "skipped", "cases": [{"name", "outcome", "message"}]} from pytest's JUnit XML."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or "")[:300]
                break
        cases.append({"name": f"{case.get('classname', '')}::{case.get('name', '')}", "outcome": outcome,
                      "seconds": float(case.get("time") or 0), "message": message})
    count = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    return count | {"cases": cases}


def run_tests(check: Check, python: str, root: Path, env: dict) -> None:
    xml = check.out / "gpu-tests.xml"
    timeout = max(30.0, min(240.0, check.left() / 3))
    try:
        done = subprocess.run([python, "-m", "pytest", "-q", "-m", "gpu", "tests/", f"--junitxml={xml}", "-p",
                               "no:cacheprovider"], cwd=root, env=env, capture_output=True, text=True,
                              timeout=timeout)
        tail = (done.stdout + done.stderr)[-3000:]
    except subprocess.TimeoutExpired:
        tail = f"pytest -m gpu ran past {timeout:.0f} s and was stopped"
    _write_atomic(check.out / "gpu-tests.log", tail)
    check.state["tests"] = read_junit(xml) if xml.is_file() else {"error": tail[-500:]}
    check.step("tests")


def run_bench(check: Check, python: str, root: Path, env: dict, work: Path, traces: Path, store: str,
              systems: str | None, budgets: str = BUDGETS, repeats: int = REPEATS) -> None:
    output = work / f"bench-{store}"
    output.mkdir(parents=True, exist_ok=True)
    first = work / "bench-host" / "mixtral-shape"
    if store != "host" and first.is_dir() and not (output / "mixtral-shape").exists():
        (output / "mixtral-shape").symlink_to(first.resolve())  # the model and artifacts built by the first run
    command = [python, "-m", "prep.cli", "bench", "--device", "cuda", "--subject", "mixtral-shape", "--budgets",
               budgets, "--repeats", str(repeats), "--store", store, "--traces", str(traces), "--output", str(output)]
    if systems:
        command += ["--systems", systems]
    left = check.left()
    if left < 60:
        check.state["bench"][store] = {"error": f"not run: {left:.0f} s of the lease left"}
        check.step(f"bench {store}")
        return
    log = check.out / f"bench-{store}.log"  # kept whole, so a run the lease cuts off still says where it was
    try:
        with open(log, "w") as sink:
            done = subprocess.run(command, cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
                                  timeout=left)
        status = {"exit": done.returncode, "log_tail": _tail(log)}
    except subprocess.TimeoutExpired:
        status = {"exit": None, "log_tail": f"stopped after {left:.0f} s (the lease); raw.json has the runs so far. "
                                            f"Its log ends: {_tail(log, 600)}"}
    keep = check.out / f"bench-{store}"
    keep.mkdir(parents=True, exist_ok=True)
    for name in ("bench.md", "bench.json", "work/raw.json", "device.json"):
        if (output / name).is_file():
            shutil.copy2(output / name, keep / Path(name).name)
    check.state["bench"][store] = status | summarize(keep)
    check.step(f"bench {store}")


def _tail(path: Path, chars: int = 1500) -> str:
    """The last ``chars`` characters of a log, progress bars' carriage returns folded into lines."""
    text = path.read_text(errors="replace") if path.is_file() else ""
    return text.replace("\r", "\n")[-chars:]


def _median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def summarize(kept: Path) -> dict:
    """Rows {system, budget, tok_s, of_bound, stall, mb_per_token} from bench.json, or from raw.json (medians of the
    runs so far, no bounds) where the run was cut off."""
    if (kept / "bench.json").is_file():
        report = json.loads((kept / "bench.json").read_text())
        rows = [{"system": r["system"], "budget": r["budget"], "tok_s": r.get("decode_tokens_per_s"),
                 "of_bound": r.get("fraction_of_bound"), "stall": r.get("stall_fraction"),
                 "mb_per_token": (r["bytes_read_per_token"] / 1e6 if r.get("bytes_read_per_token") is not None
                                  else None),
                 "miss_costs": r.get("miss_costs")} for r in report["results"]]
        return {"rows": rows, "complete": True}
    if (kept / "raw.json").is_file():
        raw = json.loads((kept / "raw.json").read_text())
        groups: dict = {}
        for r in raw:
            groups.setdefault((r["system"], r["budget"]), []).append(r)
        rows = [{"system": s, "budget": b, "tok_s": _median([r.get("decode_tokens_per_s") for r in runs]),
                 "of_bound": None, "stall": _median([r.get("stall_fraction") for r in runs]),
                 "mb_per_token": (_median([r.get("bytes_read_per_token") for r in runs]) or 0) / 1e6,
                 "miss_costs": runs[-1].get("miss_costs")} for (s, b), runs in groups.items()]
        return {"rows": rows, "complete": False}
    return {"rows": [], "complete": False}


def _speed(state: dict, store: str, system: str, budget: str) -> dict | None:
    rows = state["bench"].get(store, {}).get("rows", [])
    return next((r for r in rows if r["system"] == system and r["budget"] == budget), None)


def goals(state: dict) -> list[str]:
    """The CUDA path's goals (the issue's), each with its measured value or why it has none."""
    out = []

    def ratio(a, b):
        return a / b if a and b else None

    def line(text: str, value, target: float) -> None:
        if value is None:
            out.append(f"{text}: not measured")
        else:
            out.append(f"{text}: {value:.2f} (goal >= {target:g}) {'met' if value >= target else 'MISSED'}")

    moeprep, resident = _speed(state, "host", "moeprep", "100%"), _speed(state, "host", "resident", "100%")
    line("100%, host store: moeprep / resident", ratio(moeprep and moeprep["tok_s"], resident and resident["tok_s"]),
         0.95)
    quarter = _speed(state, "host", "moeprep", "25%")
    line("25%, host store: moeprep's fraction of its bound", quarter and quarter["of_bound"], 0.8)
    accelerate = _speed(state, "host", "accelerate", "25%")
    line("25%, host store: moeprep / accelerate", ratio(quarter and quarter["tok_s"],
                                                          accelerate and accelerate["tok_s"]), 10)
    for budget in ("25%", "4bit-25%"):
        row = _speed(state, "disk", "moeprep", budget)
        line(f"{budget}, disk store: moeprep's fraction of its bound", row and row["of_bound"], 0.8)
    return out


def _num(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def render(state: dict) -> str:
    lines = ["# gpu-check", ""]
    if state["cuda"] is None:
        lines += ["Not started yet.", ""]
    elif state["cuda"] is False:
        return "\n".join(lines + ["**no CUDA**: torch is missing here or sees no CUDA device; nothing was run.", ""])
    else:
        lines += [f"GPU: {state['cuda']}. Steps: " + ", ".join(f"{s['step']} at {s['at_s']} s" for s in
                                                               state["steps"]) + ".", ""]
    tests = state.get("tests")
    if tests:
        if "error" in tests:
            lines += [f"`pytest -m gpu`: {tests['error']}", ""]
        else:
            lines += [f"`pytest -m gpu`: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} "
                      "skipped.", "", "| test | outcome | s | message |", "| --- | --- | ---: | --- |"]
            lines += [f"| {c['name']} | {c['outcome']} | {c['seconds']:.1f} | {c['message'][:120]} |"
                      for c in tests["cases"]]
            lines.append("")
    for store, result in state["bench"].items():
        lines += [f"## mixtral-shape on CUDA, store={store}", ""]
        if "error" in result:
            lines += [result["error"], ""]
            continue
        if not result.get("complete"):
            lines += ["(cut off: medians of the runs so far, no bounds)", ""]
        lines += ["| budget | system | tok/s | of bound | stall | MB/token |", "| --- | --- | ---: | ---: | ---: | ---: |"]
        for r in result.get("rows", []):
            lines.append(f"| {r['budget']} | {r['system']} | {_num(r['tok_s'], '.3g')} | {_num(r['of_bound'], '.2f')} "
                         f"| {_num(r['stall'], '.2f')} | {_num(r['mb_per_token'], '.1f')} |")
        costs = next((r["miss_costs"] for r in result.get("rows", []) if r.get("miss_costs")), None)
        if costs:
            lines += ["", "Miss costs measured at load (per precision: compute on the CPU against copy to the GPU): "
                      + "; ".join(f"{p} {costs['cpu_seconds'][p] * 1e3:.2f} ms vs {costs['gpu_seconds'][p] * 1e3:.2f}"
                                  " ms" for p in sorted(costs["cpu_seconds"]))]
        lines.append("")
    if state["bench"]:
        lines += ["## Goals", ""] + [f"- {g}" for g in goals(state)] + [""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[3]
    parser = argparse.ArgumentParser(prog="make gpu-check", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or str(root / ".gpu" / "check"),
                        help="where gpu-check.md and the small results go [$OUT, else .gpu/check]")
    parser.add_argument("--work", default=str(root / ".gpu" / "work"), help="where the bench's models go")
    parser.add_argument("--traces", default=None, help="holding mixtral-8x7b/ [.gpu/traces, else ../shared/data/traces]")
    parser.add_argument("--seconds", type=bounded(float, 1, 86_400), default=450,
                        help="the whole check's time limit (default 450)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter to run the tests and bench with")
    parser.add_argument("--budgets", default=BUDGETS, help=f"the bench's budgets (default {BUDGETS})")
    parser.add_argument("--repeats", type=bounded(int, 1, 1000), default=REPEATS,
                        help=f"runs per configuration (default {REPEATS})")
    parser.add_argument("--stores", default=",".join(s for s, _ in STORES),
                        help="which stores to bench, in order (default host,disk)")
    parser.add_argument("--systems", default=None,
                        help="the systems of every store's bench (default: all on host, naive,moeprep on disk); a "
                             "short lease affords naive,moeprep at two budgets")
    args = parser.parse_args(argv)
    check = Check(Path(args.out), time.time() + args.seconds)
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(root / ".gpu" / "site"), str(root), os.environ.get("PYTHONPATH", "")]))
    name = cuda_device(args.python, env)
    check.state["cuda"] = name or False
    check.step("cuda")
    if not name:
        print(f"gpu-check: no CUDA (torch is missing or sees no CUDA device); wrote {check.out / 'gpu-check.md'}",
              file=sys.stderr)
        return 2
    check.state["wheels"] = install_wheels(args.python, root, env)
    check.step("wheels")
    run_tests(check, args.python, root, env)
    traces = Path(args.traces) if args.traces else next(
        (p for p in (root / ".gpu" / "traces", root.parent / "shared" / "data" / "traces") if p.is_dir()),
        root / ".gpu" / "traces")
    work = Path(args.work)
    wanted = [s.strip() for s in args.stores.split(",") if s.strip()]
    for store, systems in sorted((s for s in STORES if s[0] in wanted), key=lambda s: wanted.index(s[0])):
        run_bench(check, args.python, root, env, work, traces, store, args.systems or systems, args.budgets,
                  args.repeats)
    print(check.out / "gpu-check.md", file=sys.stderr)
    print(render(check.state))
    failed = (check.state["tests"] or {}).get("failed", 1)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
