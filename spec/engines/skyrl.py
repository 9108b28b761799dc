"""SkyRL's ``HFModelWrapper.forward`` as engines: ``skyrl-train`` (skyrl-train 0.3.1) and ``skyrl`` (skyrl 0.4.0).

The batch is SkyRL's own (``convert_prompts_responses_to_batch_tensors``): 0.3.1 left-pads prompts and right-pads
responses (``PaddedLayout.LEFT_RIGHT``), 0.4.0 left-pads whole rows (``PaddedLayout.LEFT``). ``forward`` takes
``cumsum(mask) - 1`` positions (1 on padding), unpads with flash-attn's ``unpad_input`` when packing
(``use_sample_packing`` / ``remove_microbatch_padding``), divides the logits by the temperature in place, scores
``logprobs_from_logits`` and ``chunked_entropy_from_logits``, re-pads and keeps ``[:, -num_actions - 1:-1]`` (the
worker slices the entropy so): response-only outputs, 0.4.0's right-aligned. ``forward`` calls the model itself, so
it runs twice (``model_inputs_of``). Stubbed: transformers, peft, ray, datasets, flash-attn's CUDA package; 0.4.0's
``skyrl.backends/__init__`` (the Tinker API, pydantic models that need Python 3.12) is not run. docs/engines/skyrl.md.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from types import SimpleNamespace

import torch

from ..protocol import Feature, Precision, InputsView, OutputSpan, PaddedLayout, sequences_from_responses
from ..protocol.profile import EngineProfile
from .hf_batch import BatchFlags, OutputDict, install_bert_padding, left_aligned, model_inputs_of, one_temperature, samples
from .kit import ThirdPartyEngine, refuse_flags
from .skyrl_records import RECORDS
from .stubs import import_with_stubs

__all__ = ["SkyRLTrainEngine", "SkyRLEngine"]

HEAVY = ("transformers", "peft", "ray", "datasets", "flash_attn")
#: per version: the modules to import (those importing heavy packages first), the wrapper's, the batch builder's
MODULES = {"skyrl-train": ("skyrl_train.distributed.ulysses.monkey_patch", "skyrl_train.utils.utils",
                           "skyrl_train.dataset.dataset", "skyrl_train.model_wrapper", "skyrl_train.dataset.preprocess"),
           "skyrl": ("skyrl.backends.skyrl_train.distributed.ulysses.monkey_patch", "skyrl.train.dataset.dataset",
                     "skyrl.backends.skyrl_train.workers.model_wrapper", "skyrl.train.dataset.preprocess")}
WHEELS = {"skyrl-train": "skyrl-train==0.3.1", "skyrl": "skyrl==0.4.0"}


@lru_cache(maxsize=None)
def _skyrl(name: str):
    install_bert_padding(name)
    try:
        if name == "skyrl" and "skyrl.backends" not in sys.modules:  # the package without its __init__ (Tinker API)
            sys.modules["skyrl.backends"] = importlib.util.module_from_spec(importlib.util.find_spec("skyrl.backends"))
        *_, wrapper, preprocess = [import_with_stubs(m, HEAVY).module for m in MODULES[name]]
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"--engine {name} needs {WHEELS[name]} (.ci/steps/engines-skyrl.sh): {exc}") from exc
    return wrapper.HFModelWrapper, preprocess.convert_prompts_responses_to_batch_tensors


class SkyRLObject:
    def __init__(self, engine: "SkyRLTrainEngine"):
        self.new, (self.wrapper, self.collate) = engine.name == "skyrl", _skyrl(engine.name)

    def _forward(self, model, a):
        unpad = {"remove_microbatch_padding" if self.new else "use_sample_packing": a["packed"]}
        wrapper = self.wrapper(model, use_flash_attention_2=a["packed"], **unpad)
        return wrapper(a["sequences"], a["num_actions"], attention_mask=a["attention_mask"],
                       temperature=a["temperature"], return_output=True, compute_entropy=a["entropy"])

    def prepare_model_inputs(self, mb):
        f = refuse_flags(BatchFlags.from_batch(mb), "SkyRL's HFModelWrapper.forward")
        prompts, responses = [[t.tolist() for t in samples(mb, k)] for k in ("prompts", "responses")]
        pad = f.pad_token_id if self.new else SimpleNamespace(pad_token_id=f.pad_token_id)  # 0.3.1 takes a tokenizer
        seqs, mask = self.collate(pad, prompts, responses, [[0.0] * len(r) for r in responses],
                                  [[1] * len(r) for r in responses])[:2]
        device = mb["input_ids"].device
        args = {"sequences": seqs.to(device), "attention_mask": mask.to(device), "packed": f.use_remove_padding,
                "num_actions": max(map(len, responses)), "temperature": one_temperature(mb),
                "entropy": f.calculate_entropy}
        return model_inputs_of(lambda model: self._forward(model, args)), args

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        a, result = output_args, OutputDict(vars(output))
        log_probs, out = self._forward(lambda *_, **__: result, a)
        outputs = {"log_probs": log_probs}
        if a["entropy"]:  # the worker's slice (PolicyWorkerBase.forward_backward)
            outputs["entropy"] = out["entropy"][:, -a["num_actions"] - 1:-1]
        lens = mb["responses"].offsets().diff()
        return {k: sequences_from_responses(left_aligned(v, lens) if self.new else v, mb) for k, v in outputs.items()}


class SkyRLTrainEngine(ThirdPartyEngine):
    name, library, known_failures = "skyrl-train", "SkyRL's HFModelWrapper.forward", RECORDS
    output_span = OutputSpan.RESPONSE  # log_probs[:, -num_actions - 1:-1]
    # prompts left-padded, responses right-padded; no VLM path: 1-D positions
    profile = EngineProfile(padded_layouts=(PaddedLayout.LEFT_RIGHT,), positions=("rope",))
    reasons = {
        Feature.SP: "Ulysses sequence parallelism needs a process group (not run here)",
        Feature.VALUE: "the critic is another model class (get_llm_for_sequence_regression), not HFModelWrapper",
        Feature.TEMPERATURE_HANDOFF: "one float temperature per forward call; nothing is handed over",
        Feature.CU_SEQLENS: "the unpadded path hands the model no cu_seqlens (flash-attn finds them from positions)",
        Feature.PER_SAMPLE_TEMPERATURE: "one float temperature per forward call (the sampling temperature)",
    }

    def engine_object(self):
        return SkyRLObject(self)

    def precision(self, key, case):  # F22: log-probs and entropy taken and returned in the logits' dtype
        return Precision(case.logits_dtype, case.logits_dtype)

    def view_inputs(self, model_inputs, output_args) -> InputsView:
        labels = torch.roll(output_args["sequences"], -1, 1)[output_args["attention_mask"].bool()]
        return InputsView(model_inputs["input_ids"], model_inputs["position_ids"], model_inputs["attention_mask"],
                          labels=labels)


class SkyRLEngine(SkyRLTrainEngine):
    name = "skyrl"
    # whole rows left-padded (outputs right-aligned in (B, max r_i)); the VLM path (is_vlm) is not run
    profile = EngineProfile(padded_layouts=(PaddedLayout.LEFT,), positions=("rope",))
