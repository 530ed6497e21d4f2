"""Repeat tests to find flaky ones: ``scripts/test.sh --stress N [PYTEST ARGS]`` runs this.

Runs pytest N times, each in a fresh process, on the tests marked ``timing`` (those whose pass
depends on deadlines, thread hand-offs or process start-up) -- or, when PYTEST ARGS are given, on
those instead (``--stress 30 tests/test_security.py::test_x`` repeats one test alone). Prints one
line per run as it ends and, at the end, every test that failed at least once with its count,
then ``N passed, M failed`` over all test runs. Exit status 0 when nothing failed, 1 otherwise. A test
that records the quantity behind a bound (pytest's ``record_property("name", value)``) gets that
quantity's distribution over the runs printed too (n, mean, sd, min, max): the measurement a bound on a
timing-dependent outcome must rest on (``--stress 30 -m outcome``).

Each run writes a JUnit XML report; the per-test counts come from those reports, so a test that
errors in set-up or hangs into pytest-timeout counts as a failure. The report of every run with a
failure is kept in ``runs/stress-<time>/`` (the failure's first line is printed too), so the cause
can be read afterwards.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["describe", "failure_lines", "figures", "main", "outcomes"]

DEFAULT_SELECTION = ["-m", "timing"]


def _test_id(case: ET.Element) -> str:
    """``tests/test_x.py::test_y`` of one JUnit ``testcase`` element."""
    module = case.get("classname", "").replace(".", "/")
    return f"{module}.py::{case.get('name')}" if module else str(case.get("name"))


def _problem(case: ET.Element) -> ET.Element | None:
    """The ``failure`` or ``error`` element of one ``testcase``, None when it passed or was skipped."""
    failure = case.find("failure")
    return failure if failure is not None else case.find("error")


def outcomes(report: Path) -> dict[str, bool]:
    """``{test id: passed}`` of one JUnit XML report (skipped tests left out)."""
    results: dict[str, bool] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        test_id = _test_id(case)
        results[test_id] = results.get(test_id, True) and _problem(case) is None
    return results


def failure_lines(report: Path) -> dict[str, str]:
    """``{test id: first line of its failure or error message}`` of one JUnit XML report."""
    out = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        problem = _problem(case)
        if problem is not None:
            message = (problem.get("message") or problem.text or "").strip().splitlines()
            out[_test_id(case)] = (message[0] if message else "")[:300]
    return out


def figures(report: Path) -> dict[tuple[str, str], float]:
    """``{(test id, name): value}`` of the numbers the tests recorded (``record_property``) in one JUnit report:
    the measured quantities behind their bounds, whose distribution over the runs is printed at the end."""
    out: dict[tuple[str, str], float] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        for prop in case.iter("property"):
            try:
                out[(_test_id(case), prop.get("name", ""))] = float(prop.get("value", ""))
            except ValueError:
                continue
    return out


def describe(values: list[float]) -> str:
    """``n, mean, sd, min, max`` of ``values`` on one line."""
    mean = statistics.fmean(values)
    sd = statistics.pstdev(values)
    return f"n {len(values)}  mean {mean:.4g}  sd {sd:.3g}  min {min(values):.4g}  max {max(values):.4g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/test.sh --stress", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=int, help="how many times to run the selection")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="tests to repeat (default: -m timing)")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("runs must be >= 1")
    selection = args.pytest_args or DEFAULT_SELECTION
    failures: collections.Counter[str] = collections.Counter()
    executed: collections.Counter[str] = collections.Counter()
    measured: collections.defaultdict[tuple[str, str], list[float]] = collections.defaultdict(list)
    started = time.monotonic()
    keep = Path("runs") / f"stress-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    with tempfile.TemporaryDirectory(prefix="dpwa-stress-") as tmp:
        for run in range(1, args.runs + 1):
            report = Path(tmp) / f"run-{run}.xml"
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
            command += ["-o", "junit_family=xunit1"]  # the family that keeps recorded properties
            t0 = time.monotonic()
            code = subprocess.run([*command, *selection], stdout=subprocess.DEVNULL, check=False).returncode
            if not report.exists():
                print(f"run {run}/{args.runs}: pytest exited {code} without a report", flush=True)
                failures["(no report)"] += 1
                continue
            results = outcomes(report)
            executed.update(results.keys())  # one execution per test, passed or not
            for key, value in figures(report).items():
                measured[key].append(value)
            failed = sorted(t for t, ok in results.items() if not ok)
            failures.update(failed)
            note = f"; failed: {', '.join(failed)}" if failed else ""
            print(f"run {run}/{args.runs}: {len(results)} tests, {time.monotonic() - t0:.0f} s{note}", flush=True)
            if failed:
                keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(report, keep / report.name)
                for test_id, line in failure_lines(report).items():
                    print(f"    {test_id}: {line}", flush=True)
    total = sum(executed.values())
    failed_total = sum(failures.values())
    print(f"\n{args.runs} runs of {' '.join(selection)} in {time.monotonic() - started:.0f} s")
    if keep.exists():
        print(f"reports of the runs with failures: {keep}")
    for test_id, count in failures.most_common():
        print(f"  {count}/{executed.get(test_id, args.runs)} failed: {test_id}")
    if measured:
        print("figures the tests recorded, over the runs:")
        for (test_id, name), values in sorted(measured.items()):
            print(f"  {test_id} {name}: {describe(values)}")
    print(f"{total - sum(n for t, n in failures.items() if t in executed)} passed, {failed_total} failed")
    return 1 if failed_total else 0


if __name__ == "__main__":
    sys.exit(main())
