"""Hugging Face TRL 1.16's GRPO fused LM head as an engine under test (``trl-fused``).

TRL's batches as in :mod:`spec.engines.trl.adapter`; the scoring patches a stand-in model (the kit's
:class:`~spec.engines.kit.HiddenStatesModel`: the harness's ``hidden_states`` and ``lm_head_weight``, the fused-head
protocol, ``HeadInput.HIDDEN``) with ``add_fused_lm_head`` and runs ``GRPOTrainer._get_per_token_logps_and_entropies``
(padded) or the fused forward with the collator's labels (packed). docs/engines/trl.md.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from types import SimpleNamespace

from ...protocol import HeadInput
from ..kit import HiddenStatesModel, require
from .adapter import TrlEngine, TrlObject
from .config import FUSED_SWITCHES
from .records import FUSED_RECORDS, FUSED_SURFACE, FUSED_UNREACHABLE

__all__ = ["TrlFusedEngine"]


class TrlFusedObject(TrlObject):
    def scores(self, output, a, entropy):
        model = HiddenStatesModel(output.hidden_states, output.lm_head_weight)
        self.utils.add_fused_lm_head(model, temperature=a["temperature"], outputs=("log_probs", "entropy"),
                                     cast_lm_head_to_fp32=bool(self.config.get("cast_lm_head_to_fp32")))
        if a["packed"]:
            out = model(input_ids=None, labels=a["labels"], fused_lm_head=True)
            return out.log_probs, out.entropy if entropy else None
        grpo = require("trl.trainer.grpo_trainer", "pip install trl==1.16.0").GRPOTrainer
        trainer = SimpleNamespace(accelerator=SimpleNamespace(autocast=nullcontext))
        return grpo._get_per_token_logps_and_entropies.__wrapped__(
            trainer, model, a["input_ids"], a["attention_mask"], a["keep"], compute_entropy=entropy)[:2]


class TrlFusedEngine(TrlEngine):
    name, library, known_failures = "trl-fused", "TRL's fused head", FUSED_RECORDS
    # trl's profile (GRPO's layout) with its own surface: the batch builders and GRPO's fused head (trl/records.py);
    # add_fused_lm_head scores hidden states with the LM-head weight
    profile = replace(TrlEngine.profile, surface=FUSED_SURFACE, unreachable=FUSED_UNREACHABLE, head_input=HeadInput.HIDDEN,
                      config_space=FUSED_SWITCHES)

    def engine_object(self, **config):
        return TrlFusedObject(**config)

    def config_space(self):
        return FUSED_SWITCHES
