"""Dense batches verl's helpers accept outside the trainer's left-right layout (issue 15).

Two classes, each a :class:`DropinCase` (structure only; tensors from ``seed``):

* ``right_padded``: whole sequences right-padded from column 0 (prompt and response
  contiguous, no left padding), ``S`` columns of which the last ``R`` are "response
  columns"; the batch carries the true split as nested ``prompts``/``responses`` (what verl's
  own round-trip test does). Rows whose whole sequence fits in the first ``S - R`` columns
  are drawn on purpose.
* ``stray_marks``: the trainer's left-right layout, but ``response_mask`` also marks some
  columns past each row's response (columns ``attention_mask`` marks as padding).

Shrinks towards one row, length-one prompt and response, no slack columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

from .structure import EngineCase
from .strategies import seq_lengths

__all__ = ["DropinCase", "dropin_cases", "materialize_dropin", "from_engine_case", "LAYOUTS"]

LAYOUTS = ("right_padded", "stray_marks")


@dataclass(frozen=True)
class DropinCase:
    prompt_lens: tuple[int, ...]
    response_lens: tuple[int, ...]
    seq_width: int  # S
    response_width: int  # R (<= S)
    layout: str = "right_padded"
    holes: bool = False  # zeros inside the response mask
    seed: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.prompt_lens)

    @property
    def prompt_width(self) -> int:
        return self.seq_width - self.response_width

    def __repr__(self) -> str:
        return (f"DropinCase({self.layout} p={list(self.prompt_lens)} r={list(self.response_lens)} "
                f"S={self.seq_width} R={self.response_width}{' holes' if self.holes else ''} seed={self.seed})")


@st.composite
def dropin_cases(draw, *, layout: str, max_batch: int = 4, max_len: int = 6) -> DropinCase:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    batch = draw(st.integers(1, max_batch))
    prompts = draw(seq_lengths(batch, max_len=max_len))
    responses = draw(seq_lengths(batch, max_len=max_len))
    longest = max(p + r for p, r in zip(prompts, responses))
    if layout == "right_padded":
        width = max(responses) + draw(st.integers(0, 2))
        seq = max(longest + draw(st.integers(0, 3)), width)
    else:  # at least one padding column after every response, so marks can stray there
        width = max(responses) + 1 + draw(st.integers(0, 2))
        seq = max(prompts) + draw(st.integers(0, 2)) + width
    return DropinCase(prompts, responses, seq, width, layout, draw(st.booleans()), draw(st.integers(0, 2**16)))


def from_engine_case(case: EngineCase, layout: str) -> DropinCase:
    """A seed worked example (an EngineCase) as a DropinCase of ``layout``."""
    width = max(case.response_lens) + (1 if layout == "stray_marks" else 0)
    seq = max(case.seq_lens) if layout == "right_padded" else max(case.prompt_lens) + width
    return DropinCase(case.prompt_lens, case.response_lens, max(seq, width), width, layout, False, case.seed)


def materialize_dropin(case: DropinCase, device: torch.device | str = "cpu") -> TensorDict:
    """``input_ids``, ``attention_mask``, ``response_mask``, ``position_ids`` ``(B, S)``; right-padded
    cases add nested ``prompts``/``responses``, stray-marks cases dense ones (as a trainer has them)."""
    gen = torch.Generator().manual_seed(case.seed)
    batch, seq, width = case.batch_size, case.seq_width, case.response_width
    cols = torch.arange(seq).unsqueeze(0)
    p, r = torch.tensor(case.prompt_lens).unsqueeze(1), torch.tensor(case.response_lens).unsqueeze(1)
    if case.layout == "right_padded":
        attn = (cols < p + r).to(torch.int64)
    else:
        attn = ((cols >= case.prompt_width - p) & (cols < case.prompt_width + r)).to(torch.int64)
    ids = torch.randint(1, 50, (batch, seq), generator=gen) * attn
    resp_cols = torch.arange(width).unsqueeze(0)
    response_mask = (resp_cols < r).to(torch.int64)
    if case.holes:
        response_mask = response_mask * (torch.rand(batch, width, generator=gen) > 0.3)
    data = {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(1) - 1).clamp(min=0) * attn}
    if case.layout == "stray_marks":
        stray = (resp_cols >= r) & (torch.rand(batch, width, generator=gen) < 0.5)
        stray[0, case.response_lens[0]] = True  # at least one mark on a padding column
        response_mask = response_mask | stray.to(torch.int64)
        data["prompts"], data["responses"] = ids[:, :case.prompt_width].clone(), ids[:, case.prompt_width:].clone()
    else:
        valid = attn.bool()
        flat = ids[valid]
        offsets = torch.nn.functional.pad((p + r).squeeze(1).cumsum(0), (1, 0))
        seq_of = torch.repeat_interleave(torch.arange(batch), (p + r).squeeze(1))
        in_prompt = (torch.arange(flat.numel()) - offsets[:-1][seq_of]) < p.squeeze(1)[seq_of]
        data["prompts"] = torch.nested.nested_tensor_from_jagged(
            flat[in_prompt], torch.nn.functional.pad(p.squeeze(1).cumsum(0), (1, 0)))
        data["responses"] = torch.nested.nested_tensor_from_jagged(
            flat[~in_prompt], torch.nn.functional.pad(r.squeeze(1).cumsum(0), (1, 0)))
    data["response_mask"] = response_mask
    out = TensorDict({}, batch_size=[batch])
    for key, value in data.items():
        if value.is_nested:
            out.set(key, torch.nested.nested_tensor_from_jagged(value.values().to(device), value.offsets().to(device)))
        else:
            out.set(key, value.to(device))
    return out
