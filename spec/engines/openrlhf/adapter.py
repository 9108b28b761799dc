"""OpenRLHF 0.11.2's ``openrlhf.models.actor.Actor.forward`` as an engine under test (``--engine openrlhf``).

``Actor.forward(sequences, attention_mask=...)`` does the whole preparation: packed (``packing_samples``) it unpads
the dense rows with flash-attn's ``unpad_input`` (positions from the mask's cumsum, labels the dense rows rolled
before unpadding), padded it hands the rows and ``cumsum(mask) - 1`` positions; then it casts the logits to
float32, divides them by its one temperature (``div_``), takes ``compute_entropy`` and ``log_probs_from_logits``,
re-pads packed outputs with ``pad_input`` and drops the last column. The batch is OpenRLHF's own: whole
sequences right-padded by ``openrlhf.utils.utils.zero_pad_sequences`` (as ``make_experience_batch`` merges
samples). ``return_logprobs=True`` without an ``action_mask`` returns every position (with one, the same
log-probs times the mask); the drawn switches (spec/engines/openrlhf/config.py) also make the PPO actor's call without
``return_logprobs`` and the logits-only return, whose logits the caller scores with ``log_probs_from_logits``.

The model runs between the suite's two steps, so ``forward`` runs twice (the kit, :mod:`spec.engines.kit`):
``prepare_model_inputs`` runs it with a model that records what it is handed and stops
(:func:`~spec.engines.kit.inputs_seen_by_model`); ``prepare_model_outputs`` runs it again with a model that returns
the harness's output (:func:`~spec.engines.kit.replaying`). Module-level imports that do not import here
(transformers, peft, deepspeed, flash-attn's CUDA package) are stubbed strictly (:func:`~spec.engines.kit.stub_imports`:
a name nobody declared raises when used); flash-attn's pure-torch ``bert_padding`` is the real file
from the flash-attn 2.8.3 sdist (installed as ``flash_attn_bert_padding``, the `openrlhf` CI step), since
the packed path runs it. A vision model (mRoPE positions) computes its own positions in the padded path
(``is_vlm``): the adapter hands the stand-in model the sample's own. A vision-language micro-batch's images and videos
are each sample's processor outputs, merged by OpenRLHF's ``merge_mm_train_inputs`` as its PPO actor merges an
experience's and handed to ``forward`` (``**mm_inputs``), the VLM config's media token ids beside them (``_vlm_config``,
for the token types the padded path builds). spec/engines/openrlhf/README.md.
"""

from __future__ import annotations

import torch

from ...protocol import sequences_from_rows
from ..kit.hf_batch import BatchFlags, one_temperature
from ..kit import ThirdPartyEngine, inputs_seen_by_model, refuse_flags, replaying, rows_view
from .config import forward_kwargs, merged_rows, scored
from .critic import OpenRLHFCritic
from .library import EAGER, openrlhf_modules
from .media import vlm_args, with_own_positions
from .records import REASONS, PROFILE, RECORDS
from .step import openrlhf_step_layer

__all__ = ["OpenRLHFEngine"]


class OpenRLHFObject:
    def __init__(self, **config):  # OpenRLHF's switches drawn (spec/engines/openrlhf/config.py)
        (self.actor_class, self.utils, self.merge_mm), self.stack, self.config = (
            openrlhf_modules(), config.get("stack", True), config)

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
             "sequences": merged_rows(pad, list(seqs), self.stack, side="right", value=f.pad_token_id),
             "attention_mask": merged_rows(pad, [torch.ones_like(s) for s in seqs], self.stack, side="right"),
             **vlm_args(mb, pos, f.use_remove_padding, self.config)}  # a VLM's images, config, positions (media.py)
        return with_own_positions(inputs_seen_by_model(lambda model: self._forward(model, a)), a, list(pos), pad), a

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        entropy = BatchFlags.from_batch(mb).calculate_entropy
        kwargs = forward_kwargs(mb, output_args["sequences"], self.config)  # OpenRLHF's switches (config.py)
        log_probs, out = scored(self._forward(replaying(output), output_args, return_entropy=entropy, **kwargs),
                                self.config, self.actor_class, output_args)
        # (B, L - 1) rows: the last column (the longest row's last token, scoring nothing) is never computed
        return {k: sequences_from_rows(torch.cat([v, v.new_zeros(len(v), 1)], 1).float(), mb)
                for k, v in {"log_probs": log_probs, "entropy": out.entropy if entropy else None}.items()
                if v is not None}


class OpenRLHFEngine(ThirdPartyEngine):
    name, library, known_failures, profile = "openrlhf", "OpenRLHF's Actor.forward", RECORDS, PROFILE
    reasons = REASONS  # why it lacks the others (records.py, beside its profile)
    view_inputs = staticmethod(rows_view)  # the labels forward scores: its rows rolled by one, token by token

    def engine_object(self, **config):
        return OpenRLHFObject(**config)

    # the training step's value loss runs OpenRLHF's critic forward (critic.py; Feature.VALUE stays lacking)
    value_model = staticmethod(lambda: OpenRLHFCritic(openrlhf_modules()[1]))

    def step_layer(self):  # the PPO actor step: PolicyLoss normalised per optimizer-step window (step.py)
        return openrlhf_step_layer()

