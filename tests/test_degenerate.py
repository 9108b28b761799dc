"""Degenerate lengths beyond engine cases (docs/contract.md, "Degenerate lengths"): an aborted rollout's zero-length
response is drawn in dense batches (left_right_2_no_padding) and in the micro-batch layer's mini-batches, and the
checks there hold for impl on it."""

from __future__ import annotations

import torch

from spec.cases.materialize import materialize_dense
from spec.cases.microbatch import minibatch_cases
from spec.cases.strategies import ABORTED_ONE_IN, dense_cases, with_aborted_response
from spec.cases.structure import DenseCase
from spec.engines.impl.adapter import ImplEngine
from spec.execute.attribution import AttributedEngine
from spec.invariants import CATALOGUE, Ctx
from spec.run import profiles  # noqa: F401 - registers the hypothesis profiles
from tests.test_profile import drawn

ABORTED = DenseCase(prompt_lens=(2, 3, 1), response_lens=(2, 0, 3), prompt_width=3, response_width=3,
                    eos_is_pad=True, mask_holes=True, pad_token_id=1, vocab=7, seed=4)


def test_dense_and_mini_batches_draw_an_aborted_response() -> None:
    dense = drawn(dense_cases(), 120)
    aborted = [c for c in dense if 0 in c.response_lens]
    assert aborted and all(c.batch_size >= 2 and c.response_width >= max(c.response_lens) for c in aborted)
    assert not any(0 in c.response_lens for c in dense if c.batch_size == 1)
    assert any(0 in c.response_lens for c in drawn(minibatch_cases(), 200))
    case = DenseCase(prompt_lens=(1, 2), response_lens=(3, 1), prompt_width=2, response_width=3, seed=3)
    assert with_aborted_response(case, 0) == case  # the key shrinks to none
    assert with_aborted_response(case, ABORTED_ONE_IN - 1).response_lens == (3, 0)  # sample seed mod B


def test_an_aborted_row_keeps_its_prompt_and_has_no_response_token() -> None:
    batch = materialize_dense(ABORTED)
    row = 1  # prompt of 3 tokens filling the prompt width, response empty
    assert batch["attention_mask"][row].tolist() == [1, 1, 1, 0, 0, 0]
    assert batch["response_mask"][row].tolist() == [0, 0, 0]
    # eos = pad ends only real responses: the aborted row's last prompt token is a token of the seed, not the pad
    seeded = torch.randint(0, ABORTED.vocab, (3, 6), generator=torch.Generator().manual_seed(ABORTED.seed))
    assert batch["input_ids"][row, :3].tolist() == seeded[row, :3].tolist()


def test_the_dense_checks_hold_for_impl_on_an_aborted_row() -> None:
    engine = AttributedEngine(ImplEngine())
    for inv in ("INV-DENSE-001", "INV-DENSE-002", "INV-DENSE-003", "INV-DENSE-005", "INV-DENSE-006", "INV-MUT-003"):
        CATALOGUE[inv].check(Ctx(engine, ABORTED, "cpu", "any"))
