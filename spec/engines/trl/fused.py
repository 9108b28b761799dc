"""Hugging Face TRL 1.16's GRPO fused LM head as an engine under test (``trl-fused``).

TRL's batches as in :mod:`spec.engines.trl.adapter`; the scoring patches a stand-in model (the kit's
:class:`~spec.engines.kit.HiddenStatesModel`: the harness's ``hidden_states`` and ``lm_head_weight``, the fused-head
protocol, ``HeadInput.HIDDEN``) with ``add_fused_lm_head`` and runs ``GRPOTrainer._get_per_token_logps_and_entropies``
(padded) or the fused forward with the collator's labels (packed). A vision-language batch goes through GRPO only
(padded: TRL's trainers refuse padding-free training on vision data): its images as GRPO hands them
(:mod:`spec.engines.trl.media`). docs/engines/trl.md.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import torch

from ...protocol import HeadInput
from ..kit import HiddenStatesModel, inputs_seen_by_model, require
from .adapter import TrlEngine, TrlObject
from .step import trl_step_layer
from .config import FUSED_SWITCHES, LOGIT_SCALINGS, MOE_CONFIG, sft_fused_scores, sft_rows
from .media import BACKBONE_MEDIA, grpo_media
from .records import FUSED_OFF_PATH, FUSED_RECORDS, FUSED_SURFACE, FUSED_UNREACHABLE

__all__ = ["TrlFusedEngine"]


class _StandIn(HiddenStatesModel):
    """The stand-in of another model family (config.py's ``logit_scaling`` and ``moe_router``): its config carries
    ``attributes``; its own forward returns the logits times ``scale`` (what TRL multiplies them by, as that family's
    model does); an MoE one's backbone returns router logits where asked (``output_router_logits``)."""

    def __init__(self, hidden, weight, attributes: dict, scale: float = 1.0, experts: int = 0):
        super().__init__(hidden, weight)
        for name, value in attributes.items():
            setattr(self.config, name, value)
        self.scale = scale
        if experts:
            self.model = self.base_model = _RoutedBackbone(self.model, experts)

    def forward(self, *args, **kwargs):
        return SimpleNamespace(logits=super().forward(*args, **kwargs).logits * self.scale)


class _RoutedBackbone(torch.nn.Module):
    """An MoE backbone: the harness's hidden states, and where asked (``output_router_logits``) each of two layers'
    router logits ``(tokens, experts)``, a fixed projection of the hidden states (they feed the load-balancing loss
    only, never the log-probs)."""

    def __init__(self, inner, experts: int):
        super().__init__()
        self.inner, self.lm_head, self.experts = inner, inner.lm_head, experts

    def forward(self, *args, output_router_logits: bool = False, **kwargs):
        out = self.inner(*args, **kwargs)
        if not output_router_logits:
            return out
        hidden = out.last_hidden_state
        # finite where the harness poisons the padding's hidden states, as a real router's logits are there
        flat = torch.nan_to_num(hidden.reshape(-1, hidden.shape[-1]).float(), nan=0.0, posinf=0.0, neginf=0.0)
        router = torch.cos(torch.arange(hidden.shape[-1] * self.experts, dtype=torch.float32, device=flat.device)
                           ).reshape(hidden.shape[-1], self.experts)
        return SimpleNamespace(last_hidden_state=hidden, router_logits=(flat @ router, flat @ router.flip(0)))

    def get_output_embeddings(self):
        return self.lm_head


def stand_in(output, config: dict) -> HiddenStatesModel:
    """The harness's ``output`` as the model TRL patches: the stand-in, or one of the family the switches draw
    (config.py): a config scaling the logits by 1/16 with the head weight handed times 16 (the same logits, bit for
    bit), an MoE config whose backbone returns router logits."""
    scaling, moe = config.get("logit_scaling"), config.get("moe_router")
    if not scaling and not moe:
        return HiddenStatesModel(output.hidden_states, output.lm_head_weight)
    attribute, value, scale = LOGIT_SCALINGS[scaling] if scaling else (None, None, 1.0)
    attributes = {**({attribute: value} if scaling else {}), **(MOE_CONFIG if moe else {})}
    return _StandIn(output.hidden_states, output.lm_head_weight / scale, attributes, scale,
                    MOE_CONFIG["num_experts"] if moe else 0)


class TrlFusedObject(TrlObject):
    def prepare_model_inputs(self, mb):
        inputs, a = super().prepare_model_inputs(mb)
        a["media"] = {} if a["sft"] else grpo_media(mb, self.utils.pad, a["keep"])
        if a["media"]:  # what GRPO hands the backbone (its ids, mask and media), the sample's own positions beside
            seen = inputs_seen_by_model(lambda backbone: self._grpo(HiddenStatesModel(None, None, backbone), a, False))
            inputs = {**{k: seen[k] for k in ("input_ids", "attention_mask", *BACKBONE_MEDIA) if k in seen},
                      "position_ids": inputs["position_ids"]}
        return inputs, a

    def _fused(self, model, a):
        self.utils.add_fused_lm_head(model, temperature=a["temperature"], outputs=("log_probs", "entropy"),
                                     cast_lm_head_to_fp32=bool(self.config.get("cast_lm_head_to_fp32")))
        return model

    def _grpo(self, model, a, entropy):  # GRPO's padded scoring, its images beside
        self._fused(model, a)
        grpo = require("trl.trainer.grpo_trainer", "pip install trl==1.16.0").GRPOTrainer
        trainer = SimpleNamespace(accelerator=SimpleNamespace(autocast=nullcontext))
        config = model.config
        aux = hasattr(config, "output_router_logits") and getattr(config, "router_aux_loss_coef", 0.0) != 0.0
        return grpo._get_per_token_logps_and_entropies.__wrapped__(  # compute_aux_loss: GRPO's aux_loss_enabled
            trainer, model, a["input_ids"], a["attention_mask"], a["keep"], compute_entropy=entropy,
            compute_aux_loss=aux, **a["media"])[:2]

    def scores(self, output, a, entropy):
        model = stand_in(output, self.config)
        if a["sft"]:  # SFT's scoring: the fused forward with the collator's labels
            return sft_fused_scores(self._fused(model, a), a["labels"], self.config, entropy)
        return self._grpo(model, a, entropy)


class TrlFusedEngine(TrlEngine):
    name, library, known_failures = "trl-fused", "TRL's fused head", FUSED_RECORDS
    # trl's profile (GRPO's layout) with its own surface: the batch builders and GRPO's fused head (trl/records.py);
    # add_fused_lm_head scores hidden states with the LM-head weight; GRPO's images (SFT refuses padding-free on
    # vision data)
    profile = replace(TrlEngine.profile, surface=FUSED_SURFACE, unreachable=FUSED_UNREACHABLE, off_path=FUSED_OFF_PATH,
                      head_input=HeadInput.HIDDEN, config_space=FUSED_SWITCHES, media=("image",),
                      media_modes=("padded",))

    def engine_object(self, **config):
        return TrlFusedObject(**config)

    def config_space(self):
        return FUSED_SWITCHES

    def padded_layout_of(self, case):  # SFT's rows' layout only where they are SFT's (a VLM batch stays GRPO's)
        return super().padded_layout_of(case) if sft_rows(case) else self.padded_layout

    def step_layer(self):  # GRPO's step (step.py) on its fused scoring: the step model hands hidden states
        return trl_step_layer()
