"""A derandomized run's cases depend on the strategy and the seed alone (spec/run/generation.py): not on which
modules are imported when it runs, nor on the literals written in them (hypothesis 6.131+ would draw those)."""

from __future__ import annotations

import importlib
import sys

from hypothesis import given, seed, settings
from hypothesis import strategies as st

from spec.run import generation, profiles  # noqa: F401 - importing the profiles pins the generation

#: literals no strategy of the suite would draw by itself
MARKERS = tuple(7_340_033 + 2 * i for i in range(64))


def _draws() -> list[int]:
    seen: list[int] = []

    @seed(1234)
    @settings(max_examples=300, derandomize=True, database=None)
    @given(st.integers())
    def collect(x: int) -> None:
        seen.append(x)

    collect()
    return seen


def test_the_cases_do_not_depend_on_the_modules_loaded(tmp_path, monkeypatch) -> None:
    assert not generation.mines_local_constants()
    before = _draws()
    (tmp_path / "literals_module.py").write_text("VALUES = (" + ", ".join(map(str, MARKERS)) + ")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("literals_module")
    try:
        after = _draws()
    finally:
        sys.modules.pop("literals_module", None)
    assert not set(MARKERS) & set(after), "a literal of a loaded module was drawn"
    assert after == before
