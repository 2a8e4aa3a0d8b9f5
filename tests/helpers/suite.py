"""``make test``: the suite in two parts and the summary of where its time went.

1. Every test that is not ``alone`` (nor ``gpu``, nor ``full`` unless asked), on ``--workers`` pytest-xdist workers
   (``--dist loadgroup``: tests carrying one ``xdist_group`` run on one worker, one after the other).
2. The ``alone`` tests (they measure memory or time against a bound), one at a time with the machine to themselves.
3. ``tests.helpers.timing``'s summary of both parts: ``TIMES/summary.md``.

Both parts run even when the first fails, so one failure does not hide another; the exit status is the worst.
A test declares that it needs the machine alone with ``@pytest.mark.alone``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers import timing

NO_TESTS = 5  # pytest's status when a selection is empty


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.suite", description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers for the parallel part")
    parser.add_argument("--times", default="test-times", help="where the durations and the summary go")
    parser.add_argument("--full", action="store_true", help="also the full-size checks marked `full`")
    parser.add_argument("pytest_args", nargs="*", help="more arguments for both pytest runs (after --)")
    args = parser.parse_args(argv)
    times = Path(args.times)
    shutil.rmtree(times, ignore_errors=True)
    skip = "not gpu" + ("" if args.full else " and not full")
    pytest = [sys.executable, "-m", "pytest", "-q", *args.pytest_args]
    parallel = ["-n", str(args.workers), "--dist", "loadgroup"] if args.workers > 1 else []
    statuses = [
        subprocess.call([*pytest, *parallel, "-m", f"{skip} and not alone", "--times", str(times / "parallel")]),
        subprocess.call([*pytest, "-m", f"{skip} and alone", "--times", str(times / "alone")]),
    ]
    parts = [str(times / part) for part in ("parallel", "alone") if (times / part / "durations.json").is_file()]
    if parts:
        timing.main([*parts, "--out", str(times / "summary.md")])
    failed = [s for s in statuses if s not in (0, NO_TESTS)]
    return max(failed) if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
