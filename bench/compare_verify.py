"""Compare two ``spec verify`` JSON reports target by target: a refactoring that claims "behaviour unchanged" must
leave every target's outcome as it was.

    python -m bench.compare_verify BEFORE.json AFTER.json [--fields status,examples,...]

Per target (``test_id``: invariant, engine, mode, device) it compares the status, the number of examples, exercised
examples and distinct cases, the known-failure hits in total and per record (key, condition, hits), the shrunk
counterexample, the skip reason and the blame; a target present in one report only is a difference too. Seconds,
coverage shares and error tracebacks' paths are not compared (they change with the machine and the file layout).
Exit 0 when every target agrees, 1 otherwise (each difference printed, one line each).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

#: what must agree per target (seconds and the coverage counts' floats are not behaviour)
FIELDS = ("status", "examples", "exercised", "distinct_cases", "known_hits", "counterexample", "reason", "blame",
          "layout", "known")
#: a module path of the suite in a message (moved modules print another path for the same behaviour)
_PATHS = re.compile(r"spec[./][\w./]+")


def _normal(value):
    if isinstance(value, str):
        return _PATHS.sub("<spec path>", value)
    if isinstance(value, list):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    return value


def targets(report: dict) -> dict[str, dict]:
    return {o["test_id"]: o for o in report["outcomes"]}


def differences(before: dict, after: dict, fields=FIELDS) -> list[str]:
    """One line per difference between the two reports' targets (empty: the same outcomes)."""
    old, new = targets(before), targets(after)
    out = [f"{t}: only in {'before' if t in old else 'after'}" for t in sorted(set(old) ^ set(new))]
    for test_id in sorted(set(old) & set(new)):
        for name in fields:
            a, b = _normal(old[test_id].get(name)), _normal(new[test_id].get(name))
            if a != b:
                out.append(f"{test_id}: {name} {a!r} -> {b!r}")
    if before.get("verdict") != after.get("verdict"):
        out.append(f"verdict {before.get('verdict')} -> {after.get('verdict')}")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--fields", default=",".join(FIELDS), help="comma-separated Outcome fields to compare")
    args = parser.parse_args(argv)
    before, after = (json.loads(p.read_text()) for p in (args.before, args.after))
    diff = differences(before, after, tuple(args.fields.split(",")))
    for line in diff:
        print(line)
    print(f"{len(targets(before))} targets before, {len(targets(after))} after: "
          f"{'identical outcomes' if not diff else f'{len(diff)} differences'}")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
