"""The conformance report: a table of outcomes as text, Markdown and JSON."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .invariants import CATALOGUE
from .runner import Outcome

__all__ = ["summary_line", "markdown", "write_reports", "failed"]

_MARK = {"pass": "pass", "fail": "FAIL", "skip": "skip", "xfail": "known failure", "xpass": "XPASS"}


def failed(outcomes: list[Outcome]) -> bool:
    return any(o.status in ("fail", "xpass") for o in outcomes)


def summary_line(outcomes: list[Outcome]) -> str:
    counts = Counter(o.status for o in outcomes)
    parts = [f"{counts.get('pass', 0)} passed", f"{counts.get('fail', 0)} failed"]
    parts += [f"{counts[k]} {label}" for k, label in (("skip", "skipped"), ("xfail", "known failures"),
                                                      ("xpass", "unexpectedly passed")) if counts.get(k)]
    return ", ".join(parts)


def _detail(o: Outcome) -> str:
    if o.status in ("fail", "xfail") and o.counterexample:
        text = f"`{o.counterexample}` → {o.error}"
    elif o.status in ("fail",):
        text = o.error or ""
    else:
        text = o.reason or ""
    if o.status == "xfail" and o.reason:
        text = f"{o.reason}; {text}"
    return text.replace("|", "\\|")


def markdown(outcomes: list[Outcome], *, engine: str, profile: str, device: str) -> str:
    lines = [f"# Conformance report: engine `{engine}`", "",
             f"profile `{profile}`, device `{device}`: **{summary_line(outcomes)}**", "",
             "| invariant | title | mode | examples | result | detail |",
             "|---|---|---|---:|---|---|"]
    for o in outcomes:
        title = CATALOGUE[o.invariant].title.replace("|", "\\|")
        lines.append(f"| {o.invariant} | {title} | {o.mode} | {o.examples} | {_MARK[o.status]} | {_detail(o)} |")
    return "\n".join(lines) + "\n"


def write_reports(outcomes: list[Outcome], stem: Path, *, engine: str, profile: str, device: str) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    md, js = stem.with_suffix(".md"), stem.with_suffix(".json")
    md.write_text(markdown(outcomes, engine=engine, profile=profile, device=device))
    js.write_text(json.dumps({"engine": engine, "profile": profile, "device": device,
                              "summary": summary_line(outcomes),
                              "outcomes": [o.as_dict() for o in outcomes]}, indent=2))
    return [md, js]
