"""Hugging Face TRL 1.16 as engines under test: ``trl`` (its logits API) and ``trl-fused`` (GRPO's fused LM head).

Both build TRL's own batches: padded, GRPO's layout (``trl.trainer.utils.pad``: prompts left-padded, completions
right-padded, concatenated with their masks); packed, SFT's padding-free collator (``DataCollatorForLanguageModeling
(padding_free=True)``: one row, positions restarting at 0, labels -100 at each sequence start). ``trl`` scores the
logits as TRL's trainers do: padded through ``SDFTTrainer._forward_logits`` (``logits[:, :-1][:, -logits_to_keep:] /
temperature``) then ``selective_log_softmax`` and ``entropy_from_logits``; packed through
``selective_log_softmax_and_entropy`` on the shifted row (as TPO does). ``trl-fused`` patches a stand-in model with
``add_fused_lm_head`` and runs ``GRPOTrainer._get_per_token_logps_and_entropies`` (padded) or the fused forward
with the collator's labels (packed). Padded, ``logits_to_keep`` is the completion width, as GRPO scores: the outputs
are completion-only (``OutputSpan.RESPONSE``) in GRPO's layout (``PaddedLayout.LEFT_RIGHT``).

TRL hands the model no ``position_ids`` (a RoPE model is shift-invariant); the stand-in model has absolute positions,
so the adapter hands it each sample's own positions in the same layout. The fused head gets the stand-in's
``hidden_states`` and ``lm_head_weight`` (the fused-head protocol, ``HeadInput.HIDDEN``). docs/engines/trl.md.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import SimpleNamespace

import torch

from ..protocol import (EngineProfile, EngineUnderTest, Feature, HeadInput, InputsView, OutputSpan, PaddedLayout,
                        sequences_from_responses, sequences_from_rows)
from .hf_batch import BatchFlags, one_temperature, samples
from .trl_records import FUSED_RECORDS, LOGITS_RECORDS

__all__ = ["TrlEngine", "TrlFusedEngine"]

OFFERED = {Feature.ENGINE, Feature.CUDA}


def _trl():
    try:
        from trl.experimental.sdft.sdft_trainer import SDFTTrainer
        from trl.trainer import grpo_trainer, sft_trainer, utils
    except ImportError as exc:
        raise ImportError(f"--engine trl needs trl installed (pip install trl==1.16.0): {exc}") from exc
    return SimpleNamespace(utils=utils, SDFT=SDFTTrainer, GRPO=grpo_trainer.GRPOTrainer,
                           Collator=sft_trainer.DataCollatorForLanguageModeling)


class _FusedStandIn(torch.nn.Module):
    """What ``add_fused_lm_head`` patches: a backbone returning the hidden states the harness's model computed,
    and an LM head holding its weight."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor):
        super().__init__()
        self.config = SimpleNamespace(get_text_config=lambda: self.config, model_type="stand-in")
        self.base_model = lambda *a, **k: SimpleNamespace(last_hidden_state=hidden)
        self.lm_head = SimpleNamespace(weight=weight, bias=None)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, *args, **kwargs):
        raise NotImplementedError("only the fused forward (fused_lm_head=True) is used")


class TrlObject:
    def __init__(self, fused: bool):
        self.fused, self.trl = fused, _trl()

    def prepare_model_inputs(self, mb):
        f, pad = BatchFlags.from_batch(mb), self.trl.utils.pad
        for name in ("use_fused_kernels", "distillation_use_topk", "calculate_sum_pi_squared"):
            if getattr(f, name):
                raise NotImplementedError(f"{name}: TRL's log-prob API has no such option")
        args = {"temperature": one_temperature(mb), "packed": f.use_remove_padding}
        ids, pos = samples(mb, "input_ids"), samples(mb, "position_ids")
        if f.use_remove_padding:
            batch = self.trl.Collator(pad_token_id=f.pad_token_id, padding_free=True)(
                [{"input_ids": t.tolist()} for t in ids])
            positions = torch.cat(pos).T.unsqueeze(1) if pos[0].dim() == 2 else batch["position_ids"]
            args.update(labels=batch["labels"], rolled=torch.roll(batch["input_ids"], -1, 1).reshape(-1))
            return {"input_ids": batch["input_ids"], "position_ids": positions, "attention_mask": None}, args
        prompts, responses = samples(mb, "prompts"), samples(mb, "responses")
        completion_ids = pad(responses, f.pad_token_id, "right")
        input_ids = torch.cat([pad(prompts, f.pad_token_id, "left"), completion_ids], 1)
        mask = torch.cat([pad([torch.ones_like(p) for p in prompts], 0, "left"),
                          pad([torch.ones_like(r) for r in responses], 0, "right")], 1)
        positions = torch.cat([pad([q[:len(p)] for q, p in zip(pos, prompts)], 0, "left"),
                               pad([q[len(p):] for q, p in zip(pos, prompts)], 0, "right")], 1)
        args.update(input_ids=input_ids, attention_mask=mask, logits_to_keep=completion_ids.shape[1],
                    rolled=sequences_from_rows(torch.roll(input_ids, -1, 1), mb, PaddedLayout.LEFT_RIGHT).values())
        return {"input_ids": input_ids, "attention_mask": mask,
                "position_ids": positions.permute(2, 0, 1) if positions.dim() == 3 else positions}, args

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        a, entropy = output_args, BatchFlags.from_batch(mb).calculate_entropy
        out = dict(zip(("log_probs", "entropy"), (self._fused if self.fused else self._logits)(output, a, entropy)))
        if a["packed"]:  # the shifted row lacks the last token: one zero there
            offsets = mb["input_ids"].offsets()
            return {k: torch.nested.nested_tensor_from_jagged(torch.cat([v[0], v.new_zeros(1)]).float(), offsets)
                    for k, v in out.items() if v is not None}
        return {k: sequences_from_responses(v.float(), mb) for k, v in out.items() if v is not None}

    def _logits(self, output, a, entropy):
        utils = self.trl.utils
        if a["packed"]:
            labels = a["labels"]
            ids = torch.where(labels == -100, 0, labels)[:, 1:]  # the collator's labels hold the ids elsewhere
            row_mask = (labels[:, 1:] != -100).long()
            if entropy:
                return utils.selective_log_softmax_and_entropy(output.logits[:, :-1], ids, temperature=a["temperature"],
                                                               row_mask=row_mask)
            return utils.selective_log_softmax(output.logits[:, :-1], ids, a["temperature"], row_mask), None
        keep = a["logits_to_keep"]
        trainer = SimpleNamespace(model_kwarg_keys=(), temperature=a["temperature"])
        logits = self.trl.SDFT._forward_logits(trainer, lambda **_: output, a["input_ids"], a["attention_mask"], keep)
        logps = utils.selective_log_softmax(logits, a["input_ids"][:, -keep:])
        return logps, utils.entropy_from_logits(logits) if entropy else None

    def _fused(self, output, a, entropy):
        model = _FusedStandIn(output.hidden_states, output.lm_head_weight)
        self.trl.utils.add_fused_lm_head(model, temperature=a["temperature"], outputs=("log_probs", "entropy"))
        if a["packed"]:
            out = model(input_ids=None, labels=a["labels"], fused_lm_head=True)
            return out.log_probs, out.entropy if entropy else None
        trainer = SimpleNamespace(accelerator=SimpleNamespace(autocast=nullcontext))
        logps, ent, _ = self.trl.GRPO._get_per_token_logps_and_entropies.__wrapped__(
            trainer, model, a["input_ids"], a["attention_mask"], a["logits_to_keep"], compute_entropy=entropy)
        return logps, ent


class TrlEngine(EngineUnderTest):
    name = "trl"
    fused = False
    #: GRPO's batch: left-padded prompts, right-padded completions; both modes, both position kinds, autograd contexts
    profile = EngineProfile(padded_layouts=(PaddedLayout.LEFT_RIGHT,))
    output_span = OutputSpan.RESPONSE  # padded: completion-only log-probs (logits_to_keep = completion width)
    known_failures = LOGITS_RECORDS

    def make(self, head: str = "lm", **settings):
        if head != "lm" or any(v not in (None, False, 0, 1) for k, v in settings.items() if k != "sp_rank"):
            raise NotImplementedError(f"{self.name}: LM head, no engine settings (asked {head}, {settings})")
        return TrlObject(self.fused)

    def view_inputs(self, model_inputs, output_args) -> InputsView:  # labels: the next column, token by token
        return InputsView(model_inputs["input_ids"], model_inputs["position_ids"], model_inputs["attention_mask"],
                          labels=output_args["rolled"])

    def lacks(self, feature):
        feature = Feature.parse(feature)
        if feature in OFFERED:
            return super().lacks(feature)
        return REASONS.get(feature, f"TRL's {'fused head' if self.fused else 'logits API'} has no "
                                    f"{feature.value}")

    def strategy_limits(self):  # the features it lacks (REASONS) are not drawn: the base class reads lacks()
        return {**super().strategy_limits(), "per_sample_temperature": False}


REASONS = {
    Feature.SP: "sequence parallelism goes through accelerate's context parallelism, outside this API",
    Feature.VALUE: "no value head (TRL 1.16's GRPO/RLOO are critic-free)",
    Feature.FUSED: "TRL hands the model no temperature or shift_labels: its fused head is engine trl-fused",
    Feature.DISTILLATION: "no top-K logits processor",
    Feature.SUM_PI_SQUARED: "no sum of squared probabilities",
    Feature.TEMPERATURE_HANDOFF: "one float temperature per trainer (self.temperature); nothing is handed over",
    Feature.BUCKET: "no static bucket on this path",
    Feature.CU_SEQLENS: "the padding-free collator always hands flash-attention cu_seq_lens_q/k; no setting",
    Feature.CHUNKING: "entropy_from_logits' chunk_size bounds memory only; TRL exposes no setting for it here",
    Feature.PER_SAMPLE_TEMPERATURE: "one float temperature per trainer (GRPOConfig.temperature)",
}


class TrlFusedEngine(TrlEngine):
    name = "trl-fused"
    fused = True
    head_input = HeadInput.HIDDEN  # add_fused_lm_head scores hidden states with the LM-head weight
    known_failures = FUSED_RECORDS

