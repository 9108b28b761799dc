"""The conformance report: a table of outcomes as text, Markdown and JSON.

The *verdict* is made of the non-layout invariants only: any real failure, suite error or
stale known failure among them fails it. Layout-profile invariants (``InvariantInfo.layout``:
verl's private layout conventions the contract leaves open) are reported in their own section
and never fail the verdict. Per invariant the report shows the examples run, those that
exercised the property, the distinct cases drawn and the known-failure hits, and the slowest targets.

The files (``verify-<engine>.md`` / ``.json``) hold every table; :func:`summary` is what ``python -m spec
verify`` prints: the counts, one line per failure, the slowest targets, the report paths and the next command.
"""

from __future__ import annotations

import json
import os
import shlex
from collections import Counter
from pathlib import Path

from .invariants import CATALOGUE
from .run.runner import Outcome

__all__ = ["summary_line", "summary", "slowest", "mechanism", "safe_name", "report_paths", "markdown", "write_reports",
           "failed", "verdict_outcomes", "layout_outcomes",
           "FAILING", "by_counterexample", "coverage", "coverage_table", "unseen_without_reason"]

_MARK = {"pass": "pass", "fail": "FAIL", "error": "ERROR (suite)", "skip": "skip", "xfail": "known failure",
         "xpass": "STALE known failure", "unexercised": "not exercised"}
#: statuses that fail the verdict
FAILING = ("fail", "error", "xpass")


def _is_layout(o: Outcome) -> bool:
    info = CATALOGUE.get(o.invariant)
    return bool(o.layout or (info is not None and info.layout))


def verdict_outcomes(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if not _is_layout(o)]


def layout_outcomes(outcomes: list[Outcome]) -> list[Outcome]:
    return [o for o in outcomes if _is_layout(o)]


def failed(outcomes: list[Outcome]) -> bool:
    """Whether the conformance verdict fails (layout-profile outcomes never count)."""
    return any(o.status in FAILING for o in verdict_outcomes(outcomes))


def summary_line(outcomes: list[Outcome]) -> str:
    counts = Counter(o.status for o in outcomes)
    parts = [f"{counts.get('pass', 0)} passed", f"{counts.get('fail', 0)} failed"]
    parts += [f"{counts[k]} {label}" for k, label in (("error", "suite errors"), ("unexercised", "not exercised"),
                                                      ("skip", "skipped"),
                                                      ("xfail", "known failures"),
                                                      ("xpass", "stale known failures")) if counts.get(k)]
    return ", ".join(parts)


#: how many of the slowest targets the summary and the report name
SLOWEST = 5


def safe_name(engine: str) -> str:
    """``engine`` as one file-name part: ``:`` and path separators become ``-`` (``planted:x`` ->
    ``planted-x``); the reports are ``verify-<safe name>.md/.json``, the reproducers ``<safe name>/repro/``."""
    return engine.replace(":", "-").replace("/", "-").replace(os.sep, "-")


def report_paths(stem: Path) -> tuple[Path, Path]:
    """The Markdown and JSON report of ``stem`` (``stem`` + ``.md`` / ``.json``, a dot in an engine's name kept)."""
    return stem.with_name(stem.name + ".md"), stem.with_name(stem.name + ".json")


def slowest(outcomes: list[Outcome], n: int = SLOWEST) -> list[Outcome]:
    """The ``n`` targets that took longest (skipped ones never ran), slowest first."""
    ran = [o for o in outcomes if o.status != "skip"]
    return sorted(ran, key=lambda o: -o.seconds)[:n]


def _slowest_text(outcomes: list[Outcome]) -> str:
    return ", ".join(f"{o.invariant}/{o.mode} {o.seconds:.1f}s" for o in slowest(outcomes))


def _shorten(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def mechanism(o: Outcome) -> str:
    """What went wrong, in a few words: the assertion or the engine's exception (its first line), a suite
    error's last line, a stale record's reason."""
    if o.status == "xpass":
        return _shorten(f"known-failure record never fired: {o.reason or ''}")
    lines = [line.strip() for line in (o.error or o.reason or "").splitlines() if line.strip()]
    if not lines:
        return ""
    line = lines[0].removeprefix("AssertionError: ")
    if o.status == "error" and len(lines) > 1:  # a suite error: its first line says where, its last what
        line = lines[-1] if lines[0].startswith("Traceback") else f"{lines[0].rstrip(':')}: {lines[-1]}"
    return _shorten(line)


def summary(outcomes: list[Outcome], *, engine: str, profile: str, device: str, seconds: float, paths: list[Path],
            reproducers=None, rerun: list[str] | None = None) -> list[str]:
    """What ``python -m spec verify`` prints: the verdict and counts, one line per failure (ID, mode, what went
    wrong), the slowest targets, the report paths and the commands to run next. The tables are in the files."""
    verdict, layout = verdict_outcomes(outcomes), layout_outcomes(outcomes)
    word = "FAIL" if failed(outcomes) else "pass"
    lines = [f"verify: engine {engine}, profile {profile}, device {device}: verdict {word}: {summary_line(verdict)}"
             + (f" (layout profile, not in the verdict: {summary_line(layout)})" if layout else "")
             + f" in {seconds:.1f}s"]
    bad = [o for o in verdict if o.status in FAILING]
    for o in bad:
        lines.append(f"  {_MARK[o.status]} {o.invariant}/{o.mode}: {mechanism(o)}")
    for case, members in by_counterexample(outcomes):
        lines.append(f"  ({len(members)} failures share the minimal counterexample {_shorten(case, 70)}: likely one "
                     "root cause)")
    if outcomes:
        lines.append(f"slowest: {_slowest_text(outcomes)}")
    lines.append("report (every table): " + ", ".join(str(p) for p in paths))
    nexts = []
    shown = [r for r in reproducers or () if r.status == "reproduces"]
    for rep in shown[:5]:
        nexts.append(f"python {shlex.quote(str(rep.path))}  # {rep.invariant}/{rep.mode} standalone")
    if len(shown) > 5:
        nexts.append(f"# +{len(shown) - 5} more reproducers in {Path(shown[0].path).parent}")
    others = [r for r in reproducers or () if r.status != "reproduces"]
    if others:
        nexts.append("# reproducers that do not fail standalone: "
                     + ", ".join(f"{Path(r.path).name} ({r.status})" for r in others[:5]))
    if bad and rerun:
        ids = list(dict.fromkeys(o.invariant for o in bad))
        nexts.append(shlex.join([*rerun, "--only", ",".join(ids)]) + "  # rerun the failures")
    if nexts:
        lines.append("next:")
        lines += [f"  {n}" for n in nexts]
    return lines


def _detail(o: Outcome) -> str:
    if o.status in ("fail", "error") and o.counterexample:
        text = f"`{o.counterexample}` → {o.error}"
        if o.other_failures:
            text += f" (+{len(o.other_failures)} more distinct failure(s), see JSON)"
    elif o.status in ("fail", "error"):
        text = o.error or ""
    else:
        text = o.reason or ""
    return text.replace("|", "\\|").replace("\n", " ")


def _table(outcomes: list[Outcome]) -> list[str]:
    lines = ["| invariant | title | mode | examples | exercised | distinct cases | known hits | result | detail |",
             "|---|---|---|---:|---:|---:|---:|---|---|"]
    for o in outcomes:
        title = CATALOGUE[o.invariant].title.replace("|", "\\|") if o.invariant in CATALOGUE else ""
        lines.append(f"| {o.invariant} | {title} | {o.mode} | {o.examples} | {o.exercised} | {o.distinct_cases} | "
                     f"{o.known_hits} | {_MARK[o.status]} | {_detail(o)} |")
    return lines


def by_counterexample(outcomes: list[Outcome]) -> list[tuple[str, list[Outcome]]]:
    """Failed verdict outcomes grouped by their minimal counterexample (the main one or any further distinct
    one), groups of two or more only, largest first: failures that shrink to one case are most likely one root
    cause, diagnosed once."""
    groups: dict[str, list[Outcome]] = {}
    for o in verdict_outcomes(outcomes):
        if o.status not in ("fail", "error"):
            continue
        cases = [o.counterexample] + [f.get("counterexample") for f in o.other_failures]
        for case in dict.fromkeys(c for c in cases if c):
            groups.setdefault(case, []).append(o)
    shared = [(case, members) for case, members in groups.items() if len(members) > 1]
    return sorted(shared, key=lambda item: -len(item[1]))


def _grouped(outcomes: list[Outcome]) -> list[str]:
    groups = by_counterexample(outcomes)
    if not groups:
        return []
    lines = ["", "## Failures sharing a minimal counterexample (likely one root cause each)", ""]
    for case, members in groups:
        names = ", ".join(f"{o.invariant}/{o.mode}" for o in members)
        first = next((o.error for o in members if o.counterexample == case), members[0].error) or ""
        lines.append(f"- `{case}`: {names}; first: {first[:300]}".replace("\n", " "))
    return lines


def coverage(outcomes: list[Outcome]) -> dict[str, dict[str, int]]:
    """dimension -> value -> examples that had it, over every outcome."""
    total: dict[str, Counter] = {}
    for o in outcomes:
        for dim, values in (o.coverage or {}).items():
            total.setdefault(dim, Counter()).update(values)
    return {dim: dict(values) for dim, values in total.items()}


def unseen_without_reason(outcomes: list[Outcome], domains: dict[str, dict[str, str | None]]) -> list[str]:
    """``dimension = value`` for every value no example had although the engine declares no reason for it."""
    seen = coverage(outcomes)
    return [f"{dim} = {value}" for dim, values in domains.items() for value, reason in values.items()
            if reason is None and not seen.get(dim, {}).get(value)]


def coverage_table(outcomes: list[Outcome], domains: dict[str, dict[str, str | None]]) -> list[str]:
    """Per dimension and value, the share of the engine's examples that had it; a value never seen with the
    reason the engine gives (a feature it lacks, a configuration value it declares but the suite does not draw),
    or marked as unseen without one."""
    seen = coverage(outcomes)
    # each share over the examples of its kind: engine cases (every one has a layout), mini-batches (a path)
    per_kind = {"": sum(seen.get("layout", {}).values()) or 1,
                "micro-batch: ": sum(seen.get("micro-batch: path", {}).values()) or 1}
    lines = ["| dimension | value | examples | share | not seen because |", "|---|---|---:|---:|---|"]
    for dim, values in domains.items():
        examples = per_kind["micro-batch: " if dim.startswith("micro-batch: ") else ""]
        for value, reason in values.items():
            count = seen.get(dim, {}).get(value, 0)
            why = "" if count else (reason or "**unseen, no reason declared**")
            lines.append(f"| {dim} | {value} | {count} | {count / examples:.1%} | {why.replace('|', '/')} |")
    return lines


def _reproducers(reproducers, base: Path | None) -> list[str]:
    """The reproducers section: each failure's file (linked relative to the report) and whether it fails
    standalone; those that cannot be reproduced standalone are listed as such."""
    if not reproducers:
        return []
    meaning = {"reproduces": "fails standalone (exit 1)", "passes": "does NOT reproduce standalone (exit 0)",
               "not standalone": "no standalone reproducer", "error": "reproducer error", "written": "written, not run"}
    lines = ["", "## Reproducers", "",
             "One file per failure: `python <file>` rebuilds the shrunk case with plain torch + tensordict, calls the "
             "engine, compares with a float64 reference and exits 1 printing got vs expected (spec/repro/).", "",
             "| invariant | mode | reproducer | standalone run | detail |", "|---|---|---|---|---|"]
    for rep in reproducers:
        path = Path(rep.path)
        link = path.relative_to(base).as_posix() if base is not None and path.is_relative_to(base) else path.as_posix()
        deps = "" if rep.standalone else " (imports the suite's adapter)"
        detail = (rep.detail or "").replace("|", "\\|").replace("\n", " ")
        known = " (known failure)" if getattr(rep, "known", False) else ""
        lines.append(f"| {rep.invariant}{known} | {rep.mode} | [{path.name}]({link}){deps} | {meaning.get(rep.status, rep.status)} "
                     f"| {detail} |")
    return lines


def companions_table(companions: dict[str, str]) -> list[str]:
    """Whose code each companion the harness hands the engine is (``EngineUnderTest.companions``)."""
    lines = ["", "## Companions", "", "What the harness hands the engine besides the batch, and whose code it is "
             "(own: the engine's; stand-in: the suite's, with why).", "", "| companion | whose |", "|---|---|"]
    return lines + [f"| {name} | {whose} |" for name, whose in sorted(companions.items())]


def markdown(outcomes: list[Outcome], *, engine: str, profile: str, device: str, reproducers=None,
             base: Path | None = None, domains: dict[str, dict[str, str | None]] | None = None,
             companions: dict[str, str] | None = None) -> str:
    verdict, layout = verdict_outcomes(outcomes), layout_outcomes(outcomes)
    word = "FAILS" if failed(outcomes) else "passes"
    lines = [f"# Conformance report: engine `{engine}`", "",
             f"profile `{profile}`, device `{device}`: the verdict {word}: **{summary_line(verdict)}**", ""]
    lines += _table(verdict)
    lines += _grouped(outcomes)
    if layout:
        lines += ["", "## Layout profile (verl's layout conventions; informational, not part of the verdict)", "",
                  f"**{summary_line(layout)}**", ""]
        lines += _table(layout)
    lines += _reproducers(reproducers, base)
    if outcomes:
        lines += ["", "## Slowest targets", "", f"The targets (invariant/mode) that took longest, at most {SLOWEST}: "
                  f"{_slowest_text(outcomes)}."]
    if companions:
        lines += companions_table(companions)
    if domains:
        lines += ["", "## Coverage of the input space", "",
                  "Share of the engine's examples (over every invariant run) that had each value of each drawn "
                  "dimension; a temperature range counts once per example that had it, a feature pair once per "
                  "example that had both features (spec.cases.coverage.FEATURES; pairs the contract never combines, "
                  "EXCLUDED_PAIRS, are not listed); a micro-batch dimension's share is over the mini-batches.", ""]
        lines += coverage_table(outcomes, domains)
    return "\n".join(lines) + "\n"


def write_reports(outcomes: list[Outcome], stem: Path, *, engine: str, profile: str, device: str,
                  reproducers=None, domains: dict[str, dict[str, str | None]] | None = None,
                  companions: dict[str, str] | None = None) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    md, js = report_paths(stem)
    md.write_text(markdown(outcomes, engine=engine, profile=profile, device=device, reproducers=reproducers,
                           base=stem.parent, domains=domains, companions=companions))
    verdict, layout = verdict_outcomes(outcomes), layout_outcomes(outcomes)
    js.write_text(json.dumps({"engine": engine, "profile": profile, "device": device,
                              "verdict": "fail" if failed(outcomes) else "pass",
                              "summary": summary_line(verdict),
                              "layout_summary": summary_line(layout),
                              "shared_counterexamples": [{"counterexample": case, "failures": [o.test_id for o in m]}
                                                         for case, m in by_counterexample(outcomes)],
                              "coverage": coverage(outcomes),
                              "companions": dict(companions or {}),
                              "outcomes": [o.as_dict() for o in outcomes],
                              "reproducers": [r.as_dict() for r in reproducers or ()]}, indent=2))
    return [md, js]
