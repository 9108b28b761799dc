"""OpenRLHF 0.11.2's configuration the ``openrlhf`` adapter draws (``EngineUnderTest.config_space``), as its trainers
call ``Actor.forward``:

* ``action_mask``: the PPO experience maker's and actor's call, ``forward(sequences, action_mask=...)``: the mask over
  the shifted row (``action_mask[1:]`` of each sample's action span, right-padded by ``make_experience_batch``), and
  the response-only log-probs ``log_probs[:, -A:] * action_mask`` (:func:`action_mask`); the outputs then cover the
  positions that score a response token (``OutputSpan.RESPONSE``);
* ``stack``: how the batch's rows are merged, ``zero_pad_sequences(..., stack=True)`` of 1-D samples
  (``make_experience_batch``) or ``stack=False`` of ``(1, n)`` rows concatenated along the batch
  (``Experience._merge_item``).
"""

from __future__ import annotations

from typing import Any

import torch

from ...protocol.engine import ConfigSwitch, OutputSpan

__all__ = ["SWITCHES", "action_mask", "merged_rows", "forward_kwargs"]

SWITCHES: tuple[ConfigSwitch, ...] = (
    ConfigSwitch("action_mask", (False, True), "forward(..., action_mask=...): the PPO experience's mask over the "
                 "shifted row, response-only log-probs", output_span=OutputSpan.RESPONSE),
    ConfigSwitch("stack", (True, False), "zero_pad_sequences(stack=False): (1, n) rows concatenated along the batch, "
                 "as Experience._merge_item merges them"),
)


def action_mask(prompt_lens: torch.Tensor, lens: torch.Tensor, width: int) -> torch.Tensor:
    """OpenRLHF's ``action_mask`` of right-padded rows ``width`` wide: sample i's action span is its response tokens
    ``p_i .. n_i - 1``, shifted by one (``action_mask[1:]``: the positions ``p_i - 1 .. n_i - 2`` that score them),
    ``(B, width - 1)``."""
    columns = torch.arange(width - 1, device=lens.device)
    return (columns >= prompt_lens.unsqueeze(1) - 1) & (columns < lens.unsqueeze(1) - 1)


def merged_rows(pad: Any, rows: list[torch.Tensor], stack: bool, **kwargs: Any) -> torch.Tensor:
    """The samples' 1-D ``rows`` merged by OpenRLHF's ``zero_pad_sequences`` (``pad``): stacked, or as ``(1, n)`` rows
    concatenated along the batch (``stack=False``)."""
    return pad(rows, stack=True, **kwargs) if stack else pad([row.unsqueeze(0) for row in rows], stack=False, **kwargs)


def forward_kwargs(mb: Any, rows: torch.Tensor, config: dict) -> dict[str, Any]:
    """What the output step's ``Actor.forward`` is handed beyond the rows: the ``action_mask`` of the micro-batch's
    samples over ``rows`` where the switch is on (:func:`action_mask`), else nothing."""
    if not config.get("action_mask"):
        return {}
    lens = mb["input_ids"].offsets().diff()
    return {"action_mask": action_mask(lens - mb["responses"].offsets().diff(), lens, rows.shape[1])}
