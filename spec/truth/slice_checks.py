"""The checks of the response slice, stated once: ``no_padding_2_padding`` of the log-probs (its shape, its values
against the oracle), the slice and its nested variants on per-token tensors built from the seed (only response
positions read, rows, the round trip, every dtype), and the response view every framework's consumer reads. The
invariants (spec/invariants/slicing.py, settings.py) call them on the suite's run; a standalone reproducer calls the
same functions, vendored beside it (``repro_suite.py``; spec/repro/runtime.py). So they take plain values (lengths,
the seed, the helpers and the micro-batch they are called with) and fail by :func:`~spec.truth.failing.fail`.
"""

from __future__ import annotations

import torch

from .closeness import close
from .failing import add_facts, fail
from .rules import offsets, response_positions

__all__ = ["slice_shape", "slice_values", "poisoned_per_token", "slice_reads_only_responses", "response_from_nested_rows",
           "response_round_trip", "SLICE_DTYPES", "slice_dtypes", "consumer_response_view"]


def slice_shape(sliced, batch_size: int, width: int, response_lens, flag) -> None:
    """INV-SLICE-001: ``no_padding_2_padding(log_probs)`` is ``(B, width)`` (the max_response_len ``flag``, else
    ``max r_i``)."""
    if tuple(sliced.shape) != (batch_size, width):
        fail(f"no_padding_2_padding gave shape {tuple(sliced.shape)}, expected {(batch_size, width)} "
             f"(responses {list(response_lens)}, max_response_len flag {flag})")


def slice_values(sliced, want, tol) -> None:
    """INV-SLICE-002: the sliced log-probs equal the oracle's log-prob of each response token (``want``: its
    ``(B, R)`` response log-probs, zero past r_i), within ``tol``."""
    close(sliced, want, "response log_probs (B, max_response_len)", atol=tol)


def poisoned_per_token(seed: int, prompt_lens, response_lens, width: int, device="cpu", trailing=()):
    """A nested per-token tensor over the sequences (on ``device``): random (from ``seed``) where a response token is
    scored, NaN everywhere else; and the ``(B, width, *trailing)`` slice a consumer expects of it (zeros past each
    response)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + r for p, r in zip(prompt_lens, response_lens)]
    values = torch.full((sum(seq_lens), *trailing), float("nan"))
    want = torch.zeros(len(seq_lens), width, *trailing)
    for i, (start, stop) in enumerate(response_positions(prompt_lens, response_lens)):
        chunk = torch.randn(stop - start, *trailing, generator=gen)
        values[start:stop] = chunk
        want[i, : stop - start] = chunk
    nested = torch.nested.nested_tensor_from_jagged(values.to(device), offsets(seq_lens).to(device))
    return nested, want


def slice_reads_only_responses(np2p, batch, seed: int, prompt_lens, response_lens, width: int, device="cpu") -> None:
    """INV-SLICE-003: the slice reads exactly the positions scoring response tokens and pads with exact zeros (NaN
    elsewhere never leaks), also with trailing dims."""
    for trailing in ((), (3,)):
        nested, want = poisoned_per_token(seed, prompt_lens, response_lens, width, device, trailing)
        got = np2p(nested, batch)
        if tuple(got.shape) != tuple(want.shape):
            fail(f"no_padding_2_padding shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if not bool(torch.isfinite(got).all()):
            fail(f"no_padding_2_padding read a non-response position (NaN leaked): {got.tolist()}")
        if not torch.equal(got.cpu(), want):
            fail(f"no_padding_2_padding gave {got.tolist()}, expected {want.tolist()}")


def response_from_nested_rows(from_nested, response_mask, seed: int, prompt_lens, response_lens, width: int,
                              device="cpu") -> None:
    """INV-SLICE-004: ``response_from_nested`` gives each sample's response values, without padding."""
    nested, want = poisoned_per_token(seed, prompt_lens, response_lens, width, device)
    rows = [t.cpu() for t in from_nested(nested, response_mask).unbind()]
    if len(rows) != len(response_lens):
        fail(f"response_from_nested gave {len(rows)} rows, expected {len(response_lens)}")
    for i, r in enumerate(response_lens):
        if rows[i].shape != (r,) or not torch.equal(rows[i], want[i, :r]):
            fail(f"response_from_nested row {i} is {rows[i].tolist()}, expected {want[i, :r].tolist()}")


def response_round_trip(np2p, to_nested, from_nested, batch, response_mask, seed: int, prompt_lens, response_lens,
                        width: int, device="cpu") -> None:
    """INV-SLICE-005: ``response_to_nested(no_padding_2_padding(x)) == response_from_nested(x)``."""
    nested, _ = poisoned_per_token(seed, prompt_lens, response_lens, width, device)
    back = to_nested(np2p(nested, batch), response_mask)
    direct = from_nested(nested, response_mask)
    if not (isinstance(back, torch.Tensor) and back.is_nested
            and torch.equal(back.offsets().cpu(), response_mask.offsets().cpu())):
        fail(f"response_to_nested returned shape {tuple(getattr(back, 'shape', ()))}, expected nested over the "
             f"responses {list(response_lens)}")
    close(back.values(), direct.values(), "response_to_nested(no_padding_2_padding(x)) vs response_from_nested(x)",
          atol=0, rtol=0)


SLICE_DTYPES = (torch.bool, torch.int64, torch.int32, torch.float32, torch.bfloat16)


def slice_dtypes(np2p, to_nested, from_nested, batch, response_mask, seed: int, prompt_lens, response_lens,
                 width: int, device="cpu") -> None:
    """INV-DTYPE-001: the slice helpers are exact for bool, int and float per-token tensors, trailing dims too:
    ``no_padding_2_padding`` pads with 0/False, ``response_to_nested`` inverts it."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + r for p, r in zip(prompt_lens, response_lens)]
    starts = offsets(seq_lens)
    for dtype in SLICE_DTYPES:
        for trailing in ((), (3,)):
            base = torch.randint(0, 4, (sum(seq_lens), *trailing), generator=gen)
            values = (base > 1) if dtype == torch.bool else base.to(dtype)
            want = torch.zeros(len(seq_lens), width, *trailing, dtype=dtype)
            for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
                want[i, :r] = values[starts[i] + p - 1: starts[i] + p - 1 + r]
            nested = torch.nested.nested_tensor_from_jagged(values.to(device), starts.to(device))
            got = np2p(nested, batch)
            if got.dtype != dtype or tuple(got.shape) != tuple(want.shape) or not torch.equal(got.cpu(), want):
                fail(f"no_padding_2_padding of a {dtype} tensor {tuple(values.shape)} gave {got.dtype} "
                     f"{got.tolist()}, expected {want.tolist()}")
            back = to_nested(got, response_mask)
            direct = from_nested(nested, response_mask)
            for name, value in (("response_to_nested", back), ("response_from_nested", direct)):
                rows = [t.cpu() for t in value.unbind()]
                for i, r in enumerate(response_lens):
                    if rows[i].dtype != dtype or tuple(rows[i].shape) != (r, *trailing) \
                            or not torch.equal(rows[i], want[i, :r]):
                        fail(f"{name} of a {dtype} tensor {tuple(values.shape)}: row {i} is {rows[i].tolist()}, "
                             f"expected {want[i, :r].tolist()}")


def consumer_response_view(log_probs, batch, views, want, tol, response_lens, total_nnz: int, prompt_lens=None) -> None:
    """INV-SLICE-006: each framework's consumer view (``views``: (name, view function) pairs, spec.protocol's
    response_view, completion_view, action_view) of the log-probs is ``want``'s ``(B, R)`` response log-probs within
    ``tol``, its mask the real columns. A failure carries its facts (``key``; a value's ``sequence`` and, given
    ``prompt_lens``, its ``position``: column j of row i scores token p_i + j), for records that match on them."""
    if not log_probs.is_nested and (log_probs.dim() < 1 or log_probs.shape[0] != total_nnz):
        fail(f"response_view: 'log_probs' of shape {tuple(log_probs.shape)} is neither nested over the sequences nor "
             f"a packed ({total_nnz},) row: no view of it is the consumer's")
    lens = torch.tensor(list(response_lens))
    for name, view in views:
        got, mask = view(log_probs, batch)
        if tuple(got.shape) != tuple(want.shape) or not torch.equal(mask.cpu(), torch.arange(want.shape[1]) < lens[:, None]):
            fail(f"{name}: shape {tuple(got.shape)} with mask {mask.tolist()}, expected {tuple(want.shape)} with "
                 f"{list(response_lens)} real columns", key="log_probs")
        for i in range(want.shape[0]):  # per sequence, as every value mismatch is worded
            try:
                close(got[i], want[i], f"'log_probs' of sequence {i} in {name} (row {i} of (B, R))", atol=tol[i])
            except AssertionError as exc:
                index = getattr(exc, "facts", {}).get("index")
                add_facts(exc, key="log_probs", sequence=i, **(
                    {"position": prompt_lens[i] - 1 + index[0]} if index and prompt_lens is not None else {}))
                raise
