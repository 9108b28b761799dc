"""Tensors from a case's structure: a seeded ``torch.Generator``, nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

from .media import MEDIA_TOKEN_FLAGS, MULTI_MODAL_KEY, MediaDraws, draw_media, media_stack
from .structure import DenseCase, EngineCase
from ..truth.rules import offsets as _offsets
from ..truth.routes import ROUTES_KEY, rollout_routes
from ..truth.vision import media_token_ids
from ..protocol.profile import routes_dtype

__all__ = ["jagged", "draws", "Draws", "materialize", "materialize_dense", "select_rows", "move", "PadMode", "MROPE_AXES"]

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


def _split_view(values: torch.Tensor, axis: int) -> torch.Tensor:
    """``values`` as a view at a storage offset into a buffer that holds other tokens before it, as
    ``TensorDict.split`` / slicing of a trainer's mini-batch hands a micro-batch's values (ragged on a later
    dim, not contiguous)."""
    buffer = torch.cat([values.flip(axis), values], dim=axis)  # the tokens before it: real-looking, all wrong
    return buffer.narrow(axis, values.shape[axis], values.shape[axis])


@dataclass(frozen=True)
class Draws:
    """A case's seeded draws as flat token-major tensors (what the nested tensors of :func:`materialize` hold)."""

    ids: torch.Tensor  # (total_nnz,) int64, eos at each sequence's end when the case has one
    positions: torch.Tensor  # (total_nnz,) int64: 0..n_i-1 per sequence
    loss_mask: torch.Tensor  # (response tokens,) int64
    is_prompt: torch.Tensor  # (total_nnz,) bool
    teacher_ids: torch.Tensor | None = None  # (total_nnz, K) int64
    teacher_logprobs: torch.Tensor | None = None  # (total_nnz, K) float32
    #: a media case's features, grids and rope index (:mod:`spec.cases.media`)
    media: MediaDraws | None = None

    def position_ids(self, case: EngineCase) -> torch.Tensor:
        """``(total_nnz,)`` or mRoPE ``(4, total_nnz)``: with media, the text positions ``0..n_i-1`` on axis 0 and
        Qwen2-VL's rope index of the grids on axes 1-3 (verl's layout: ``cat(text_position_ids, vision_position_ids)``);
        an audio case's are 1-D."""
        if self.media is not None and case.mrope:
            return torch.cat([self.positions.unsqueeze(0), self.media.rope])
        return mrope_positions(self.positions) if case.mrope else self.positions

    def media_inputs(self) -> dict[str, torch.Tensor]:
        """What the model takes of the batch's media (features and grids concatenated in sample order), ``{}``
        without media."""
        return self.media.model_inputs() if self.media is not None else {}


def draws(case: EngineCase) -> Draws:
    """The tensors of ``case`` from its seed, in one fixed order (ids, loss-mask holes, teacher top-K)."""
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
    teacher_ids = teacher_lp = None
    if case.distillation_use_topk:
        teacher_ids = torch.randint(0, case.vocab, (case.total_nnz, case.topk), generator=gen)
        teacher_lp = torch.log_softmax(torch.randn(case.total_nnz, case.topk, generator=gen), dim=-1)
    media = None
    if case.media:  # drawn last: a text-only case's tensors are what they were
        ids, media = draw_media(case, ids, gen)
    return Draws(ids, pos, loss_mask, is_prompt, teacher_ids, teacher_lp, media)


def materialize(case: EngineCase, device: torch.device | str = "cpu") -> TensorDict:
    """The micro-batch of ``case``: nested tensors, temperature and flags.

    When ``case.split_view``, every nested tensor's values are a view into a bigger buffer
    (see :func:`_split_view`); the values themselves are the same."""
    d = draws(case)
    lens = case.seq_lens
    view = _split_view if case.split_view else (lambda values, axis: values)
    ids, is_prompt, loss_mask = d.ids, d.is_prompt, d.loss_mask
    data = {
        "input_ids": jagged(view(ids, 0), lens),
        "position_ids": (jagged(view(d.position_ids(case), 1), lens, jagged_dim=2) if case.mrope
                         else jagged(view(d.positions, 0), lens)),
        "prompts": jagged(view(ids[is_prompt], 0), case.prompt_lens),
        "responses": jagged(view(ids[~is_prompt], 0), case.response_lens),
        "loss_mask": jagged(view(loss_mask, 0), case.response_lens),
        "response_mask": jagged(view(loss_mask.clone(), 0), case.response_lens),
    }
    if case.per_sample_temperature:
        data["temperature"] = torch.tensor(case.temperatures(), dtype=torch.float32)
    if d.teacher_ids is not None:
        data["teacher_ids"] = jagged(view(d.teacher_ids, 0), lens)
        data["teacher_logprobs"] = jagged(view(d.teacher_logprobs, 0), lens)
    if routes_dtype(case) is not None:  # an MoE rollout's routes (spec.truth.routes): captured rows, then zero rows
        place, n = _positions(lens, "cpu"), torch.repeat_interleave(torch.tensor(lens), torch.tensor(lens))
        routes = rollout_routes(ids, routes_dtype(case), place)
        data[ROUTES_KEY] = jagged(routes * (place < n.clamp(min=2) - 1).reshape(-1, 1, 1), lens)
    td = TensorDict(data, batch_size=[case.batch_size], device=None)
    if d.media is not None:
        td.set(MULTI_MODAL_KEY, media_stack(d.media, case))
        for key, token_id in zip(MEDIA_TOKEN_FLAGS, media_token_ids(case.vocab)):
            td.set_non_tensor(key, token_id)  # the model config's, beside the batch (docs/contract.md)
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
        elif isinstance(value, NonTensorStack):
            out.set(key, _stack_to(value, device))
        else:
            out.set_non_tensor(key, getattr(value, "data", value))
    return out


def _stack_to(stack: NonTensorStack, device) -> NonTensorStack:
    """A per-sample stack (``multi_modal_inputs``) with every tensor of its dicts on ``device``."""
    items = [{k: v.to(device) for k, v in item.items()} if isinstance(item, dict) else item for item in stack.tolist()]
    return NonTensorStack.from_list([NonTensorData(item) for item in items])


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
    if case.eos_is_pad:  # (an aborted rollout's empty response has none)
        ends = rlen.squeeze(1) > 0
        input_ids[torch.arange(batch)[ends], pw + rlen.squeeze(1)[ends] - 1] = case.pad_token_id
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
        data["routed_experts"] = torch.randint(0, case.routed_experts, (batch, seq, case.routed_layers,
                                                                        case.routed_topk), generator=gen,
                                               dtype=torch.int64).to(getattr(torch, case.routed_dtype))
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
        elif isinstance(value, NonTensorStack):  # per-sample entries (multi_modal_inputs) follow their samples
            items = value.tolist()
            out.set(key, NonTensorStack.from_list([NonTensorData(items[i]) for i in rows]))
        else:
            out.set_non_tensor(key, getattr(value, "data", value))
    return out
