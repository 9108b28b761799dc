"""OpenRLHF 0.11.2's configuration the ``openrlhf`` adapter draws (``EngineUnderTest.config_space``), as its trainers
call ``Actor.forward``:

* ``action_mask``: the PPO experience maker's and actor's call, ``forward(sequences, action_mask=...)``: the mask over
  the shifted row (``action_mask[1:]`` of each sample's action span, right-padded by ``make_experience_batch``), and
  the response-only log-probs ``log_probs[:, -A:] * action_mask`` (:func:`action_mask`); the outputs then cover the
  positions that score a response token (``OutputSpan.RESPONSE``);
* ``stack``: how the batch's rows are merged, ``zero_pad_sequences(..., stack=True)`` of 1-D samples
  (``make_experience_batch``) or ``stack=False`` of ``(1, n)`` rows concatenated along the batch
  (``Experience._merge_item``);
* ``return_logprobs``: ``forward(..., return_output=True)`` with ``return_logprobs=True`` (the SFT and DPO trainers'
  call) or without it, as the PPO actor calls it: with an ``action_mask`` forward still returns the action log-probs;
  without one it takes the logits-only return, and its caller reads ``output["logits"]`` (temperature-scaled,
  float32) and scores them at its rows rolled left by one with OpenRLHF's ``log_probs_from_logits`` (:func:`scored`);
* ``video_token_id``: whether the vision-language model's config (``Actor._vlm_config``) names a video token id, as
  Qwen-VL's does, or names none, as an images-only model's (Gemma 3's) does; drawn only where the micro-batch carries
  no video (such a model is never handed one), it leaves the padded path's token types without the video mark;
* ``allgather_logits``: the logits-only return asked to re-pad packed logits itself (``gather_and_pad_tensor``, as
  for its log-probs); without it the caller gets the packed ``(1, n, V)`` logits and places them at its mask's
  positions. Re-padded so, packed logits come back ``(B, L, 1, V)`` (pad_input keeps the packed row's batch axis,
  ``squeeze(-1)`` drops nothing): the caller refuses them (:data:`GATHERED_LOGITS`, a known failure).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from ...protocol.engine import ConfigSwitch, OutputSpan
from ...protocol.known import When
from ...protocol.profile import drawn_config

__all__ = ["SWITCHES", "GATHERED", "GATHERED_LOGITS", "action_mask", "merged_rows", "forward_kwargs", "scored"]

SWITCHES: tuple[ConfigSwitch, ...] = (
    ConfigSwitch("action_mask", (False, True), "forward(..., action_mask=...): the PPO experience's mask over the "
                 "shifted row, response-only log-probs", output_span=OutputSpan.RESPONSE),
    ConfigSwitch("stack", (True, False), "zero_pad_sequences(stack=False): (1, n) rows concatenated along the batch, "
                 "as Experience._merge_item merges them"),
    ConfigSwitch("return_logprobs", (True, False), "forward(..., return_output=True) without return_logprobs, as the "
                 "PPO actor calls it: the action log-probs with an action_mask, else the logits-only return, its "
                 "logits scored by the caller with log_probs_from_logits"),
    ConfigSwitch("allgather_logits", (False, True), "forward(..., allgather_logits=True): the logits-only return "
                 "re-pads packed logits with gather_and_pad_tensor"),
    ConfigSwitch("video_token_id", (True, False), "the VLM config names a video token id (Qwen-VL's) or none (an "
                 "images-only VLM's, Gemma 3's): the padded path then marks no video tokens; a micro-batch with videos "
                 "keeps the id (an images-only model is never handed videos)"),
)


def _logits_only(config: dict) -> bool:
    return config.get("return_logprobs") is False and not config.get("action_mask")


#: the logits-only return asked to re-pad packed logits (its packed run: the padded one has none to re-pad)
GATHERED = When("the logits-only return (return_logprobs off, no action_mask) with allgather_logits",
                lambda case: _logits_only(drawn_config(case)) and drawn_config(case).get("allgather_logits", False))
#: where the caller of the logits-only return gets packed logits re-padded by OpenRLHF (``(B, L, 1, V)``)
GATHERED_LOGITS = When("packed", lambda case: case.use_remove_padding) & GATHERED


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
    """What the output step's ``Actor.forward`` is handed beyond the rows: ``return_logprobs`` and
    ``allgather_logits`` as drawn, and the ``action_mask`` of the micro-batch's samples over ``rows`` where that
    switch is on (:func:`action_mask`)."""
    kwargs = {"return_logprobs": config.get("return_logprobs", True),
              "allgather_logits": config.get("allgather_logits", False)}
    if config.get("action_mask"):
        lens = mb["input_ids"].offsets().diff()
        kwargs["action_mask"] = action_mask(lens - mb["responses"].offsets().diff(), lens, rows.shape[1])
    return kwargs


def scored(result: Any, config: dict, actor_class: type, a: dict) -> tuple[torch.Tensor, Any]:
    """``(log_probs, output)`` of ``Actor.forward``'s ``result`` on the output step's arguments ``a`` (its
    ``sequences`` and ``attention_mask``): as it returns them, or from the logits-only return (:func:`forward_kwargs`
    of ``config``), as its caller scores them: the logits, packed ones placed at the mask's positions, at the rows
    rolled left by one, by ``log_probs_from_logits`` (of the actor's module), the last column dropped."""
    if not _logits_only(config):
        return result
    rows, mask, logits = a["sequences"], a["attention_mask"].bool(), result["logits"]
    if a["packed"] and not config.get("allgather_logits"):  # (1, n, V): the mask's positions, in order
        logits = logits.new_zeros(*rows.shape, logits.shape[-1]).index_put_((mask,), logits[0])
    if logits.shape != (*rows.shape, logits.shape[-1]):
        raise ValueError(f"output['logits'] of the logits-only return: shape {tuple(logits.shape)}, expected "
                         f"(B, L, V) = {(*rows.shape, logits.shape[-1])}")
    score = sys.modules[actor_class.__module__].log_probs_from_logits
    return score(logits, torch.roll(rows, shifts=-1, dims=1))[:, :-1], result
