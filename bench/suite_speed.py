"""Suite speed: examples per second for each invariant group, from one catalogue run.

    python -m bench.suite_speed [--profile ci] [--engine impl]

Runs ``python -m spec verify``'s code path in-process and prints a Markdown table grouped
by invariant family (MASK, VAL, ...). Wall time includes shrinking where an engine fails.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--engine", default="impl")
    args = parser.parse_args(argv)

    from spec.run.profiles import load_profile

    load_profile(args.profile)
    import torch
    from hypothesis import Verbosity

    from spec.run.registry import load_engine
    from spec.run.runner import instances, run_invariant

    torch.set_num_threads(1)
    engine = load_engine(args.engine)
    groups: dict[str, list] = defaultdict(list)
    start = time.perf_counter()
    for info, mode in instances():
        outcome = run_invariant(info, engine, mode, "cpu", verbosity=Verbosity.quiet)
        if outcome.status != "skip":
            groups[info.id.split("-")[1]].append(outcome)
    total = time.perf_counter() - start
    print(f"Suite speed: engine `{args.engine}`, profile `{args.profile}`, 1 thread, one process\n")
    print("| group | instances | examples | exercised | distinct cases | seconds | examples/s |\n"
          "|---|---:|---:|---:|---:|---:|---:|")
    for group in sorted(groups):
        rows = groups[group]
        n, secs = sum(o.examples for o in rows), sum(o.seconds for o in rows)
        ex, distinct = sum(o.exercised for o in rows), sum(o.distinct_cases for o in rows)
        print(f"| {group} | {len(rows)} | {n} | {ex} | {distinct} | {secs:.1f} | {n / secs:.0f} |")
    n = sum(o.examples for rows in groups.values() for o in rows)
    ex = sum(o.exercised for rows in groups.values() for o in rows)
    distinct = sum(o.distinct_cases for rows in groups.values() for o in rows)
    print(f"| **all** | {sum(map(len, groups.values()))} | {n} | {ex} | {distinct} | {total:.1f} | {n / total:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
