"""Where the test suite's time goes, from pytest's JUnit XML (`pytest --junitxml=FILE`).

    python scripts/suite_budget.py FILE [--top 30]

Prints the total, the number of tests, the seconds per test file (slowest first) and the slowest
tests. Setup and teardown (fixtures such as the Ray cluster) count towards the test that ran them.
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def read_junit(path: str | Path) -> list[tuple[str, str, float, str]]:
    """(file, test name, seconds, outcome) per test case, in the order pytest ran them."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        file = case.get("file") or case.get("classname", "").replace(".", "/") + ".py"
        cases.append((file, case.get("name", ""), float(case.get("time", 0.0)), outcome))
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("junit_xml")
    parser.add_argument("--top", type=int, default=30, help="how many of the slowest tests to list")
    args = parser.parse_args()
    cases = read_junit(args.junit_xml)
    total = sum(seconds for _, _, seconds, _ in cases)
    outcomes: dict[str, int] = defaultdict(int)
    by_file: dict[str, list[float]] = defaultdict(list)
    for file, _, seconds, outcome in cases:
        outcomes[outcome] += 1
        by_file[file].append(seconds)
    counts = ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))
    print(f"suite: {total:.0f} s ({total / 60:.1f} min) in {len(cases)} tests ({counts})")
    print("\nseconds per file:")
    for file, times in sorted(by_file.items(), key=lambda item: -sum(item[1])):
        print(
            f"{sum(times):8.1f} s {100 * sum(times) / max(total, 1e-9):5.1f}%  {len(times):4d} tests  {file}"
        )
    print(f"\nthe {args.top} slowest tests:")
    for file, name, seconds, outcome in sorted(cases, key=lambda c: -c[2])[: args.top]:
        print(f"{seconds:8.1f} s  {file}::{name}" + ("" if outcome == "passed" else f"  [{outcome}]"))


if __name__ == "__main__":
    main()
