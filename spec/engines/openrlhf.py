"""OpenRLHF 0.11.2's ``openrlhf.models.actor.Actor.forward`` as an engine under test (``--engine openrlhf``).

``Actor.forward(sequences, attention_mask=...)`` does the whole preparation: packed (``packing_samples``) it unpads
the dense rows with flash-attn's ``unpad_input`` (positions from the mask's cumsum, labels the dense rows rolled
before unpadding), padded it hands the rows and ``cumsum(mask) - 1`` positions; then it casts the logits to
float32, divides them by its one temperature (``div_``), takes ``compute_entropy`` and ``log_probs_from_logits``,
re-pads packed outputs with ``pad_input`` and drops the last column. The batch is OpenRLHF's own: whole
sequences right-padded by ``openrlhf.utils.utils.zero_pad_sequences`` (as ``make_experience_batch`` merges
samples). ``return_logprobs=True`` without an ``action_mask`` returns every position (with one, the same
log-probs times the mask).

The model runs between the suite's two steps, so ``forward`` runs twice: ``prepare_model_inputs`` runs it
with a model that records what it is handed and stops; ``prepare_model_outputs`` runs it again with a model
that returns the harness's output. Module-level imports that do not import here (transformers, peft,
deepspeed, flash-attn's CUDA package) are stubbed; flash-attn's pure-torch ``bert_padding`` is the real file
from the flash-attn 2.8.3 sdist (installed as ``flash_attn_bert_padding``, the `trl-openrlhf` CI step), since
the packed path runs it. A vision model (mRoPE positions) computes its own positions in the padded path
(``is_vlm``): the adapter hands the stand-in model the sample's own. docs/engines/openrlhf.md.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from unittest import mock

import torch

from ..protocol import EngineUnderTest, Feature, InputsView, sequences_from_rows
from .hf_batch import BatchFlags, one_temperature
from .openrlhf_records import RECORDS
from .stubs import import_with_stubs

__all__ = ["OpenRLHFEngine"]

PACKAGES = ("peft", "transformers", "deepspeed", "flash_attn")
#: compute_entropy is @torch.compile'd: every new (n, V) shape would compile it (seconds each on CPU); its code
#: runs eagerly instead (the same torch calls; a compiled kernel may round differently)
EAGER = torch._dynamo.config.patch(disable=True)


@lru_cache(maxsize=1)
def _openrlhf():
    try:
        import flash_attn_bert_padding
    except ImportError as exc:
        raise ImportError("--engine openrlhf needs flash-attn 2.8.3's bert_padding.py installed as the module "
                          "flash_attn_bert_padding (the trl-openrlhf CI step, .ci/steps/bert_padding.py)") from exc
    if not isinstance(sys.modules.get("flash_attn.bert_padding"), type(flash_attn_bert_padding)):
        sys.modules.setdefault("flash_attn", mock.MagicMock(name="flash_attn", __path__=[], __spec__=None))
        sys.modules["flash_attn.bert_padding"] = flash_attn_bert_padding
    for name in ("pylatexenc", "pylatexenc.latex2text"):  # openrlhf.utils' math grader, never run here
        sys.modules.setdefault(name, mock.MagicMock(name=name))
    actor = import_with_stubs("openrlhf.models.actor", PACKAGES).module
    return actor.Actor, import_with_stubs("openrlhf.utils.utils", PACKAGES).module.zero_pad_sequences


class _Stop(Exception):
    pass


class _Recorder:
    """The model of the input step: records what ``forward`` hands it, then stops ``forward``."""

    def __call__(self, input_ids, attention_mask=None, position_ids=None, **_):
        self.inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        raise _Stop


class _Output(dict):
    """A ``ModelOutput``-like result: ``output["logits"]`` and ``output.entropy`` both work."""

    __getattr__ = dict.get

    def __setattr__(self, key, value):
        self[key] = value


class OpenRLHFObject:
    def __init__(self):
        self.actor_class, self.zero_pad = _openrlhf()

    def _actor(self, model, args):
        actor = self.actor_class(model, temperature=args["temperature"])
        actor.packing_samples, actor.is_vlm = args["packed"], args["vlm"]
        return actor

    def prepare_model_inputs(self, mb):
        f = BatchFlags.from_batch(mb)
        for name in ("use_fused_kernels", "distillation_use_topk", "calculate_sum_pi_squared"):
            if getattr(f, name):
                raise NotImplementedError(f"{name}: OpenRLHF's Actor.forward has no such option")
        seqs, pos = mb["input_ids"].unbind(), mb["position_ids"].unbind()
        args = {"temperature": one_temperature(mb), "packed": f.use_remove_padding, "vlm": pos[0].dim() == 2,
                "sequences": self.zero_pad(list(seqs), "right", value=f.pad_token_id, stack=True),
                "attention_mask": self.zero_pad([torch.ones_like(s) for s in seqs], "right", stack=True)}
        args["vlm"] = args["vlm"] and not args["packed"]  # packed, forward computes 1-D positions for any model
        recorder = _Recorder()
        try:
            with EAGER:
                self._actor(recorder, args)(args["sequences"], attention_mask=args["attention_mask"],
                                            return_output=True)
        except _Stop:
            pass
        inputs = dict(recorder.inputs)
        if args["vlm"]:  # the vision model's own (mRoPE) positions
            inputs["position_ids"] = self.zero_pad(list(pos), "right", stack=True).transpose(0, 1)
        return inputs, args

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        a, entropy = output_args, BatchFlags.from_batch(mb).calculate_entropy
        result = _Output(vars(output))
        with EAGER:
            log_probs, out = self._actor(lambda *_, **__: result, a)(
                a["sequences"], attention_mask=a["attention_mask"], return_output=True, return_logprobs=True,
                return_entropy=entropy)
        outputs = {"log_probs": log_probs, "entropy": out.entropy if entropy else None}
        # (B, L - 1) rows: the last column (the longest row's last token, scoring nothing) is never computed
        return {k: sequences_from_rows(torch.cat([v, v.new_zeros(len(v), 1)], 1).float(), mb)
                for k, v in outputs.items() if v is not None}


class OpenRLHFEngine(EngineUnderTest):
    name = "openrlhf"
    known_failures = RECORDS

    def make(self, head: str = "lm", **settings):
        if head != "lm" or any(v not in (None, False, 0, 1) for k, v in settings.items() if k != "sp_rank"):
            raise NotImplementedError(f"openrlhf: LM head, no engine settings (asked {head}, {settings})")
        return OpenRLHFObject()

    def view_inputs(self, model_inputs, output_args) -> InputsView:
        rolled = torch.roll(output_args["sequences"], -1, dims=1)
        labels = rolled[output_args["attention_mask"].bool()]  # the labels forward scores, token by token
        return InputsView(model_inputs["input_ids"], model_inputs["position_ids"], model_inputs["attention_mask"],
                          labels=labels)

    def lacks(self, feature):
        feature = Feature.parse(feature)
        if feature in (Feature.ENGINE, Feature.CUDA):
            return super().lacks(feature)
        return REASONS.get(feature, f"OpenRLHF's Actor.forward has no {feature.value}")

    def strategy_limits(self):  # the features it lacks (REASONS) are not drawn: the base class reads lacks()
        return {**super().strategy_limits(), "per_sample_temperature": False}


REASONS = {
    Feature.SP: "ring attention needs ring_flash_attn and a process group (not run here)",
    Feature.VALUE: "the critic is another model class (get_llm_for_sequence_regression), not Actor.forward",
    Feature.TEMPERATURE_HANDOFF: "one float temperature per actor (self.temperature); nothing is handed over",
    Feature.CU_SEQLENS: "the packed path hands the model no cu_seqlens (flash-attn finds them from positions)",
    Feature.PER_SAMPLE_TEMPERATURE: "one float temperature per actor (Actor(temperature=...))",
}
