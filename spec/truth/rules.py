"""One home for each structural rule the suite checks against, shared by materialize, oracle and invariants.

Nothing here imports an engine or a case type: these are the contract's definitions, written once (a case is
read by its fields: ``EngineCase`` in :mod:`spec.cases.structure` sits above this layer).
"""

from __future__ import annotations

import torch

from ..protocol.engine import OutputSpan, PaddedLayout

#: The contract clamps temperature below at this value before dividing.
TEMPERATURE_FLOOR = 1e-8

__all__ = ["TEMPERATURE_FLOOR", "offsets", "full_length_mask", "response_positions", "response_index", "distinct_temperatures",
           "padded_length", "read_positions", "layout_columns", "layout_mask", "layout_width", "shared_temperature"]


def offsets(lens, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[0, n_0, n_0 + n_1, ...]`` as int64 (int32 arithmetic on lengths overflows: verl PR #5110)."""
    return torch.tensor((0, *[int(n) for n in lens]), dtype=torch.int64, device=device).cumsum(0)


def full_length_mask(lens, width: int | None = None, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The padded attention mask of the contract: row i has exactly ``n_i`` leading ones (full
    sequence lengths, never the response-only loss mask), ``(B, width or max n_i)``."""
    lens = torch.as_tensor([int(n) for n in lens], dtype=torch.int64)
    width = int(lens.max()) if width is None else width
    return (torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)).to(dtype)


def response_positions(prompt_lens, response_lens) -> list[tuple[int, int]]:
    """Per sample, the packed-row range ``[e_i - r_i - 1, e_i - 1)`` whose outputs score the response
    tokens (the model's output at k scores token k + 1, so the response is read one to the left)."""
    ends = offsets([p + r for p, r in zip(prompt_lens, response_lens)])[1:].tolist()
    return [(e - r - 1, e - 1) for e, r in zip(ends, response_lens)]


def response_index(prompt_lens, response_lens) -> torch.Tensor:
    """The packed-row positions of :func:`response_positions`, concatenated (int64)."""
    parts = [torch.arange(a, b) for a, b in response_positions(prompt_lens, response_lens)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def distinct_temperatures(case: "EngineCase") -> "EngineCase":
    """``case`` with per-sample temperatures that all differ (so a row mix-up or a temperature read from
    the wrong sample shows); fused kernels keep their one float (the contract makes a tensor an error).
    The values stay inside the drawn temperature's decade so low/high temperatures keep being tested."""
    if case.use_fused_kernels:
        return case
    base = case.temperatures()[0]
    base = 0.5 if base == 1.0 or base <= 1e-8 else base  # at/below the clamp all values would clamp alike
    return case.with_(temperature=tuple(base * (1.0 + 0.25 * i) for i in range(case.batch_size)))


def token_temperatures(case: "EngineCase") -> torch.Tensor:
    """``(total_nnz,)`` float32: each sample's temperature repeated over its tokens (what the packed
    hand-off carries, before any tail padding)."""
    return torch.repeat_interleave(torch.tensor(case.temperatures(), dtype=torch.float32),
                                   torch.tensor(case.seq_lens))


def padded_length(total: int, bucket: int | None, sp_size: int) -> int:
    """The packed row's length after the static bucket (rounded up) and then the sequence-parallel pad."""
    padded = total if not bucket else -(-total // bucket) * bucket
    return -(-padded // sp_size) * sp_size


def read_positions(prompt_lens, response_lens, span: "OutputSpan | str" = OutputSpan.SEQUENCE) -> list[torch.Tensor]:
    """Per sequence, the positions (within it) of a per-token output that the contract checks: what a consumer
    can read. The last token of each sequence scores no token of it (its label is the next sequence's first
    token, a wrap, or whatever an engine puts there) and no consumer reads any output there, for every per-token
    output (log-probs, entropy, sum_pi_squared, distillation terms, values): ``0 .. n_i - 2``. An engine whose
    outputs cover only the scored response tokens (:attr:`OutputSpan.RESPONSE`) is checked on ``p_i - 1 .. n_i - 2``."""
    if OutputSpan(span) is OutputSpan.RESPONSE:
        return [torch.arange(p - 1, p + r - 1) for p, r in zip(prompt_lens, response_lens)]
    return [torch.arange(p + r - 1) for p, r in zip(prompt_lens, response_lens)]


def layout_width(prompt_lens, response_lens, layout: "PaddedLayout | str" = PaddedLayout.RIGHT) -> int:
    """The padded model input's width ``L`` in ``layout``: ``max n_i`` (right) or ``max p_i + max r_i`` (left-right)."""
    if PaddedLayout(layout) is PaddedLayout.LEFT_RIGHT:
        return max(prompt_lens) + max(response_lens)
    return max(p + r for p, r in zip(prompt_lens, response_lens))


def layout_columns(prompt_lens, response_lens, layout: "PaddedLayout | str" = PaddedLayout.RIGHT) -> list[torch.Tensor]:
    """Per sample, the columns of the padded ``(B, L)`` model input that hold its tokens, in order (what the
    layout means): ``0 .. n_i - 1`` (right) or ``P - p_i .. P + r_i - 1`` with ``P = max p_i`` (left-right)."""
    if PaddedLayout(layout) is PaddedLayout.LEFT_RIGHT:
        width = max(prompt_lens)
        return [torch.arange(width - p, width + r) for p, r in zip(prompt_lens, response_lens)]
    if PaddedLayout(layout) is PaddedLayout.LEFT:  # every row right-aligned: the last n_i of L = max n_i columns
        width = max(p + r for p, r in zip(prompt_lens, response_lens))
        return [torch.arange(width - p - r, width) for p, r in zip(prompt_lens, response_lens)]
    return [torch.arange(p + r) for p, r in zip(prompt_lens, response_lens)]


def layout_mask(prompt_lens, response_lens, layout: "PaddedLayout | str" = PaddedLayout.RIGHT,
                width: int | None = None, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """The padded attention mask the layout means: 1 exactly at each sample's real tokens (its full sequence,
    never the response-only loss mask), ``(B, width or the layout's width)``."""
    width = layout_width(prompt_lens, response_lens, layout) if width is None else width
    prompts = torch.as_tensor([int(p) for p in prompt_lens], dtype=torch.int64).unsqueeze(1)
    responses = torch.as_tensor([int(r) for r in response_lens], dtype=torch.int64).unsqueeze(1)
    cols = torch.arange(width).unsqueeze(0)
    if PaddedLayout(layout) is PaddedLayout.LEFT_RIGHT:
        start = int(prompts.max()) - prompts
        return ((cols >= start) & (cols < start + prompts + responses)).to(dtype)
    if PaddedLayout(layout) is PaddedLayout.LEFT:
        return (cols >= width - prompts - responses).to(dtype)
    return (cols < prompts + responses).to(dtype)


def shared_temperature(case: "EngineCase") -> "EngineCase":
    """``case`` with one temperature for every sample (an engine with one temperature per trainer): a per-sample
    tuple becomes its first value (distinct per-sample values from :func:`distinct_temperatures` keep a non-1 one)."""
    if isinstance(case.temperature, tuple):
        return case.with_(temperature=float(case.temperature[0]))
    return case
