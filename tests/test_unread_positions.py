"""Checks assert only what a consumer reads (the held-out false alarm of the step issue): an engine whose outputs
differ from impl's only at positions no consumer reads (each sequence's last token) passes INV-MB-015, the end-to-end micro-batch check, and
its standalone reproducer agrees with the invariant on the same case.

Before the fix INV-MB-015 compared every position the oracle has for a key (entropy: all ``n_i`` tokens, the last one
included) and failed the harmless engine on the issue's shrunk case
``MiniBatchCase(p=[1] r=[1] fixed mbs=1 entropy seed=1)`` ("'entropy' of sample 0 ...: at (1,) got 0"), while the
reproducer (which reads ``read_span``) passed. Cost: one engine run per mode and one reproducer (about a second).
"""

from __future__ import annotations

import pytest
import torch

from spec.cases.microbatch import MiniBatchCase
from spec.execute.harness import execute
from spec.invariants import CATALOGUE
from spec.invariants.core import Ctx
from spec.planted.harmless import harmless_engine
from spec.repro.writer import run_reproducer, write_reproducer
from spec.truth.rules import read_positions

#: the issue's shrunk counterexample: one sample, one micro-batch, entropy asked
ISSUE_CASE = MiniBatchCase((1,), (1,), use_dynamic_bsz=False, micro_batch_size=1, calculate_entropy=True, seed=1)


def test_the_harmless_engine_changes_only_unread_positions() -> None:
    """It really differs from impl (at every sequence's last token) and nowhere a consumer reads."""
    case = ISSUE_CASE.engine_case().with_(prompt_lens=(2, 1), response_lens=(1, 3))
    base, run = execute(harmless_engine("contiguous_copies"), case), execute(harmless_engine("unread_outputs_zeroed"),
                                                                             case)
    read = read_positions(case.prompt_lens, case.response_lens)
    for key in ("log_probs", "entropy"):
        ours, theirs = run.outputs[key].unbind(), base.outputs[key].unbind()
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert torch.equal(a[read[i]], b[read[i]]), (key, i)
            assert a[-1] == 0 and b[-1] != 0, (key, i, a, b)


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_end_to_end_reads_only_consumer_positions(mode) -> None:
    case = ISSUE_CASE.with_(use_remove_padding=mode == "packed")
    CATALOGUE["INV-MB-015"].check(Ctx(harmless_engine("unread_outputs_zeroed"), case, "cpu", mode))


def test_the_end_to_end_reproducer_agrees(tmp_path) -> None:
    engine = harmless_engine("unread_outputs_zeroed")
    path, why = write_reproducer(tmp_path / "mb015.py", invariant="INV-MB-015", mode="packed", engine=engine,
                                 case=ISSUE_CASE)
    assert why is None, why
    code, out = run_reproducer(path)
    assert code == 0 and "PASS: INV-MB-015" in out, out


@pytest.mark.parametrize("mode", ["packed", "padded"])
@pytest.mark.parametrize("invariant", ["INV-STEP-001", "INV-STEP-002", "INV-STEP-003", "INV-STEP-004"])
def test_the_step_reads_only_consumer_positions(invariant, mode) -> None:
    """The training step's checks pass the harmless engine (last-token outputs 0) on two ranks of two micro-batches,
    a distillation step included (its per-token distillation terms zeroed at the last token too)."""
    from spec.cases.step import StepCase

    for loss, topk in (("policy", 0), ("distillation", 2)):
        case = StepCase((2, 1, 3, 1), (3, 1, 2, 4), dp=2, cut="count", micro_batch_size=1, loss=loss,
                        mode="seq-mean-token-mean", use_remove_padding=mode == "packed", holes=0.3, topk=topk, seed=3)
        CATALOGUE[invariant].check(Ctx(harmless_engine("unread_outputs_zeroed"), case, "cpu", "any"))
