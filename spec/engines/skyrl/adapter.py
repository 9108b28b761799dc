"""SkyRL's ``HFModelWrapper.forward`` as engines: ``skyrl-train`` (skyrl-train 0.3.1) and ``skyrl`` (skyrl 0.4.0).

The batch is SkyRL's own (``convert_prompts_responses_to_batch_tensors``): 0.3.1 left-pads prompts and right-pads
responses (``PaddedLayout.LEFT_RIGHT``), 0.4.0 left-pads whole rows (``PaddedLayout.LEFT``). ``forward`` takes
``cumsum(mask) - 1`` positions (1 on padding), unpads with flash-attn's ``unpad_input`` when packing
(``use_sample_packing`` / ``remove_microbatch_padding``), divides the logits by the temperature in place, scores
``logprobs_from_logits`` and ``chunked_entropy_from_logits``, re-pads and keeps ``[:, -num_actions - 1:-1]`` (the
worker slices the entropy so): response-only outputs, 0.4.0's right-aligned. ``forward`` calls the model itself, so
it runs twice (``inputs_seen_by_model``, ``replaying``). The kit's loader (``ThirdPartyEngine.load``) imports the modules
with transformers, peft, ray, datasets and flash-attn's CUDA package stubbed, flash-attn's ``bert_padding`` installed;
0.4.0's ``skyrl.backends/__init__`` (the Tinker API, pydantic models that need Python 3.12) is not run. An mRoPE
micro-batch is a vision-language model's (0.4.0's ``is_vlm`` path, padded only), its images as SkyRL's backend hands
them (:mod:`spec.engines.skyrl.media`). docs/engines/skyrl.md.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

from ..kit.hf_batch import BatchFlags, one_temperature, samples, sequences_from_response_rows
from ..kit import ThirdPartyEngine, in_logits_dtype, inputs_seen_by_model, refuse_flags, replaying, rows_view
from .media import VisionModel, image_token_id, vlm_inputs, with_own_positions
from .records import REASONS, PROFILE, RECORDS, TRAIN_PROFILE
from .step import SKYRL_STEP_RECORDS, skyrl_train_step_layer

__all__ = ["SkyRLTrainEngine", "SkyRLEngine"]
COLLATE = "convert_prompts_responses_to_batch_tensors"  # the batch builder, in both versions


class SkyRLObject:
    def __init__(self, engine: "SkyRLTrainEngine"):
        self.new, (*_, self.wrapper, self.collate) = engine.name == "skyrl", engine.load()

    def _forward(self, model, a):
        unpad = {"remove_microbatch_padding" if self.new else "use_sample_packing": a["packed"]}
        model = VisionModel(model, a["image_token_id"]) if a["vlm"] else model  # a VLM's config, images (media.py)
        wrapper = self.wrapper(model, use_flash_attention_2=a["packed"], **unpad)
        wrapper.is_vlm = a["vlm"]  # as __init__ sets it from the config's vision_config
        return wrapper(a["sequences"], a["num_actions"], attention_mask=a["attention_mask"],
                       temperature=a["temperature"], return_output=True, compute_entropy=a["entropy"], **a["images"])

    def prepare_model_inputs(self, mb):
        f = refuse_flags(BatchFlags.from_batch(mb), "SkyRL's HFModelWrapper.forward")
        prompts, responses = [[t.tolist() for t in samples(mb, k)] for k in ("prompts", "responses")]
        pad = f.pad_token_id if self.new else SimpleNamespace(pad_token_id=f.pad_token_id)  # 0.3.1 takes a tokenizer
        seqs, mask = self.collate(pad, prompts, responses, [[0.0] * len(r) for r in responses],
                                  [[1] * len(r) for r in responses])[:2]
        device = mb["input_ids"].device
        args = {"sequences": seqs.to(device), "attention_mask": mask.to(device), "packed": f.use_remove_padding,
                "num_actions": max(map(len, responses)), "temperature": one_temperature(mb),
                "entropy": f.calculate_entropy, "vlm": mb["position_ids"].dim() == 3, "image_token_id": image_token_id(mb),
                "images": vlm_inputs(mb, sys.modules[self.wrapper.__module__].TensorList) if self.new else {}}
        # a VLM computes its own (mRoPE) positions: the stand-in is handed the samples' own (media.py)
        return with_own_positions(inputs_seen_by_model(lambda model: self._forward(model, args)), args, mb), args

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        a = output_args
        log_probs, out = self._forward(replaying(output), a)
        entropy = out["entropy"][:, -a["num_actions"] - 1:-1] if a["entropy"] else None  # the worker's slice
        return sequences_from_response_rows({"log_probs": log_probs, "entropy": entropy}, mb, right_aligned=self.new)


class SkyRLTrainEngine(ThirdPartyEngine):
    name, library, known_failures = "skyrl-train", "SkyRL's HFModelWrapper.forward", (*RECORDS, *SKYRL_STEP_RECORDS)
    wheel, ci_step, bert_padding, strict_stubs = "skyrl-train==0.3.1", ".ci/steps/engines-skyrl.sh", True, False
    heavy = ("transformers", "peft", "ray", "datasets", "flash_attn")  # they load models and start clusters
    # the modules importing heavy packages first, then the wrapper and the batch builder
    modules = ("skyrl_train.distributed.ulysses.monkey_patch", "skyrl_train.utils.utils", "skyrl_train.dataset.dataset",
               "skyrl_train.model_wrapper:HFModelWrapper", f"skyrl_train.dataset.preprocess:{COLLATE}")
    profile = TRAIN_PROFILE  # prompts left-padded, responses right-padded; its surface (records.py)
    reasons = REASONS  # why it lacks the others (records.py, beside its profile)
    precision = staticmethod(in_logits_dtype)  # F22: log-probs and entropy taken and returned in the logits' dtype
    view_inputs = staticmethod(rows_view)  # the labels forward scores: its rows rolled by one

    def engine_object(self):
        return SkyRLObject(self)

    def step_layer(self):  # skyrl-train 0.3.1's policy step (step.py); skyrl 0.4.0's is not declared
        return skyrl_train_step_layer(self.load) if self.name == "skyrl-train" else None


class SkyRLEngine(SkyRLTrainEngine):
    name, wheel, without_init = "skyrl", "skyrl==0.4.0", ("skyrl.backends",)  # its __init__: the Tinker API
    known_failures = RECORDS  # no step declared (skyrl-train's step records do not apply)
    modules = ("skyrl.backends.skyrl_train.distributed.ulysses.monkey_patch", "skyrl.train.dataset.dataset",
               "skyrl.backends.skyrl_train.workers.model_wrapper:HFModelWrapper",
               f"skyrl.train.dataset.preprocess:{COLLATE}")
    profile = PROFILE  # whole rows left-padded (outputs right-aligned); a VLM's images padded only (skyrl/media.py)
