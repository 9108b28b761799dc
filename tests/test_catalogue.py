"""The catalogue and spec/README.md stay in step; every contract invariant is covered."""

from __future__ import annotations

import re
from pathlib import Path

from spec.invariants import CATALOGUE
from spec.planted import PLANTED

README = Path(__file__).resolve().parents[1] / "spec" / "README.md"
ROW = re.compile(r"^\| (INV-[A-Z]+-\d{3}) \|")


def test_readme_lists_every_invariant_once() -> None:
    listed = [m.group(1) for line in README.read_text().splitlines() if (m := ROW.match(line))]
    assert sorted(listed) == sorted(CATALOGUE), (
        f"spec/README.md and spec/invariants disagree: only in README {sorted(set(listed) - set(CATALOGUE))}, "
        f"only in code {sorted(set(CATALOGUE) - set(listed))}")
    assert len(listed) == len(set(listed))


def test_readme_titles_match_code() -> None:
    text = README.read_text()
    for info in CATALOGUE.values():
        assert f"| {info.id} | {info.title} |" in text, f"{info.id}: README title differs from the code's"


def test_every_contract_invariant_is_covered() -> None:
    # docs/contract.md: 1-10 the invariants of the two calls, 13 the micro-batch layer, 14 images and videos, 15 the
    # training step, 16 routed experts (11 and 12 say where and for whom 1-10 hold: reach and engines, no invariant of
    # their own)
    assert {info.contract for info in CATALOGUE.values()} == set(range(1, 11)) | {13, 14, 15, 16}
    assert len(CATALOGUE) >= 20


def test_readme_records_every_planted_bug() -> None:
    text = README.read_text()
    for name in PLANTED:
        assert f"`{name}`" in text, f"spec/README.md does not record planted bug {name}"


def test_ids_are_well_formed() -> None:
    for key, info in CATALOGUE.items():
        assert key == info.id and re.fullmatch(r"INV-[A-Z]+-\d{3}", key)
        assert info.modes and set(info.modes) <= {"packed", "padded", "both", "any"}
