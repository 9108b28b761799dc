"""TRL 1.16's configuration switches the ``trl`` and ``trl-fused`` adapters draw (``EngineUnderTest.config_space``):
each changes the path TRL's own preparation takes, and each reaches the engine object as ``make(**{name: value})``.

* ``pad_to_multiple_of`` (``SFTConfig.pad_to_multiple_of``): the padding-free collator pads its one row at the tail
  to a multiple (positions 0, labels -100 there): a packed row with tail padding to poison, and the row's length
  the rule INV-PAD-003 checks (``ConfigSwitch.tail_multiple``);
* ``prepacked`` (``SFTConfig(packing=True)``'s BFD packer): the collator is handed the packed row as one example
  carrying ``seq_lengths``, its positions from ``get_position_ids_from_packed_seq_lengths``;
* ``model_takes_logits_to_keep``: a model whose forward takes ``logits_to_keep`` (every Hugging Face causal LM of
  transformers 5): SDFT's scoring asks it for the last ``logits_to_keep + 1`` positions only (:func:`keeping_model`);
  drawn off, a model whose forward's signature lacks it (a custom or remote-code module), which refuses the keyword;
* ``index_k``: ``selective_log_softmax`` handed an index of K columns per position (the top-K gather of TRL's
  distillation trainers): the label's log-prob is read from its column;
* ``cast_lm_head_to_fp32`` (``GRPOConfig.cast_lm_head_to_fp32``, trl-fused): the fused head projects the hidden states
  in float32;
* ``sft_collator`` (``SFTConfig(padding_free=False)``, SFT's default): a padded batch is SFT's, not GRPO's: the collator
  right-pads each whole sequence (``PaddedLayout.RIGHT``, the switch's layout) with its attention mask and labels
  (-100 on the padding), scored as the packed row is, each token scoring the next (a vision-language batch stays GRPO's:
  SFT's vision collator runs the processor on raw images);
* ``return_position_ids`` (``DataCollatorForLanguageModeling.return_position_ids``, which SFTTrainer sets under
  sequence parallelism): the padded collator returns each sequence's positions too, handed to the model;
* ``shift_labels`` (trl-fused): SFT's rows handed the fused forward as ``shift_labels``, the labels shifted by one
  with -100 at the end (SFT under accelerate's context or sequence parallelism, which shifts them before sharding the
  sequence; the fused head then scores every position, none cut);
* ``logit_scaling`` (trl-fused): the model's config scales its logits, as a real family's does: Cohere's
  ``logit_scale`` (0.0625, Command R's, a multiplier) or Granite's ``logits_scaling`` (16.0, Granite 3's, a divisor);
  ``add_fused_lm_head`` reads either off the config and scales the projected logits by it. The stand-in's head weight
  is handed multiplied by 16 (its entries are multiples of 2^-4 in (-8, 8), spec.truth.toy_model: exact in every
  dtype, as is each product, 16 a power of two), so the scaled logits are the harness's own, bit for bit, and the
  oracle stays exact: a head that ignored the scale would score 16 times the logits;
* ``moe_router`` (trl-fused): a mixture-of-experts model's config (``output_router_logits``, ``num_experts`` 4, top-2,
  ``router_aux_loss_coef`` 0.001: Qwen3-MoE's and Mixtral's keys): the fused forward asks the backbone for its router
  logits and adds the load-balancing loss, and GRPO asks for that loss (``compute_aux_loss``); the stand-in's
  backbone returns two layers' router logits (a fixed projection of the hidden states), which feed that loss only: the
  log-probs and entropy a consumer reads are the harness's as before;
* ``score_chunk`` (trl-fused; GRPO's ``per_device_train_batch_size``): GRPO scores the generation batch's old and
  reference log-probs that many rows at a time (``_get_per_token_logps_and_entropies(batch_size=...)``), slicing each
  chunk's rows, images, grids and media keys off the batch's; the stand-in backbone serves each chunk its rows'
  hidden states in order (spec.engines.kit), and the model is handed every chunk's inputs, concatenated;
* ``vision_family`` (trl-fused): a vision-language batch as another family's processor returns it (LLaVA-NeXT,
  Gemma 3, Gemma 4, Idefics3, InternVL, LFM2-VL: :mod:`spec.engines.trl.vision_families`), so GRPO's slicing for
  that family's keys runs; the stand-in reads the images back through the family's own sizes and masks;
* ``compute_loss_func`` (trl-fused; ``SFTTrainer(compute_loss_func=...)``, or label smoothing): on SFT's rows the
  trainer calls the unpatched forward (no ``fused_lm_head``, no labels) for the logits its loss function reads, then
  the fused forward under ``torch.no_grad`` for its metrics: the log-probs and entropy are detached;
* ``entropy_requires_grad`` (``trl``): ``selective_log_softmax_and_entropy(entropy_requires_grad=False)``, TPO's call:
  the entropy computed under ``no_grad``;
* ``row_mask`` (``trl``): the SFT rows' scoring handed no ``row_mask`` (the helpers' default): nothing masked, the
  positions that score no label (sequence ends, padding) left as computed.

GRPO's ``pad_to_multiple_of`` (its prompts and completions each padded to a multiple) is not drawn: the declared
``LEFT_RIGHT`` layout has no rounded blocks (spec.protocol.profile.layout_starts), so every mask and row check would
read its extra columns as misplaced tokens.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from ...protocol.engine import ConfigSwitch, PaddedLayout, sequences_from_rows
from ...protocol.profile import drawn_config
from ...protocol.known import When
from ..kit.hf_batch import media_samples
from .vision_families import FAMILIES

__all__ = ["TRL_SWITCHES", "FUSED_SWITCHES", "LOGIT_SCALINGS", "MOE_CONFIG", "keeping_model", "gathered_log_probs",
           "padded_positions", "HEAD_IN_LOGITS_DTYPE", "DETACHED_ENTROPY", "sft_batch", "sft_padded", "sft_positions",
           "sft_scores", "from_shifted_rows", "fused_labels", "sft_fused_scores", "METRICS_ONLY", "completion_scores", "sft_rows",
           "GRPO_ROWS"]

_COLLATOR = (
    ConfigSwitch("pad_to_multiple_of", (None, 8), "SFTConfig.pad_to_multiple_of: the padding-free row padded at its "
                 "tail to a multiple of 8 tokens", tail_multiple=True),
    ConfigSwitch("prepacked", (False, True), "SFTConfig(packing=True): the collator gets the BFD packer's row, one "
                 "example with seq_lengths"),
    ConfigSwitch("sft_collator", (False, True), "SFTConfig(padding_free=False): a padded batch is SFT's collator's, "
                 "each whole sequence right-padded, every next token scored", padded_layout=PaddedLayout.RIGHT),
    ConfigSwitch("return_position_ids", (False, True), "DataCollatorForLanguageModeling.return_position_ids (SFT "
                 "under sequence parallelism): the padded collator returns the positions too"),
)
TRL_SWITCHES: tuple[ConfigSwitch, ...] = (
    *_COLLATOR,
    ConfigSwitch("entropy_requires_grad", (True, False), "selective_log_softmax_and_entropy(entropy_requires_grad="
                 "False), TPO's call: the entropy computed under no_grad"),
    ConfigSwitch("row_mask", (True, False), "the SFT rows scored without row_mask (the helpers' default): the "
                 "positions scoring no label left unmasked"),
    ConfigSwitch("model_takes_logits_to_keep", (False, True), "the model's forward takes logits_to_keep: SDFT asks "
                 "for the last logits_to_keep + 1 positions' logits only"),
    ConfigSwitch("index_k", (None, 2), "selective_log_softmax gathers K columns per position (the top-K gather), the "
                 "label's first"),
)
FUSED_SWITCHES: tuple[ConfigSwitch, ...] = (
    *_COLLATOR,
    ConfigSwitch("cast_lm_head_to_fp32", (False, True), "GRPOConfig.cast_lm_head_to_fp32: the fused head projects the "
                 "hidden states in float32"),
    ConfigSwitch("compute_loss_func", (False, True), "SFTTrainer(compute_loss_func=...) (or label smoothing): the "
                 "loss from the unpatched forward's logits; the fused log-probs and entropy under no_grad, metrics"),
    ConfigSwitch("shift_labels", (False, True), "SFT's rows handed the fused forward as pre-shifted shift_labels "
                 "(SFT under context or sequence parallelism: the labels shifted before the sequence is sharded)"),
    ConfigSwitch("logit_scaling", (None, "logit_scale", "logits_scaling"), "the model's config scales its logits: "
                 "Cohere's logit_scale (0.0625) or Granite's logits_scaling (16.0), the head weight handed times 16",
                 unseen={"output_multiplier": "Muse Glimmer's: read as logit_scale is, the same multiplier (no other "
                                              "branch)",
                         "lm_head_multiplier": "Falcon-H1's: the same multiplier, read where the two above are unset"}),
    ConfigSwitch("moe_router", (False, True), "an MoE model's config (output_router_logits, 4 experts, top-2, "
                 "router_aux_loss_coef 0.001): router logits asked for, the load-balancing loss added"),
    ConfigSwitch("score_chunk", (None, 1, 2), "GRPO scores the generation batch's old and reference log-probs "
                 "per_device_train_batch_size rows at a time (_get_per_token_logps_and_entropies(batch_size=...)): "
                 "each chunk's rows and images sliced off the batch's"),
    ConfigSwitch("vision_family", (None, *FAMILIES), "the vision-language model's family: its processor's keys, "
                 "which GRPO slices per chunk by what it finds (per image: LLaVA-NeXT's image_sizes, Gemma 3's "
                 "token_type_ids, Gemma 4's image_position_ids; per sample: Idefics3's pixel_attention_mask; per "
                 "tile: InternVL's num_tiles, LFM2-VL's spatial_shapes); None: Qwen2-VL's grids"),
)

#: the MoE config ``moe_router`` draws (Qwen3-MoE's and Mixtral's keys)
MOE_CONFIG = {"output_router_logits": True, "num_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}

#: the configs ``logit_scaling`` draws: (the config attribute, its value, what TRL multiplies the logits by)
LOGIT_SCALINGS = {"logit_scale": ("logit_scale", 0.0625, 0.0625), "logits_scaling": ("logits_scaling", 16.0, 0.0625)}

#: where trl-fused's head projects in the hidden states' own dtype (cast_lm_head_to_fp32 off, GRPOConfig's default)
HEAD_IN_LOGITS_DTYPE = When("cast_lm_head_to_fp32 off (GRPOConfig's default)",
                            lambda case: not drawn_config(case).get("cast_lm_head_to_fp32"))


def sft_rows(case: Any) -> bool:
    """Whether TRL scores ``case`` as SFT's rows: packed (the padding-free collator), or padded with ``sft_collator``
    drawn and no images (a vision-language batch stays GRPO's): the case-level twin of :func:`sft_padded`."""
    return case.use_remove_padding or bool(drawn_config(case).get("sft_collator")) and not any(case.media)


#: where trl scores GRPO's completions (padded, no sft_collator or a vision-language batch): SDFT's _forward_logits
#: divides the logits by the trainer's temperature itself, then scores them at T = 1
GRPO_ROWS = When("GRPO's completions (padded, without sft_collator or with images)", lambda case: not sft_rows(case))

#: where trl-fused scores SFT's rows (packed, or padded with sft_collator) under compute_loss_func
METRICS_ONLY = When("compute_loss_func on SFT's rows (packed, or padded with sft_collator)",
                    lambda case: bool(drawn_config(case).get("compute_loss_func")) and sft_rows(case))

#: where trl scores SFT's rows with entropy_requires_grad=False (the selective_log_softmax_and_entropy path: packed,
#: or padded with SFT's collator) and the entropy is asked for
DETACHED_ENTROPY = When("entropy_requires_grad=False on SFT's rows (packed, or padded with sft_collator), entropy "
                        "computed", lambda case: drawn_config(case).get("entropy_requires_grad") is False
                        and case.calculate_entropy and sft_rows(case))


def keeping_model(output: Any, takes_logits_to_keep: bool):
    """The harness's ``output`` as the model SDFT's ``_forward_logits`` calls. One whose forward takes
    ``logits_to_keep`` (``takes_logits_to_keep``, what the trainer's ``model_kwarg_keys`` say), asked for that many
    positions, returns only the last that many positions' logits, as a Hugging Face causal LM does; one whose forward
    does not take it refuses the keyword, as Python refuses a keyword its signature lacks (a TypeError)."""
    def model(*, logits_to_keep: int | None = None, **_: Any) -> Any:
        if logits_to_keep is None:
            return output
        if not takes_logits_to_keep:
            raise TypeError("forward() got an unexpected keyword argument 'logits_to_keep'")
        return SimpleNamespace(logits=output.logits[:, -logits_to_keep:])
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


def sft_padded(config: dict, mb: Any) -> bool:
    """Whether a padded micro-batch ``mb`` is SFT's collator's (``sft_collator``; a vision-language one, where some
    sample has media, stays GRPO's; one whose ``multi_modal_inputs`` are all empty, the text-only samples of a
    vision-language batch, is text: as :func:`sft_rows` reads the case)."""
    return bool(config.get("sft_collator")) and not any(media_samples(mb) or ())


def sft_batch(collator: Any, ids: list[torch.Tensor], pad_token_id: int, config: dict, padding_free: bool) -> dict:
    """SFT's collator (``collator``: ``DataCollatorForLanguageModeling``) on the samples ``ids``, as the switches
    configure it. Padding-free: one example per sample, or the BFD packer's one row with ``seq_lengths``
    (``prepacked``), the row padded at its tail to ``pad_to_multiple_of``. Padded: each sequence right-padded to the
    longest (a multiple would add columns the ``RIGHT`` layout does not have), ``return_position_ids`` as drawn."""
    examples = ([{"input_ids": torch.cat(ids).tolist(), "seq_lengths": [len(t) for t in ids]}]
                if padding_free and config.get("prepacked") else [{"input_ids": t.tolist()} for t in ids])
    return collator(pad_token_id=pad_token_id, padding_free=padding_free,
                    pad_to_multiple_of=config.get("pad_to_multiple_of") if padding_free else None,
                    return_position_ids=bool(config.get("return_position_ids")))(examples)


def sft_positions(pad: Any, batch: dict, positions: list[torch.Tensor], padding_free: bool) -> torch.Tensor:
    """The positions handed the model with SFT's ``batch``: the collator's own (1-D rotary positions, where it returns
    them), else the samples' own ``positions`` laid out as the batch (mRoPE ``(4, B, L)``; ``pad`` is TRL's)."""
    width = batch["input_ids"].shape[1]
    if positions[0].dim() == 2 and padding_free:
        return padded_positions(torch.cat(positions).T.unsqueeze(1), width)
    if "position_ids" in batch and positions[0].dim() == 1:
        return batch["position_ids"]
    rows = pad(positions, 0, "right")
    return rows.permute(2, 0, 1) if rows.dim() == 3 else rows


def sft_scores(utils: Any, logits: torch.Tensor, labels: torch.Tensor, temperature: float, config: dict,
               entropy: bool) -> tuple:
    """TPO's scoring of SFT's rows (``labels``: the collator's, -100 where no label is scored), each position scoring
    the next token: ``selective_log_softmax_and_entropy`` (``entropy_requires_grad`` as drawn) or
    ``selective_log_softmax``, with the labels' ``row_mask`` unless ``row_mask`` is drawn off."""
    ids = torch.where(labels == -100, 0, labels)[:, 1:]
    row_mask = (labels[:, 1:] != -100).long() if config.get("row_mask", True) else None
    if entropy:
        return utils.selective_log_softmax_and_entropy(
            logits[:, :-1], ids, temperature=temperature, row_mask=row_mask,
            entropy_requires_grad=config.get("entropy_requires_grad", True))
    return utils.selective_log_softmax(logits[:, :-1], ids, temperature, row_mask), None


def fused_labels(labels: torch.Tensor, config: dict) -> dict:
    """The fused forward's label keyword for SFT's ``labels``: as they are, or (``shift_labels``) shifted by one with
    -100 at each row's end, as accelerate's context parallelism hands them."""
    if config.get("shift_labels"):
        return {"shift_labels": torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]}
    return {"labels": labels}


def sft_fused_scores(model: Any, labels: torch.Tensor, config: dict, entropy: bool) -> tuple:
    """SFT's scoring of its rows by ``model`` patched with the fused head: the fused forward with the collator's
    ``labels`` (:func:`fused_labels`); under ``compute_loss_func`` SFT's compute_loss first calls the unpatched forward
    for the logits its loss function reads (no labels), then the fused forward under no_grad, for the metrics."""
    if config.get("compute_loss_func"):
        model(input_ids=None)  # the logits of the user's loss (SFT's logits_inputs: no labels)
        with torch.no_grad():
            out = model(input_ids=None, fused_lm_head=True, **fused_labels(labels, config))
    else:
        out = model(input_ids=None, fused_lm_head=True, **fused_labels(labels, config))
    return out.log_probs, out.entropy if entropy else None


def from_shifted_rows(values: torch.Tensor, mb: Any) -> torch.Tensor:
    """Per-token values of right-padded rows shifted by one (``(B, L - 1)``: each token scores the next) as a nested
    tensor over the sequences, 0 at the longest rows' last token (which no consumer reads)."""
    return sequences_from_rows(torch.cat([values, values.new_zeros(values.shape[0], 1)], 1).float(), mb,
                               PaddedLayout.RIGHT)


def completion_scores(sdft: Any, utils: Any, output: Any, a: dict, config: dict, entropy: bool) -> tuple:
    """GRPO's completion-only log-probs (and entropy, or None) of the padded rows: SDFT's ``_forward_logits`` (a model
    taking ``logits_to_keep`` where ``model_takes_logits_to_keep``), then ``selective_log_softmax`` (a K-column index
    where ``index_k``) and ``entropy_from_logits``."""
    takes = bool(config.get("model_takes_logits_to_keep"))
    trainer = SimpleNamespace(model_kwarg_keys=("logits_to_keep",) if takes else (), temperature=a["temperature"])
    logits = sdft._forward_logits(trainer, keeping_model(output, takes), a["input_ids"], a["attention_mask"],
                                  a["keep"])
    return (gathered_log_probs(utils, logits, a["input_ids"][:, -a["keep"]:], config.get("index_k")),
            utils.entropy_from_logits(logits) if entropy else None)
