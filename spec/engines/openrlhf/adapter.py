"""OpenRLHF 0.11.2's ``openrlhf.models.actor.Actor.forward`` as an engine under test (``--engine openrlhf``).

``Actor.forward(sequences, attention_mask=...)`` does the whole preparation: packed (``packing_samples``) it unpads
the dense rows with flash-attn's ``unpad_input`` (positions from the mask's cumsum, labels the dense rows rolled
before unpadding), padded it hands the rows and ``cumsum(mask) - 1`` positions; then it casts the logits to
float32, divides them by its one temperature (``div_``), takes ``compute_entropy`` and ``log_probs_from_logits``,
re-pads packed outputs with ``pad_input`` and drops the last column. The batch is OpenRLHF's own: whole
sequences right-padded by ``openrlhf.utils.utils.zero_pad_sequences`` (as ``make_experience_batch`` merges
samples). ``return_logprobs=True`` without an ``action_mask`` returns every position (with one, the same
log-probs times the mask).

The model runs between the suite's two steps, so ``forward`` runs twice (the kit, :mod:`spec.engines.kit`):
``prepare_model_inputs`` runs it with a model that records what it is handed and stops
(:func:`~spec.engines.kit.inputs_seen_by_model`); ``prepare_model_outputs`` runs it again with a model that returns
the harness's output (:func:`~spec.engines.kit.replaying`). Module-level imports that do not import here
(transformers, peft, deepspeed, flash-attn's CUDA package) are stubbed strictly (:func:`~spec.engines.kit.stub_imports`:
a name nobody declared raises when used); flash-attn's pure-torch ``bert_padding`` is the real file
from the flash-attn 2.8.3 sdist (installed as ``flash_attn_bert_padding``, the `trl-openrlhf` CI step), since
the packed path runs it. A vision model (mRoPE positions) computes its own positions in the padded path
(``is_vlm``): the adapter hands the stand-in model the sample's own. A vision-language micro-batch's images and videos
are each sample's processor outputs, merged by OpenRLHF's ``merge_mm_train_inputs`` as its PPO actor merges an
experience's and handed to ``forward`` (``**mm_inputs``), the VLM config's media token ids beside them (``_vlm_config``,
for the token types the padded path builds). docs/engines/openrlhf.md.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from types import SimpleNamespace

import torch

from ...protocol import Feature, sequences_from_rows
from ..kit.hf_batch import BatchFlags, media_samples, media_token_ids, one_temperature
from ..kit import ThirdPartyEngine, inputs_seen_by_model, refuse_flags, replaying, require, rows_view, stub_imports
from .config import forward_kwargs, merged_rows
from .records import PROFILE, RECORDS
from .critic import OpenRLHFCritic
from .step import openrlhf_step_layer
from ..kit.stubs import strict_module

__all__ = ["OpenRLHFEngine"]

PACKAGES = ("peft", "transformers", "deepspeed", "flash_attn")
#: compute_entropy is @torch.compile'd: every new (n, V) shape would compile it (seconds each on CPU); its code
#: runs eagerly instead (the same torch calls; a compiled kernel may round differently)
EAGER = torch._dynamo.config.patch(disable=True)


@lru_cache(maxsize=1)
def _openrlhf():
    strict_module("flash_attn")
    sys.modules["flash_attn.bert_padding"] = require(
        "flash_attn_bert_padding", "flash-attn 2.8.3's bert_padding.py as this module (.ci/steps/bert_padding.py)")
    strict_module("pylatexenc.latex2text")  # openrlhf.utils' math grader, never run here
    return (stub_imports("openrlhf.models.actor", PACKAGES).Actor, stub_imports("openrlhf.utils.utils", PACKAGES),
            stub_imports("openrlhf.utils.vlm_utils", (*PACKAGES, "PIL")).merge_mm_train_inputs)


class OpenRLHFObject:
    def __init__(self, **config):  # OpenRLHF's switches drawn (spec/engines/openrlhf/config.py)
        (self.actor_class, self.utils, self.merge_mm), self.stack, self.config = (
            _openrlhf(), config.get("stack", True), config)

    def _forward(self, model, a, **kwargs):
        actor = self.actor_class(model, temperature=a["temperature"])
        actor.packing_samples, actor.is_vlm = a["packed"], a["vlm"]
        actor._vlm_config = a["vlm_config"]  # what Actor.__init__ keeps of a VLM's config (its media token ids)
        with EAGER:  # a VLM's images as the PPO actor merges each experience's (merge_mm_train_inputs)
            return actor(a["sequences"], attention_mask=a["attention_mask"], return_output=True, **kwargs,
                         **self.merge_mm(a["mm_train_inputs"], a["sequences"].device))

    def prepare_model_inputs(self, mb):
        f, pad = refuse_flags(BatchFlags.from_batch(mb), "OpenRLHF's Actor.forward"), self.utils.zero_pad_sequences
        seqs, pos = mb["input_ids"].unbind(), mb["position_ids"].unbind()
        a = {"temperature": one_temperature(mb), "packed": f.use_remove_padding,
             "vlm": pos[0].dim() == 2 and not f.use_remove_padding,  # packed: 1-D positions for any model
             "sequences": merged_rows(pad, list(seqs), self.stack, side="right", value=f.pad_token_id),
             "attention_mask": merged_rows(pad, [torch.ones_like(s) for s in seqs], self.stack, side="right"),
             # each sample's processor outputs (None for a text-only one), as the experience carries them
             "mm_train_inputs": [d or None for d in media_samples(mb) or ()],
             "vlm_config": SimpleNamespace(**dict(zip(("image_token_id", "video_token_id"), media_token_ids(mb))))}
        inputs = inputs_seen_by_model(lambda model: self._forward(model, a))
        if a["vlm"]:  # the vision model's own (mRoPE) positions
            inputs["position_ids"] = pad(list(pos), "right", stack=True).transpose(0, 1)
        return inputs, a

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        entropy = BatchFlags.from_batch(mb).calculate_entropy
        log_probs, out = self._forward(replaying(output), output_args, return_logprobs=True, return_entropy=entropy,
                                       **forward_kwargs(mb, output_args["sequences"], self.config))
        # (B, L - 1) rows: the last column (the longest row's last token, scoring nothing) is never computed
        return {k: sequences_from_rows(torch.cat([v, v.new_zeros(len(v), 1)], 1).float(), mb)
                for k, v in {"log_probs": log_probs, "entropy": out.entropy if entropy else None}.items()
                if v is not None}


class OpenRLHFEngine(ThirdPartyEngine):
    name, library, known_failures, profile = "openrlhf", "OpenRLHF's Actor.forward", RECORDS, PROFILE
    reasons = {
        Feature.SP: "ring attention needs ring_flash_attn and a process group (not run here)",
        Feature.VALUE: "the critic is another model class (get_llm_for_sequence_regression), not Actor.forward (its "
                       "forward is run by the training step's value loss only: spec/engines/openrlhf/critic.py)",
        Feature.TEMPERATURE_HANDOFF: "one float temperature per actor (self.temperature); nothing is handed over",
        Feature.CU_SEQLENS: "the packed path hands the model no cu_seqlens (flash-attn finds them from positions)",
        Feature.PER_SAMPLE_TEMPERATURE: "one float temperature per actor (Actor(temperature=...))",
    }
    view_inputs = staticmethod(rows_view)  # the labels forward scores: its rows rolled by one, token by token

    def engine_object(self, **config):
        return OpenRLHFObject(**config)

    def make(self, head: str = "lm", **settings):
        """``Actor.forward`` (the engine under test); for the training step's value loss, OpenRLHF's critic forward
        (spec/engines/openrlhf/critic.py: the preparation's value invariants stay skipped, ``Feature.VALUE``)."""
        if head == "value" and not settings:
            return OpenRLHFCritic(_openrlhf()[1])
        return super().make(head, **settings)

    def step_layer(self):
        """The PPO actor step: PolicyLoss normalised per optimizer-step window (spec/engines/openrlhf/step.py)."""
        if not hasattr(self, "_step"):
            self._step = openrlhf_step_layer(_openrlhf)
        return self._step

