"""Invariants on left_right_2_no_padding: a dense trainer batch to the nested form."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..cases.materialize import materialize_dense
from .core import Ctx, fail, invariant

L2N = ("left_right_2_no_padding",)


def _convert(ctx: Ctx, **force):
    """Materialize the case (with ``force``d fields: the pinned seed examples skip the strategy's
    preconditions) and convert it; returns the input, a snapshot of it, and the output."""
    case = replace(ctx.case, **{k: v for k, v in force.items() if not getattr(ctx.case, k)})
    dense = materialize_dense(case, ctx.device)
    before = {k: dense.get(k).clone() for k in dense.keys()}
    out = ctx.helper("left_right_2_no_padding")(dense)
    return dense, before, out



def _nested_rows(value: torch.Tensor) -> list[torch.Tensor]:
    return [t.cpu() for t in value.unbind()]


@invariant("INV-DENSE-001", "left_right_2_no_padding: nested input_ids hold exactly the unmasked tokens",
           contract=10,
           protects="the nested batch holds exactly each sample's real tokens (real tokens equal to the pad id kept)", kind="dense", modes=("any",), needs=L2N)
def dense_ids(ctx: Ctx) -> None:
    _, before, out = _convert(ctx)
    ids = out["input_ids"]
    if not ids.is_nested:
        fail(f"input_ids is not nested: shape {tuple(ids.shape)}")
    want = [row[m.bool()].cpu() for row, m in zip(before["input_ids"], before["attention_mask"])]
    got = _nested_rows(ids)
    if len(got) != len(want) or any(not torch.equal(g, w) for g, w in zip(got, want)):
        fail(f"nested input_ids {[g.tolist() for g in got]}, expected {[w.tolist() for w in want]}")


@invariant("INV-DENSE-002", "left_right_2_no_padding: position_ids nested (B, j) or (B, 4, j) ragged on the "
           "last dim (also when all lengths are equal or B = 1), values kept", contract=10,
           protects="the nested positions are each sample's positions, mRoPE ragged on the last dim", kind="dense",
           modes=("any",), needs=L2N)
def dense_positions(ctx: Ctx) -> None:
    _, before, out = _convert(ctx)
    pos = out["position_ids"]
    mask = before["attention_mask"].bool()
    lens = mask.sum(1).tolist()
    if ctx.case.mrope:
        if pos.dim() != 3 or getattr(pos, "_ragged_idx", 1) != 2 or pos.shape[1] != 4:
            fail(f"mRoPE position_ids have shape {tuple(pos.shape)} ragged at dim "
                 f"{getattr(pos, '_ragged_idx', '?')}, expected (B, 4, j) ragged at dim 2 (lengths {lens})")
        want = [row[:, m].cpu() for row, m in zip(before["position_ids"], mask)]
    else:
        want = [row[m].cpu() for row, m in zip(before["position_ids"], mask)]
    got = _nested_rows(pos)
    if any(g.shape != w.shape or not torch.equal(g, w) for g, w in zip(got, want)):
        fail(f"position_ids {[g.tolist() for g in got]}, expected {[w.tolist() for w in want]}")


@invariant("INV-DENSE-003", "left_right_2_no_padding: loss_mask carries the response mask of each valid "
           "response token (holes included)", contract=10,
           protects="the loss mask keeps its holes, token for token", kind="dense", modes=("any",), needs=L2N)
def dense_loss_mask(ctx: Ctx) -> None:
    _, before, out = _convert(ctx)
    width = before["response_mask"].shape[1]
    valid = before["attention_mask"][:, -width:].bool()
    want = [row[m].cpu() for row, m in zip(before["response_mask"], valid)]
    loss = out["loss_mask"]
    got = _nested_rows(loss) if loss.is_nested else [row[m].cpu() for row, m in zip(loss, valid)]
    if any(g.shape != w.shape or not torch.equal(g.to(w.dtype), w) for g, w in zip(got, want)):
        fail(f"loss_mask {[g.tolist() for g in got]}, expected {[w.tolist() for w in want]}")


@invariant("INV-DENSE-004", "left_right_2_no_padding: teacher top-K tensors become nested (B, j, K) over the "
           "same tokens", contract=10,
           protects="teacher top-K tensors stay aligned with the tokens they score", kind="dense", modes=("any",), needs=L2N, strategy_kwargs={"topk": True})
def dense_teacher(ctx: Ctx) -> None:
    _, before, out = _convert(ctx, topk=2)
    mask = before["attention_mask"].bool()
    for key in ("teacher_ids", "teacher_logprobs"):
        value = out[key]
        if not value.is_nested or value.dim() != 3:
            fail(f"{key} has shape {tuple(value.shape)}, expected nested (B, j, K)")
        want = [row[m].cpu() for row, m in zip(before[key], mask)]
        _first_row_difference(_nested_rows(value), want, key)


@invariant("INV-MUT-003", "left_right_2_no_padding leaves its input TensorDict intact", contract=10,
           protects="the trainer's dense batch is intact after left_right_2_no_padding",
           kind="dense", modes=("any",), needs=L2N)
def dense_not_mutated(ctx: Ctx) -> None:
    dense, before, _ = _convert(ctx)
    if set(dense.keys()) != set(before):
        fail(f"input keys changed: {sorted(before)} -> {sorted(dense.keys())}")
    for key, value in before.items():
        now = dense.get(key)
        if not isinstance(now, torch.Tensor) or now.is_nested or not torch.equal(now, value):
            fail(f"input {key!r} was replaced or modified")


@invariant("INV-DENSE-005", "left_right_2_no_padding then no_padding_2_padding: per-token outputs slice back "
           "to the trainer's (B, R) response columns, holes in the response mask included", contract=2,
           protects="per-token outputs slice back to the trainer's (B, R) response columns",
           kind="dense", modes=("any",), needs=L2N + ("no_padding_2_padding",))
def dense_round_trip(ctx: Ctx) -> None:
    dense, before, out = _convert(ctx)
    ids = out["input_ids"]
    # a per-token "output" whose value at k is the id of token k + 1: its response slice is the responses
    scored = torch.nested.nested_tensor_from_jagged(torch.roll(ids.values(), -1), ids.offsets())
    sliced = ctx.helper("no_padding_2_padding")(scored, out)
    width = before["response_mask"].shape[1]
    valid = before["attention_mask"][:, -width:].bool()
    want = before["input_ids"][:, -width:].masked_fill(~valid, 0)
    if tuple(sliced.shape) != tuple(want.shape) or not torch.equal(sliced.cpu().to(want.dtype), want.cpu()):
        fail(f"sliced responses {sliced.tolist()}, expected the dense responses {want.tolist()} "
             f"(response mask {before['response_mask'].tolist()})")


def _real_tokens(before: dict, columns: slice) -> list[torch.Tensor]:
    mask = before["attention_mask"][:, columns].bool()
    return [row[m].cpu() for row, m in zip(before["input_ids"][:, columns], mask)]


@invariant("INV-DENSE-006", "left_right_2_no_padding: prompts and responses are the input's, carried over "
           "unchanged (verl), or nested with each sample's own prompt and response tokens", contract=10,
           protects="prompts and responses still name each sample's own prompt and response tokens",
           kind="dense", modes=("any",), needs=L2N)
def dense_prompts_responses(ctx: Ctx) -> None:
    _, before, out = _convert(ctx)
    width = before["response_mask"].shape[1]
    for key, columns in (("prompts", slice(None, -width)), ("responses", slice(-width, None))):
        value = out.get(key) if key in out.keys() else None
        if not isinstance(value, torch.Tensor):
            fail(f"{key} is {type(value).__name__}, expected the input's {key} or a nested (B, j) tensor")
        if not value.is_nested:  # carried over as given (what verl does): must be the input's, unchanged
            if value.shape != before[key].shape or not torch.equal(value.cpu(), before[key].cpu()):
                fail(f"dense {key} {value.tolist()} differ from the input's {before[key].tolist()}")
            continue
        want = _real_tokens(before, columns)
        got = _nested_rows(value)
        if len(got) != len(want) or any(g.shape != w.shape or not torch.equal(g, w) for g, w in zip(got, want)):
            fail(f"nested {key} {[g.tolist() for g in got]}, expected {[w.tolist() for w in want]}")


@invariant("INV-DENSE-007", "left_right_2_no_padding: MoE routed_experts (router replay) become nested "
           "(B, j, ...) over the same tokens", contract=10,
           protects="MoE router-replay routed_experts stay aligned with the tokens they route", kind="dense", modes=("any",), needs=L2N,
           strategy_kwargs={"routed_experts": True})
def dense_routed_experts(ctx: Ctx) -> None:
    _, before, out = _convert(ctx, routed_experts=8)
    value = out.get("routed_experts") if "routed_experts" in out.keys() else None
    if not isinstance(value, torch.Tensor) or not value.is_nested:
        fail(f"routed_experts is {type(value).__name__} "
             f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}, expected nested (B, j, layers, k)")
    mask = before["attention_mask"].bool()
    want = [row[m].cpu() for row, m in zip(before["routed_experts"], mask)]
    _first_row_difference(_nested_rows(value), want, "routed_experts")


def _first_row_difference(got: list[torch.Tensor], want: list[torch.Tensor], key: str) -> None:
    """Fails at the first sample and token where ``got`` differs from the unmasked rows ``want``."""
    if len(got) != len(want):
        fail(f"{key}: {len(got)} samples, expected {len(want)}")
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            fail(f"{key} of sample {i}: shape {tuple(g.shape)}, expected {tuple(w.shape)} (its unmasked rows)")
        if not torch.equal(g, w):
            t = int((g != w).reshape(g.shape[0], -1).any(1).nonzero()[0])
            fail(f"{key} of sample {i}, token {t}: {g[t].tolist()}, expected the unmasked row's {w[t].tolist()}")
