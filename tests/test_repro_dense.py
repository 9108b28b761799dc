"""Standalone reproducers of the dense trainer batch's invariants (spec/repro/dense.py): a planted padding-helper
bug's failure (INV-DENSE-*, INV-MUT-003, INV-RESP-001) is written out and fails with ``spec`` unimportable (the
planted helper's own module, which imports nothing of the suite, written into the file); the impl twin of the
same case passes. One subprocess runs them all."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.planted_repro import planted_and_twins
from tests.test_repro import ROOT, RUN_WITHOUT_SPEC

#: (planted bug, the invariant it fails): the input left intact, nested positions, teacher rows, the response
#: slice after the conversion, prompts carried over, and no_padding_2_padding's response lengths
BUGS = (
    ("left_right_mutating", "INV-MUT-003"),
    ("left_right_as_nested_positions", "INV-DENSE-002"),
    ("left_right_drops_teacher", "INV-DENSE-004"),
    ("left_right_drops_width_flag", "INV-DENSE-005"),
    ("left_right_prompts_left_aligned", "INV-DENSE-006"),
    ("dense_lengths_from_mask_sum", "INV-RESP-001"),
)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return planted_and_twins(tmp_path_factory.mktemp("repro-dense"), BUGS, 20)


def _run_without_spec(paths: list[Path]) -> tuple[dict[str, int], str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run([sys.executable, "-c", RUN_WITHOUT_SPEC, *map(str, paths)], capture_output=True, text=True,
                          env=env, cwd=str(paths[0].parent), timeout=300)
    codes = {line.split()[2]: int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("EXIT")}
    assert set(codes) == {str(p) for p in paths}, done.stdout + done.stderr
    return codes, done.stdout


def test_planted_dense_bugs_reproduce_without_the_suite_and_impl_passes(written) -> None:
    for bug, rep, twin in written:
        assert rep.status == "reproduces", (bug, rep.status, rep.detail)
        for path in (rep.path, twin):
            assert not re.search(r"^\s*(import|from)\s+spec\b", path.read_text(), re.M), (bug, path)
    codes, out = _run_without_spec([p for _, rep, twin in written for p in (rep.path, twin)])
    for bug, rep, twin in written:
        assert codes[str(rep.path)] == 1, (bug, out)
        assert codes[str(twin)] == 0, (bug, out)
    assert out.count("FAIL INV-") == len(written) and "expected" in out, out
