"""Standalone reproducers of the micro-batch layer's invariants (spec/repro/minibatch.py): a failure of a layer
whose functions are importable by module and name is written out and fails without the suite; impl's twin of the
same case passes; a planted bug's wrapper (a closure of its factory) is written out with its module; a closure of no
factory is said not to be standalone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from spec.engines.impl.adapter import ImplEngine
from spec.invariants import CATALOGUE
from spec.planted import planted_engine
from spec.repro.writer import run_reproducer, write_reproducer, write_reproducers
from spec.run.runner import run_invariant

from tests import buggy_layer
from tests.test_repro_dense import _run_without_spec


class _Buggy(ImplEngine):
    name = "buggy-layer"

    def __init__(self, **replaced):
        super().__init__()
        self._replaced = replaced

    def microbatch_layer(self):
        return super().microbatch_layer().with_functions("buggy", **self._replaced)


class DpAlone(ImplEngine):
    """impl with a prepare_micro_batches that drops the data-parallel group (rebuilt by class on every rank)."""
    name = "buggy-layer-dp"

    def microbatch_layer(self):
        return super().microbatch_layer().with_functions("buggy", prepare_micro_batches=buggy_layer.prepare_micro_batches_alone)


CASES = (
    ("INV-MB-007", {"restore_dynamic_batch": buggy_layer.restore_dynamic_batch}),  # shows only without grad
    ("INV-MB-001", {"prepare_micro_batches": buggy_layer.prepare_micro_batches}),
    ("INV-MB-004", {"prepare_micro_batches": buggy_layer.prepare_micro_batches_exclusive}),
    # the fixed path's file checks every key as INV-MB-006 does, not only the samples' input_ids
    ("INV-MB-006", {"prepare_micro_batches": buggy_layer.prepare_micro_batches_fixed_keys}),
    ("INV-MB-009", {"chunk_tensordict": buggy_layer.chunk_tensordict}),
    ("INV-MB-010", {"concat_tensordict": buggy_layer.concat_tensordict}),
    ("INV-MB-011", {"index_select_tensor_dict": buggy_layer.index_select_tensor_dict}),
    ("INV-MB-012", {"nested_tensor_from_tensor_list": buggy_layer.nested_tensor_from_tensor_list}),
    ("INV-MB-013", {"list_of_dict_to_tensordict": buggy_layer.list_of_dict_to_tensordict}),
    ("INV-MB-014", {"maybe_fix_3d_position_ids": buggy_layer.maybe_fix_3d_position_ids}),
    # a training step's outputs through postprocess_batch_func (INV-MB-017's own check, written out)
    ("INV-MB-017", {"postprocess_batch_func": buggy_layer.postprocess_batch_func}),
    ("INV-MB-005", DpAlone),  # the reproducer starts its own gloo ranks
)


def _message(error: str) -> str:
    """The suite's failure message, without the exception's type and the shrink's additions."""
    return str(error).splitlines()[0].split("AssertionError: ", 1)[-1][:60]


@pytest.mark.parametrize("invariant,replaced", CASES, ids=[c[0] for c in CASES])
def test_a_layer_failure_reproduces_without_the_suite(invariant, replaced, tmp_path) -> None:
    engine = replaced() if isinstance(replaced, type) else _Buggy(**replaced)
    outcome = run_invariant(CATALOGUE[invariant], engine, "any", "cpu", profile="ci", database=None, shrink=False,
                            max_examples=10)
    assert outcome.status == "fail", (outcome.status, outcome.error)
    (rep,) = write_reproducers([outcome], engine, tmp_path)
    assert rep.status == "reproduces", (rep.status, rep.detail)
    text = rep.path.read_text()
    assert "from tests.buggy_layer import" in text and "import spec" not in text and "from spec" not in text
    # without the suite importable at all
    run = subprocess.run([sys.executable, "-c", "import runpy, sys; sys.modules['spec'] = None; "
                          f"runpy.run_path({str(rep.path)!r}, run_name='__main__')"],
                         capture_output=True, text=True, cwd=str(tmp_path), timeout=300,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})  # impl and tests only
    assert run.returncode == 1 and f"FAIL {invariant}" in run.stdout, run.stdout + run.stderr
    # got vs expected (or what is missing), or the invariant's own message: the file runs the invariant's check
    assert "expected" in run.stdout or "missing" in run.stdout or _message(outcome.error) in run.stdout, \
        (run.stdout, outcome.error)
    twin, why = write_reproducer(tmp_path / "twin.py", invariant=invariant, mode="any", engine=ImplEngine(),
                                 case=outcome.case)
    assert why is None
    code, printed = run_reproducer(twin)
    assert code == 0 and "PASS" in printed, printed


def test_a_planted_layer_bug_reproduces_without_the_suite(tmp_path) -> None:
    """A planted bug's wrapper is a closure of spec/planted/microbatch_bugs.py: the file writes that module and the
    layer protocol it imports out, and calls the factory on impl's layer."""
    engine = planted_engine("restore_skipped_without_grad")
    outcome = run_invariant(CATALOGUE["INV-MB-007"], engine, "any", "cpu", profile="ci", database=None, shrink=False,
                            max_examples=10)
    assert outcome.status == "fail"
    (rep,) = write_reproducers([outcome], engine, tmp_path, check=False)
    text = rep.path.read_text()
    assert "restore_skipped_without_grad(" in text and not re.search(r"^\s*(import|from)\s+spec\b", text, re.M)
    codes, out = _run_without_spec([rep.path])
    assert codes[str(rep.path)] == 1 and "FAIL INV-MB-007" in out, out


def test_a_closure_of_no_factory_is_not_standalone(tmp_path) -> None:
    def restore_dynamic_batch(data, batch_idx_list):  # a closure the suite cannot write out
        return data

    engine = _Buggy(restore_dynamic_batch=restore_dynamic_batch)
    outcome = run_invariant(CATALOGUE["INV-MB-007"], engine, "any", "cpu", profile="ci", database=None, shrink=False,
                            max_examples=10)
    assert outcome.status == "fail"
    (rep,) = write_reproducers([outcome], engine, tmp_path)
    assert rep.status == "not standalone" and "restore_dynamic_batch" in rep.detail
    code, printed = run_reproducer(rep.path)
    assert code == 2 and "NOT STANDALONE" in printed


def test_the_end_to_end_failure_reproduces_without_the_suite_and_impl_passes(tmp_path) -> None:
    """INV-MB-015 (spec/repro/end_to_end.py): the planted layer's wrapper written out with its factory, impl's engine
    on every micro-batch, postprocess_batch_func, the float64 reference of the whole mini-batch; impl's twin passes."""
    engine = planted_engine("restore_off_by_one_when_reordered")
    outcome = run_invariant(CATALOGUE["INV-MB-015"], engine, "packed", "cpu", profile="ci", database=None,
                            shrink=False, max_examples=10)
    assert outcome.status == "fail", (outcome.status, outcome.error)
    (rep,) = write_reproducers([outcome], engine, tmp_path)
    assert rep.status == "reproduces", (rep.status, rep.detail)
    text = rep.path.read_text()
    assert "restore_off_by_one_when_reordered(" in text and not re.search(r"^\s*(import|from)\s+spec\b", text, re.M)
    twin, why = write_reproducer(tmp_path / "twin.py", invariant="INV-MB-015", mode="packed", engine=ImplEngine(),
                                 case=outcome.case)
    assert why is None, why
    codes, out = _run_without_spec([rep.path, twin])
    assert codes[str(rep.path)] == 1 and "FAIL INV-MB-015" in out and "expected" in out, out
    assert codes[str(twin)] == 0 and "PASS: INV-MB-015" in out, out
