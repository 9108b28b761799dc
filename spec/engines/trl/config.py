"""TRL 1.16's configuration switches the ``trl`` and ``trl-fused`` adapters draw (``EngineUnderTest.config_space``):
each changes the path TRL's own preparation takes, and each reaches the engine object as ``make(**{name: value})``.

* ``pad_to_multiple_of`` (``SFTConfig.pad_to_multiple_of``): the padding-free collator pads its one row at the tail
  to a multiple (positions 0, labels -100 there): a packed row with tail padding to poison;
* ``prepacked`` (``SFTConfig(packing=True)``'s BFD packer): the collator is handed the packed row as one example
  carrying ``seq_lengths``, its positions from ``get_position_ids_from_packed_seq_lengths``;
* ``model_takes_logits_to_keep``: a model whose forward takes ``logits_to_keep`` (every Hugging Face causal LM of
  transformers 5): SDFT's scoring asks it for the last ``logits_to_keep + 1`` positions only (:func:`keeping_model`);
* ``index_k``: ``selective_log_softmax`` handed an index of K columns per position (the top-K gather of TRL's
  distillation trainers): the label's log-prob is read from its column;
* ``cast_lm_head_to_fp32`` (``GRPOConfig.cast_lm_head_to_fp32``, trl-fused): the fused head projects the hidden states
  in float32.

GRPO's ``pad_to_multiple_of`` (its prompts and completions each padded to a multiple) is not drawn: the declared
``LEFT_RIGHT`` layout has no rounded blocks (spec.protocol.profile.layout_starts), so every mask and row check would
read its extra columns as misplaced tokens.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ...protocol.engine import ConfigSwitch
from ...protocol.known import When

__all__ = ["TRL_SWITCHES", "FUSED_SWITCHES", "keeping_model", "gathered_log_probs", "padded_positions",
           "HEAD_IN_LOGITS_DTYPE", "padding_free_batch", "completion_scores"]

_PACKED = (
    ConfigSwitch("pad_to_multiple_of", (None, 8), "SFTConfig.pad_to_multiple_of: the padding-free row padded at its "
                 "tail to a multiple of 8 tokens"),
    ConfigSwitch("prepacked", (False, True), "SFTConfig(packing=True): the collator gets the BFD packer's row, one "
                 "example with seq_lengths"),
)
TRL_SWITCHES: tuple[ConfigSwitch, ...] = (
    *_PACKED,
    ConfigSwitch("model_takes_logits_to_keep", (False, True), "the model's forward takes logits_to_keep: SDFT asks "
                 "for the last logits_to_keep + 1 positions' logits only"),
    ConfigSwitch("index_k", (None, 2), "selective_log_softmax gathers K columns per position (the top-K gather), the "
                 "label's first"),
)
FUSED_SWITCHES: tuple[ConfigSwitch, ...] = (
    *_PACKED,
    ConfigSwitch("cast_lm_head_to_fp32", (False, True), "GRPOConfig.cast_lm_head_to_fp32: the fused head projects the "
                 "hidden states in float32"),
)

#: where trl-fused's head projects in the hidden states' own dtype (cast_lm_head_to_fp32 off, GRPOConfig's default)
HEAD_IN_LOGITS_DTYPE = When("cast_lm_head_to_fp32 off (GRPOConfig's default)",
                            lambda case: not dict(getattr(case, "engine_config", ())).get("cast_lm_head_to_fp32"))


def keeping_model(output: Any):
    """The harness's ``output`` as the model SDFT's ``_forward_logits`` calls: asked for ``logits_to_keep`` positions
    (where the trainer's ``model_kwarg_keys`` say its forward takes them), it returns only the last that many
    positions' logits, as a Hugging Face causal LM does."""
    def model(*, logits_to_keep: int | None = None, **_: Any) -> Any:
        return output if logits_to_keep is None else SimpleNamespace(logits=output.logits[:, -logits_to_keep:])
    return model


def gathered_log_probs(utils: Any, logits: torch.Tensor, ids: torch.Tensor, k: int | None) -> torch.Tensor:
    """``selective_log_softmax`` of ``ids`` (one label per position), or with ``k``: of an index of ``k`` columns per
    position, the label's first (the top-K gather), read back from that column."""
    if not k:
        return utils.selective_log_softmax(logits, ids)
    index = torch.stack([(ids + j) % logits.shape[-1] for j in range(k)], dim=-1)
    return utils.selective_log_softmax(logits, index)[..., 0]


def padded_positions(positions: torch.Tensor, width: int) -> torch.Tensor:
    """``positions`` (``(..., 1, n)``) padded with 0 at the tail to ``width`` tokens, as the collator pads its own."""
    return torch.nn.functional.pad(positions, (0, width - positions.shape[-1]))


def padding_free_batch(collator: Any, ids: list[torch.Tensor], pad_token_id: int, config: dict) -> dict:
    """SFT's padding-free collator (``collator``: ``DataCollatorForLanguageModeling``) on the samples ``ids``, as the
    switches configure it: one example per sample, or the BFD packer's one row with ``seq_lengths`` (``prepacked``);
    the row padded at its tail to ``pad_to_multiple_of``."""
    examples = ([{"input_ids": torch.cat(ids).tolist(), "seq_lengths": [len(t) for t in ids]}]
                if config.get("prepacked") else [{"input_ids": t.tolist()} for t in ids])
    return collator(pad_token_id=pad_token_id, padding_free=True,
                    pad_to_multiple_of=config.get("pad_to_multiple_of"))(examples)


def completion_scores(sdft: Any, utils: Any, output: Any, a: dict, config: dict, entropy: bool) -> tuple:
    """GRPO's completion-only log-probs (and entropy, or None) of the padded rows: SDFT's ``_forward_logits`` (a model
    taking ``logits_to_keep`` where ``model_takes_logits_to_keep``), then ``selective_log_softmax`` (a K-column index
    where ``index_k``) and ``entropy_from_logits``."""
    keys = ("logits_to_keep",) if config.get("model_takes_logits_to_keep") else ()
    trainer = SimpleNamespace(model_kwarg_keys=keys, temperature=a["temperature"])
    logits = sdft._forward_logits(trainer, keeping_model(output), a["input_ids"], a["attention_mask"], a["keep"])
    return (gathered_log_probs(utils, logits, a["input_ids"][:, -a["keep"]:], config.get("index_k")),
            utils.entropy_from_logits(logits) if entropy else None)
