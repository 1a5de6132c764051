"""Where the test suite's CPU goes: reads the file ``make test-cpu`` had the suite write (a line a
test: its CPU seconds, a tab, its node id; see ``FEATUREHOUSE_TEST_CPU`` in tests/conftest.py)
and prints the total, each module's share, and the heaviest tests."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    tests: list[tuple[float, str]] = []
    for line in a.log.read_text(encoding="utf-8").splitlines():
        seconds, _, nodeid = line.partition("\t")
        tests.append((float(seconds), nodeid.partition("@")[0]))
    total = sum(s for s, _ in tests)
    modules: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for s, nodeid in tests:
        modules[nodeid.partition("::")[0]] += s
        count[nodeid.partition("::")[0]] += 1
    print(f"{len(tests)} tests, {total:,.0f} CPU-seconds (user + system, children included)")
    print(f"\nmodules, heaviest first (top {a.top}):")
    for module, s in modules.most_common(a.top):
        print(f"{s:8.1f} s {100 * s / total:5.1f} % {count[module]:4d} tests  {module}")
    print(f"\ntests, heaviest first (top {a.top}):")
    for s, nodeid in sorted(tests, reverse=True)[:a.top]:
        print(f"{s:8.1f} s  {nodeid}")


if __name__ == "__main__":
    main()
