"""The reach figures of a run, recorded for the docs: an engine's engine-code coverage (from the report ``spec
verify`` wrote) and its mutation score (from the report ``spec mutate`` wrote), kept in ``docs/measured/<engine>.json``
(tracked; ``reports/`` is not), from which ``python -m spec.docs`` writes the README's figures and the docs' lists.

    python -m spec.measured reports/verl/verify-verl.json      record the coverage of that run
    python -m spec.measured reports/mutate/mutate-verl.json    record the mutation score of that run
    python -m spec.measured --of 57 mutate-openrlhf.json       a run stopped early: it scored part of a sample of 57

A record keeps the figure's line, its counts, what was unreached or survived (with the reasons), the profile and
the date it was recorded; the docs say which command measured it.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path
from typing import Any

__all__ = ["FOLDER", "record", "records", "reach_table", "unreached_table", "survivors_list", "main"]

FOLDER = Path(__file__).resolve().parents[1] / "docs" / "measured"


def _path(engine: str) -> Path:
    return FOLDER / f"{engine}.json"


def records() -> dict[str, dict[str, Any]]:
    """engine -> its record, for every engine recorded."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(FOLDER.glob("*.json"))} if FOLDER.is_dir() else {}


def _coverage(report: dict[str, Any]) -> dict[str, Any]:
    cov = report["engine_coverage"]
    declared = sum(1 for b in cov["unreached"] if not b["reason"].startswith("gap:"))
    share = cov["reached"] / cov["branches"] if cov["branches"] else 0.0
    return {"profile": report.get("profile"), "verdict": report.get("verdict"), "branches": cov["branches"],
            "reached": cov["reached"], "declared_unreachable": declared, "open_gaps": cov["open_gaps"],
            "without_reason": cov["unreached_without_reason"], "statements": cov["statements"],
            "executed": cov["executed"],
            "line": (f"{share:.1%} of {cov['branches']} branches reached ({cov['reached']}; unreached: {declared} "
                     f"declared unreachable, {cov['open_gaps']} open gaps, {cov['unreached_without_reason']} "
                     "without a reason)"),
            "surface": cov["surface"], "off_path": cov.get("off_path", {}),
            "stale_declarations": cov.get("stale_declarations", []),
            "unreached": [{k: b[k] for k in ("key", "function", "source", "reason")} for b in cov["unreached"]]}


def _mutation(report: dict[str, Any]) -> dict[str, Any]:
    mutants = report["mutants"]
    kept = ("survived", "uncovered", "equivalent", "not installed")
    return {"profile": report.get("profile"), "confirm": report.get("confirm"), "seed": report["seed"],
            "sample": len(mutants), "killed": report["killed"], "scored": report["scored"], "score": report["score"],
            "line": report["summary"],
            "counts": {s: sum(m["status"] == s for m in mutants)
                       for s in ("killed", "survived", "uncovered", "equivalent", "unreachable", "not installed")},
            "not_killed": [{"id": m["id"], "status": m["status"], "reason": m["reason"], "targets": m["targets"],
                            "diff": m["diff"]} for m in mutants if m["status"] in kept]}


def record(report_path: Path, engine: str | None = None, of: int | None = None) -> Path:
    """Record the figure a report holds (a verify report's coverage, or a mutate report's score) in the engine's
    record, with today's date; returns the record's path. ``of``: the size of the sample a mutation run stopped
    early was to score (the record, and the README's line, then say the figure is partial)."""
    report = json.loads(Path(report_path).read_text())
    engine = engine or report["engine"]
    path = _path(engine)
    data = json.loads(path.read_text()) if path.exists() else {"engine": engine}
    if "engine_coverage" in report:
        data["coverage"] = {**_coverage(report), "recorded": date.today().isoformat()}
    elif "mutants" in report:
        data["mutation"] = {**_mutation(report), "recorded": date.today().isoformat()}
        if of is not None:
            if of < len(report["mutants"]):
                raise ValueError(f"{report_path}: --of {of} is fewer than the {len(report['mutants'])} mutants it ran")
            data["mutation"]["partial_of"] = of
    else:
        raise ValueError(f"{report_path}: neither a verify report with engine_coverage nor a mutate report")
    FOLDER.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def reach_table() -> str:
    """Per recorded engine: its engine-code coverage and its mutation score, as recorded."""
    lines = ["| engine | engine-code coverage (branches) | mutation score | recorded |", "|---|---|---|---|"]
    for engine, data in records().items():
        cov, mut = data.get("coverage"), data.get("mutation")
        cov_text = f"{cov['line']}, under `{cov['profile']}`" if cov else "not recorded"
        mut_text = (f"{mut['line']} (`{mut['profile']}`, survivors confirmed under `{mut['confirm']}`)"
                    if mut else "not recorded")
        if mut and mut.get("partial_of"):
            mut_text += (f"; **a partial run**: {mut['sample']} of the {mut['partial_of']} mutants of its sample, "
                         "not the engine's score")
        when = ", ".join(sorted({d["recorded"] for d in (cov, mut) if d}))
        lines.append(f"| {engine} | {cov_text} | {mut_text} | {when} |")
    return "\n".join(lines)


def unreached_table(engine: str) -> str:
    """Every branch of ``engine``'s surface the recorded run left unreached, with its reason."""
    cov = records().get(engine, {}).get("coverage")
    head = [f"**{cov['line']}**; lines {cov['executed']}/{cov['statements']}", "",
            "| branch | function | source line | why unreached |", "|---|---|---|---|"] if cov else []
    lines = head or [f"(no coverage recorded for {engine})"]
    for b in (cov or {}).get("unreached", []):
        reason = b["reason"]
        reason = f"**open gap**: {reason.removeprefix('gap:').strip()}" if reason.startswith("gap:") else reason
        lines.append(f"| `{b['key']}` | `{b['function']}` | `{b['source'].replace('|', '¦')}` | {reason} |")
    off = (cov or {}).get("off_path", {})
    if off:
        lines += ["", "Not counted, off the preparation's path (the profile's `off_path`): " + "; ".join(
            f"`{where}`: {why}" for where, why in off.items()) + "."]
    stale = (cov or {}).get("stale_declarations", [])
    if stale:
        lines += ["", "Declared unreachable but reached (or no such branch): " + ", ".join(f"`{k}`" for k in stale)
                  + "."]
    return "\n".join(lines)


def survivors_list(engine: str) -> str:
    """Every mutant of ``engine``'s recorded sample that was not killed: its id, status, reason and targets."""
    mut = records().get(engine, {}).get("mutation")
    lines = [f"**{mut['line']}**", ""] if mut else [f"(no mutation score recorded for {engine})"]
    for m in (mut or {}).get("not_killed", []):
        why = f": {m['reason']}" if m["reason"] else ""
        ran = f" (ran by {', '.join(m['targets'])})" if m["targets"] else ""
        lines.append(f"- `{m['id']}`, {m['status']}{why}{ran}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spec.measured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", type=Path, help="a verify-<engine>.json or mutate-<engine>.json report")
    parser.add_argument("--of", type=int, default=None,
                        help="a mutation run stopped early: the number of mutants of its whole sample")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    for report in args.reports:
        if not report.is_file():
            parser.error(f"no report at {report}")
    for report in args.reports:
        print(f"recorded {report} in {record(report, of=args.of)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
