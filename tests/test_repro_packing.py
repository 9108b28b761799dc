"""Standalone reproducers of the Megatron packing invariants (spec/repro/packing.py) and of the drop-in dense
batches (INV-DROPIN-001/002, spec/repro/dense.py): a planted packer's failure (INV-MEG-001..004) is written out with
the packer's module and the packing statement it imports, and fails with ``spec`` unimportable; the reference
packer's twin of the same case passes. A planted drop-in helper's failure likewise, impl's twin passes. One
subprocess runs them all."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from spec.engines.impl.adapter import ImplEngine
from spec.engines.megatron.adapter import VerlMegatronPacker
from spec.invariants import CATALOGUE
from spec.repro.packing import ReferencePackingEngine
from spec.repro.writer import run_reproducer, write_reproducer
from spec.run.registry import load_engine
from spec.run.runner import run_invariant

from tests.planted_repro import planted_and_twins
from tests.test_repro_dense import _run_without_spec

#: (planted bug, the invariant it fails): every planted packer (a round trip, the alignment, positions, labels)
#: the MTP targets, and the drop-in helpers (right-padded whole sequences, marks on padding columns)
BUGS = (
    ("zigzag_halves_swapped", "INV-MEG-001"),
    ("unpack_from_unpadded_offsets", "INV-MEG-001"),
    ("align_ignores_tp", "INV-MEG-002"),
    ("positions_continue", "INV-MEG-003"),
    ("roll_local_shard", "INV-MEG-004"),
    ("mtp_mask_unrolled", "INV-MEG-008"),
    ("routes_packed_unaligned", "INV-MEG-009"),
    ("record_tp_parts_reversed", "INV-MEG-009"),
    ("left_right_runs_from_column_counts", "INV-DROPIN-001"),
    ("left_right_split_from_columns", "INV-DROPIN-001"),
    ("left_right_loss_mask_keeps_stray_marks", "INV-DROPIN-002"),
)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return planted_and_twins(tmp_path_factory.mktemp("repro-packing"), BUGS, 5, lambda invariant:
                             ReferencePackingEngine() if invariant.startswith("INV-MEG-") else ImplEngine())


def test_planted_packers_and_dropin_helpers_reproduce_without_the_suite_and_their_twins_pass(written) -> None:
    for bug, rep, twin in written:
        assert rep.status == "reproduces", (bug, rep.status, rep.detail)
        for path in (rep.path, twin):
            assert not re.search(r"^\s*(import|from)\s+spec\b", path.read_text(), re.M), (bug, path)
    codes, out = _run_without_spec([p for _, rep, twin in written for p in (rep.path, twin)])
    for bug, rep, twin in written:
        assert codes[str(rep.path)] == 1, (bug, out)
        assert codes[str(twin)] == 0, (bug, out)
    assert out.count("FAIL INV-") == len(written) and "expected" in out, out


def test_the_planted_packer_is_written_out_with_its_module(written) -> None:
    """The packer is the planted class of spec/planted/megatron_bugs.py, built from that module written out."""
    for bug, rep, _ in written:
        if "INV-MEG-" in rep.invariant:
            engine = load_engine(f"planted:{bug}")
            assert f"PACKER = _written_spec_planted_megatron_bugs.{type(engine.packer).__name__}()" in \
                rep.path.read_text(), bug


class _VerlShaped(ReferencePackingEngine):
    name = "verl-shaped"

    def __init__(self):
        super().__init__()
        # a module the written file cannot import: the file must import verl's by name, never carry it
        self.packer = VerlMegatronPacker(SimpleNamespace(__name__="no_such_verl_module.mcore.util"))


def test_verls_packer_is_written_out_over_its_module_by_name(tmp_path) -> None:
    """verl-megatron's adapter (the faked parallel state and all_gather) is written out as plain code, over
    verl.models.mcore.util imported by its name: a module that does not import makes the file raise, never pass."""
    engine = load_engine("planted:zigzag_halves_swapped")
    outcome = run_invariant(CATALOGUE["INV-MEG-001"], engine, "any", "cpu", profile="ci", shrink=False,
                            max_examples=5, database=None)
    path, why = write_reproducer(tmp_path / "verl.py", invariant="INV-MEG-001", mode="any", engine=_VerlShaped(),
                                 case=outcome.case)
    assert why is None, why
    text = path.read_text()
    assert "def fake_parallel_state(" in text and "class VerlMegatronPacker" in text and "class _DynamicGroup" in text
    assert "importlib.import_module('no_such_verl_module.mcore.util')" in text
    assert "pip install verl megatron-core torch tensordict" in text
    assert not re.search(r"^\s*(import|from)\s+spec\b", text, re.M)
    code, printed = run_reproducer(path)
    assert code == 3 and "ModuleNotFoundError" in printed, printed
