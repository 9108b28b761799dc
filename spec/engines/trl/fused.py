"""Hugging Face TRL 1.16's GRPO fused LM head as an engine under test (``trl-fused``).

TRL's batches as in :mod:`spec.engines.trl.adapter`; the scoring patches a stand-in model (the kit's
:class:`~spec.engines.kit.HiddenStatesModel`: the harness's ``hidden_states`` and ``lm_head_weight``, the fused-head
protocol, ``HeadInput.HIDDEN``) with ``add_fused_lm_head`` and runs ``GRPOTrainer._get_per_token_logps_and_entropies``
(padded) or the fused forward with the collator's labels (packed). A vision-language batch goes through GRPO only
(padded: TRL's trainers refuse padding-free training on vision data): its images as GRPO hands them
(:mod:`spec.engines.trl.media`). spec/engines/trl/README.md.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

import torch

from ...protocol import HeadInput
from ..kit import HiddenStatesModel, calls_seen_by_model, require
from .adapter import TrlEngine, TrlObject
from .step import trl_step_layer
from .config import FUSED_SWITCHES, sft_fused_scores, sft_rows
from .families import stand_in
from .media import grpo_media, seen_by_backbone
from .vision_families import FAMILY_CASES
from .records import FUSED_EQUIVALENT_MUTANTS, FUSED_OFF_PATH, FUSED_RECORDS, FUSED_SURFACE, FUSED_UNREACHABLE

__all__ = ["TrlFusedEngine"]


class TrlFusedObject(TrlObject):
    def prepare_model_inputs(self, mb):
        inputs, a = super().prepare_model_inputs(mb)
        family = self.config.get("vision_family")
        a["media"] = {} if a["sft"] else grpo_media(mb, self.utils.pad, a["keep"], family)
        if a["media"]:  # what GRPO hands the backbone, chunk by chunk, as the stand-in reads it; the positions beside
            vocab = int(a["input_ids"].max()) + 1
            calls = calls_seen_by_model(lambda backbone: self._grpo(HiddenStatesModel(None, torch.zeros(vocab, 1),
                                                                                      backbone), a, False),
                                        lambda seen: SimpleNamespace(last_hidden_state=torch.zeros(
                                            *seen["input_ids"].shape, 1)))
            inputs = {**seen_by_backbone(calls, family), "position_ids": inputs["position_ids"]}
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
            compute_aux_loss=aux, batch_size=self.config.get("score_chunk"), **a["media"])[:2]

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
                      media_modes=("padded",), reach_cases=FAMILY_CASES,
                      equivalent_mutants=FUSED_EQUIVALENT_MUTANTS)

    def engine_object(self, **config):
        return TrlFusedObject(**config)

    def config_space(self):
        return FUSED_SWITCHES

    def padded_layout_of(self, case):  # SFT's rows' layout only where they are SFT's (a VLM batch stays GRPO's)
        return super().padded_layout_of(case) if sft_rows(case) else self.padded_layout

    def step_layer(self):  # GRPO's step (step.py) on its fused scoring: the step model hands hidden states
        return trl_step_layer()
