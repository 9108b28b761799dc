"""Tensors from a case's structure: a seeded ``torch.Generator``, nothing else."""

from __future__ import annotations

from enum import Enum

import torch
from tensordict import TensorDict

from .structure import DenseCase, EngineCase
from ..truth.rules import offsets as _offsets

__all__ = ["jagged", "materialize", "materialize_dense", "select_rows", "move", "PadMode", "MROPE_AXES"]

MROPE_AXES = 4


class PadMode(str, Enum):
    """A stand-in for verl's ``DatasetPadMode``: a ``str`` Enum, as verl passes it."""

    RIGHT = "right"
    LEFT_RIGHT = "left_right"
    NO_PADDING = "no_padding"


def jagged(values: torch.Tensor, lens: tuple[int, ...], *, jagged_dim: int = 1) -> torch.Tensor:
    """A nested jagged tensor over ``values`` split by ``lens`` (checked here, not at unbind)."""
    axis = jagged_dim - 1
    if values.shape[axis] != sum(lens):
        raise ValueError(f"values have {values.shape[axis]} tokens along dim {axis}, lengths sum to {sum(lens)}")
    return torch.nested.nested_tensor_from_jagged(values, _offsets(lens, values.device), jagged_dim=jagged_dim)


def _positions(lens: tuple[int, ...], device) -> torch.Tensor:
    """``0..n_i-1`` per sequence, without a loop over the batch."""
    lens_t = torch.tensor(lens, dtype=torch.int64)
    starts = torch.repeat_interleave(_offsets(lens)[:-1], lens_t)
    return (torch.arange(int(lens_t.sum())) - starts).to(device)


def mrope_positions(positions: torch.Tensor) -> torch.Tensor:
    """``(4, n)`` multi-axis positions from ``(n,)``: axis a is ``pos + a`` (axis 0 restarts at 0)."""
    return positions.unsqueeze(0) + torch.arange(MROPE_AXES, device=positions.device).unsqueeze(1)


def _as_split_view(tensor: torch.Tensor) -> torch.Tensor:
    """The same nested tensor over a view into a buffer that holds other tokens before it, as
    ``TensorDict.split`` / slicing of a trainer's mini-batch hands a micro-batch: the values start at a storage
    offset (and, ragged on a later dim, are not contiguous); the offsets still start at 0."""
    ragged = getattr(tensor, "_ragged_idx", 1)
    values, axis = tensor.values(), ragged - 1
    buffer = torch.cat([values.flip(axis), values], dim=axis)  # the tokens before it: real-looking, all wrong
    view = buffer.narrow(axis, values.shape[axis], values.shape[axis])
    return torch.nested.nested_tensor_from_jagged(view, tensor.offsets(), jagged_dim=ragged)


def materialize(case: EngineCase, device: torch.device | str = "cpu") -> TensorDict:
    """The micro-batch of ``case``: nested tensors, temperature and flags.

    When ``case.split_view``, every nested tensor's values are a view into a bigger buffer
    (see :func:`_as_split_view`); the values themselves are the same."""
    gen = torch.Generator().manual_seed(case.seed)
    lens = case.seq_lens
    ids = torch.randint(0, case.vocab, (case.total_nnz,), generator=gen)
    if case.eos_token_id is not None:  # every response ends with eos (which may be the pad id)
        ids[_offsets(lens)[1:] - 1] = case.eos_token_id
    seq_of = torch.repeat_interleave(torch.arange(case.batch_size), torch.tensor(lens))
    pos = _positions(lens, "cpu")
    is_prompt = pos < torch.tensor(case.prompt_lens)[seq_of]
    # holes inside responses (tool tokens of a multi-turn rollout)
    loss_mask = (torch.rand(int((~is_prompt).sum()), generator=gen) >= case.mask_hole_rate).to(torch.int64)
    data = {
        "input_ids": jagged(ids, lens),
        "position_ids": jagged(mrope_positions(pos), lens, jagged_dim=2) if case.mrope else jagged(pos, lens),
        "prompts": jagged(ids[is_prompt], case.prompt_lens),
        "responses": jagged(ids[~is_prompt], case.response_lens),
        "loss_mask": jagged(loss_mask, case.response_lens),
        "response_mask": jagged(loss_mask.clone(), case.response_lens),
    }
    if case.per_sample_temperature:
        data["temperature"] = torch.tensor(case.temperatures(), dtype=torch.float32)
    if case.distillation_use_topk:
        teacher_ids = torch.randint(0, case.vocab, (case.total_nnz, case.topk), generator=gen)
        teacher_lp = torch.log_softmax(torch.randn(case.total_nnz, case.topk, generator=gen), dim=-1)
        data["teacher_ids"] = jagged(teacher_ids, lens)
        data["teacher_logprobs"] = jagged(teacher_lp, lens)
    if case.split_view:
        data = {key: _as_split_view(value) if value.is_nested else value for key, value in data.items()}
    td = TensorDict(data, batch_size=[case.batch_size], device=None)
    if not case.per_sample_temperature:
        td.set_non_tensor("temperature", float(case.temperature))
    flags = {
        "use_remove_padding": case.use_remove_padding,
        "pad_mode": PadMode.NO_PADDING,
        "use_fused_kernels": case.use_fused_kernels,
        "pad_token_id": case.pad_token_id,
        "calculate_entropy": case.calculate_entropy,
        "calculate_sum_pi_squared": case.calculate_sum_pi_squared,
        "distillation_use_topk": case.distillation_use_topk,
        "distillation_only": case.distillation_only,
    }
    if case.max_response_len is not None:
        flags["max_response_len"] = case.max_response_len
    for key, value in flags.items():
        td.set_non_tensor(key, value)
    return td if torch.device(device).type == "cpu" else move(td, device)


def move(micro_batch: TensorDict, device: torch.device | str) -> TensorDict:
    """A copy of ``micro_batch`` on ``device``, nested tensors rebuilt with their ragged dim."""
    out = TensorDict({}, batch_size=micro_batch.batch_size)
    for key in micro_batch.keys():
        value = micro_batch.get(key)
        if isinstance(value, torch.Tensor):
            out.set(key, _nested_to(value, device) if value.is_nested else value.to(device))
        else:
            out.set_non_tensor(key, getattr(value, "data", value))
    return out


def _nested_to(tensor: torch.Tensor, device) -> torch.Tensor:
    ragged = getattr(tensor, "_ragged_idx", 1)
    return torch.nested.nested_tensor_from_jagged(tensor.values().to(device), tensor.offsets().to(device),
                                                  jagged_dim=ragged)


def materialize_dense(case: DenseCase, device: torch.device | str = "cpu") -> TensorDict:
    """A dense left-right padded batch: ``input_ids``, ``attention_mask``, ``response_mask``,
    ``position_ids`` (``(B, S)`` or ``(B, 4, S)``) and optional teacher ``(B, S, K)``."""
    gen = torch.Generator().manual_seed(case.seed)
    batch, pw, rw = case.batch_size, case.prompt_width, case.response_width
    seq = pw + rw
    cols = torch.arange(seq)
    plen = torch.tensor(case.prompt_lens).unsqueeze(1)
    rlen = torch.tensor(case.response_lens).unsqueeze(1)
    attn = ((cols >= pw - plen) & (cols < pw + rlen)).to(torch.int64)
    # real tokens over [0, V): some equal the pad id; eos (= pad) ends each response when asked
    input_ids = torch.randint(0, case.vocab, (batch, seq), generator=gen)
    if case.eos_is_pad:
        input_ids[torch.arange(batch), pw + rlen.squeeze(1) - 1] = case.pad_token_id
    input_ids = input_ids.masked_fill(attn == 0, case.pad_token_id)
    response_mask = attn[:, pw:].clone()
    if case.mask_holes:
        holes = torch.rand(batch, rw, generator=gen) < 0.3
        response_mask = response_mask * (~holes)
    # positions as a trainer computes them: cumsum of the mask, 0 on the padding
    pos = (attn.cumsum(1) - 1).clamp(min=0) * attn
    position_ids = (pos.unsqueeze(1) + torch.arange(MROPE_AXES).view(1, -1, 1) * attn.unsqueeze(1)
                    if case.mrope else pos)
    data = {"input_ids": input_ids, "attention_mask": attn, "response_mask": response_mask,
            "position_ids": position_ids,
            # as a trainer hands them over: dense, left-padded prompts and right-padded responses
            "prompts": input_ids[:, :pw].clone(), "responses": input_ids[:, pw:].clone()}
    if case.topk:
        data["teacher_ids"] = torch.randint(0, case.vocab, (batch, seq, case.topk), generator=gen)
        data["teacher_logprobs"] = torch.randn(batch, seq, case.topk, generator=gen)
    if case.routed_experts:  # MoE router replay: (B, S, layers, top-k) expert indices
        data["routed_experts"] = torch.randint(0, case.routed_experts, (batch, seq, 2, 2), generator=gen,
                                               dtype=torch.int64)
    return TensorDict({k: v.to(device) for k, v in data.items()}, batch_size=[batch])


def select_rows(micro_batch: TensorDict, rows: list[int]) -> TensorDict:
    """The samples ``rows`` of a micro-batch, in that order, flags kept.

    Done key by key (TensorDict indexing of jagged tensors needs tensordict >= 0.15.3).
    """
    out = TensorDict({}, batch_size=[len(rows)])
    for key in micro_batch.keys():
        value = micro_batch.get(key)
        if isinstance(value, torch.Tensor) and value.is_nested:
            parts = value.unbind()
            ragged = getattr(value, "_ragged_idx", 1)
            picked = [parts[i] for i in rows]
            lens = tuple(p.shape[ragged - 1] for p in picked)
            out.set(key, jagged(torch.cat(picked, dim=ragged - 1), lens, jagged_dim=ragged))
        elif isinstance(value, torch.Tensor):
            out.set(key, value[torch.tensor(rows, device=value.device)])
        else:
            out.set_non_tensor(key, getattr(value, "data", value))
    return out
