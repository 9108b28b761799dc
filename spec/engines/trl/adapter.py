"""Hugging Face TRL 1.16 as engines under test: ``trl`` (its logits API) and ``trl-fused`` (GRPO's fused LM head).

Both build TRL's own batches: padded, GRPO's layout (``trl.trainer.utils.pad``: prompts left-padded, completions
right-padded, concatenated with their masks); packed, SFT's padding-free collator (``DataCollatorForLanguageModeling
(padding_free=True)``: one row, positions restarting at 0, labels -100 at each sequence start; its ``cu_seq_lens_q/k``
handed to the model with the row). ``trl`` scores the
logits as TRL's trainers do: padded through ``SDFTTrainer._forward_logits`` (``logits[:, :-1][:, -logits_to_keep:] /
temperature``) then ``selective_log_softmax`` and ``entropy_from_logits``; packed through
``selective_log_softmax_and_entropy`` on the shifted row (as TPO does). ``trl-fused`` patches a stand-in model with
``add_fused_lm_head`` and runs ``GRPOTrainer._get_per_token_logps_and_entropies`` (padded) or the fused forward
with the collator's labels (packed). Padded, ``logits_to_keep`` is the completion width, as GRPO scores: the outputs
are completion-only (``OutputSpan.RESPONSE``) in GRPO's layout (``PaddedLayout.LEFT_RIGHT``).

TRL hands the model no ``position_ids`` (a RoPE model is shift-invariant); the stand-in model has absolute positions,
so the adapter hands it each sample's own positions in the same layout. The fused head gets the stand-in's
``hidden_states`` and ``lm_head_weight`` (the fused-head protocol, ``HeadInput.HIDDEN``). Built on the adapter kit
(:mod:`spec.engines.kit`, :mod:`spec.engines.kit.hf_batch`). spec/engines/trl/README.md.
"""

from __future__ import annotations

import torch

from ...protocol import InputsView, PaddedLayout, sequences_from_responses, sequences_from_rows
from ...protocol.engine import media_view
from ..kit.hf_batch import BatchFlags, from_shifted_row, left_right_rows, one_temperature, samples
from ..kit import ThirdPartyEngine, refuse_flags, require
from .config import completion_scores, from_shifted_rows, sft_batch, sft_padded, sft_positions, sft_scores
from .records import REASONS, PROFILE, LOGITS_RECORDS
from .step import trl_step_layer

__all__ = ["TrlEngine", "TrlObject", "VARLEN_BOUNDARIES"]

#: the padding-free collator's sequence boundaries, handed to the model as SFT hands its whole batch (``model(**inputs)``):
#: flash-attention's varlen kernels split the packed row at them (the stand-in model does, spec.truth.toy_model)
VARLEN_BOUNDARIES = ("cu_seq_lens_q", "cu_seq_lens_k")


class TrlObject:
    def __init__(self, **config):  # TRL's switches drawn (spec/engines/trl/config.py)
        self.utils, self.sft, sdft = (require(f"trl.{m}", "pip install trl==1.16.0") for m in (
            "trainer.utils", "trainer.sft_trainer", "experimental.sdft.sdft_trainer"))
        self.sdft, self.config = sdft.SDFTTrainer, config

    def prepare_model_inputs(self, mb):
        f = refuse_flags(BatchFlags.from_batch(mb), "TRL's log-prob API")
        a = {"temperature": one_temperature(mb), "packed": f.use_remove_padding}
        a["sft"] = a["packed"] or sft_padded(self.config, mb)
        if a["sft"]:  # SFT's collator: one padding-free row (labels -100 at each sequence start), or right-padded rows
            batch = sft_batch(self.sft.DataCollatorForLanguageModeling, samples(mb, "input_ids"), f.pad_token_id,
                              self.config, a["packed"])
            rolled = torch.roll(batch["input_ids"], -1, 1)
            a.update(labels=batch["labels"], rolled=rolled.reshape(-1) if a["packed"] else
                     sequences_from_rows(rolled, mb, PaddedLayout.RIGHT).values())
            return {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask"), "position_ids":
                    sft_positions(self.utils.pad, batch, samples(mb, "position_ids"), a["packed"]),
                    **{k: batch[k] for k in VARLEN_BOUNDARIES if k in batch}}, a
        rows = left_right_rows(mb, self.utils.pad, f.pad_token_id)  # GRPO's batch
        rolled = sequences_from_rows(torch.roll(rows.input_ids, -1, 1), mb, PaddedLayout.LEFT_RIGHT).values()
        a.update(input_ids=rows.input_ids, attention_mask=rows.attention_mask, keep=rows.response_width, rolled=rolled)
        return rows.model_inputs(), a

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        a, entropy = output_args, BatchFlags.from_batch(mb).calculate_entropy
        out = dict(zip(("log_probs", "entropy"), self.scores(output, a, entropy)))
        back = from_shifted_row if a["packed"] else from_shifted_rows if a["sft"] else sequences_from_responses
        return {k: back(v.float(), mb) for k, v in out.items() if v is not None}

    def scores(self, output, a, entropy):  # log-probs and entropy (or None), dense
        if a["sft"]:  # as TPO scores the shifted rows; the collator's labels hold the ids (-100 where none is scored)
            return sft_scores(self.utils, output.logits, a["labels"], a["temperature"], self.config, entropy)
        return completion_scores(self.sdft, self.utils, output, a, self.config, entropy)  # GRPO's, via SDFT's


class TrlEngine(ThirdPartyEngine):
    name, library, known_failures, profile = "trl", "TRL's logits API", LOGITS_RECORDS, PROFILE
    reasons = REASONS  # why it lacks the others (records.py, beside its profile)

    def engine_object(self, **config):
        return TrlObject(**config)

    def step_layer(self):  # GRPO's step: every loss_type through GRPOTrainer._compute_loss (step.py)
        return trl_step_layer()

    def view_inputs(self, model_inputs, output_args) -> InputsView:  # labels: the next column, token by token
        return InputsView(model_inputs["input_ids"], model_inputs["position_ids"], model_inputs["attention_mask"],
                          labels=output_args["rolled"], media=media_view(model_inputs))
