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
them (:mod:`spec.engines.skyrl.media`). Ulysses sequence parallelism runs on real ranks
(:mod:`spec.engines.skyrl.sequence_parallel`). spec/engines/skyrl/README.md.
"""

from __future__ import annotations

from types import SimpleNamespace

from ..kit.hf_batch import BatchFlags, one_temperature, samples, sequences_from_masked_rows
from ..kit import ThirdPartyEngine, inputs_seen_by_model, refuse_flags, replaying
from .config import batch_builder, collated_routes, num_actions, precision, replay_kwargs, rollout_routes
from .media import VisionModel, image_token_id, vlm_inputs, with_own_positions
from .records import REASONS, PROFILE, RECORDS, TRAIN_PROFILE
from .prescaled_step import PPO_UTILS, skyrl_step_layer
from .sequence_parallel import AloneOnItsRank, UlyssesOnRealRanks
from .step import SKYRL_STEP_RECORDS, skyrl_train_step_layer

__all__ = ["SkyRLTrainEngine", "SkyRLEngine"]
COLLATE = "convert_prompts_responses_to_batch_tensors"  # the batch builder, in both versions


class SkyRLObject(AloneOnItsRank):  # its Ulysses group (.sp): none, or set on real ranks (sequence_parallel.py)
    def __init__(self, engine: "SkyRLTrainEngine", **config):  # SkyRL's switches drawn (skyrl/config.py)
        self.new, (*_, self.wrapper, self.collate), self.config = engine.name == "skyrl", engine.load(), config

    def _forward(self, model, a, vocab=None):
        unpad = {"remove_microbatch_padding" if self.new else "use_sample_packing": a["packed"]}
        model = VisionModel(model, a["image_token_id"]) if a["vlm"] else model  # a VLM's config, images (media.py)
        wrapper = self.wrapper(model, use_flash_attention_2=a["packed"], sequence_parallel_size=self.sp.size, **unpad)
        wrapper.is_vlm = a["vlm"]  # as __init__ sets it from the config's vision_config
        replay = replay_kwargs(a["batch"], a["responses"], self.config, a["vlm"], vocab)  # config.py
        out = wrapper(a["sequences"], num_actions(self.config, a["num_actions"]), attention_mask=a["attention_mask"],
                      temperature=a["temperature"], return_output=a["entropy"], compute_entropy=a["entropy"],
                      **a["images"], **replay)  # the output only where the entropy rides on it, sliced as the worker does
        return (out[0], out[1]["entropy"][:, -a["num_actions"] - 1:-1]) if a["entropy"] else (out, None)

    def prepare_model_inputs(self, mb):
        f = refuse_flags(BatchFlags.from_batch(mb), "SkyRL's HFModelWrapper.forward")
        prompts, responses = [[t.tolist() for t in samples(mb, k)] for k in ("prompts", "responses")]
        pad = f.pad_token_id if self.new else SimpleNamespace(pad_token_id=f.pad_token_id)  # 0.3.1 takes a tokenizer
        batch = batch_builder(self.collate, pad, prompts, responses, self.config, self.new, rollout_routes(mb))
        (seqs, mask, response_mask), device = batch()[:3], mb["input_ids"].device  # config.py
        args = {"sequences": seqs.to(device), "attention_mask": mask.to(device), "packed": f.use_remove_padding,
                "num_actions": max(map(len, responses)), "temperature": one_temperature(mb), "batch": batch,
                "responses": responses, "entropy": f.calculate_entropy, "vlm": mb["position_ids"].dim() == 3,
                "image_token_id": image_token_id(mb), "response_mask": response_mask,  # its outputs read at the mask
                "images": vlm_inputs(mb, self.wrapper, self.config) if self.new else {}, "routes": collated_routes(batch)}
        # a VLM computes its own (mRoPE) positions: the stand-in is handed the samples' own (media.py)
        return with_own_positions(inputs_seen_by_model(lambda model: self._forward(model, args)), args, mb), args

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None):
        out = dict(zip(("log_probs", "entropy"), self._forward(replaying(output), output_args, output.logits.size(2))))
        return sequences_from_masked_rows(out, mb, output_args["response_mask"])  # read as SkyRL's trainer reads them


class SkyRLTrainEngine(UlyssesOnRealRanks, ThirdPartyEngine):  # Ulysses SP on real ranks (sequence_parallel.py)
    name, library, known_failures = "skyrl-train", "SkyRL's HFModelWrapper.forward", (*RECORDS, *SKYRL_STEP_RECORDS)
    wheel, ci_step, bert_padding, strict_stubs = "skyrl-train==0.3.1", "spec/engines/skyrl/ci.sh", True, False
    # they load models, start clusters, run environments (skyrl_gym: 0.4.0's loss config module imports it)
    heavy = ("transformers", "peft", "ray", "datasets", "flash_attn", "skyrl_gym")
    # the modules importing heavy packages first, then the wrapper and the batch builder
    modules = ("skyrl_train.distributed.ulysses.monkey_patch", "skyrl_train.utils.utils", "skyrl_train.dataset.dataset",
               "skyrl_train.model_wrapper:HFModelWrapper", f"skyrl_train.dataset.preprocess:{COLLATE}")
    profile = TRAIN_PROFILE  # prompts left-padded, responses right-padded; its surface (records.py)
    reasons = REASONS  # why it lacks the others (records.py, beside its profile)
    precision = staticmethod(precision)  # F22: in the logits' dtype (sample-support replay: float32, config.py)

    def engine_object(self, **config):
        return SkyRLObject(self, **config)

    def step_layer(self):  # skyrl-train 0.3.1's policy step (step.py), skyrl 0.4.0's (prescaled_step.py)
        return (skyrl_train_step_layer if self.name == "skyrl-train" else skyrl_step_layer)(self.load)


class SkyRLEngine(SkyRLTrainEngine):
    name, wheel, without_init = "skyrl", "skyrl==0.4.0", ("skyrl.backends",)  # its __init__: the Tinker API
    known_failures = RECORDS  # its step passes (skyrl-train's token_mean records do not apply: prescaled_step.py)
    modules = (PPO_UTILS, "skyrl.backends.skyrl_train.distributed.ulysses.monkey_patch", "skyrl.train.dataset.dataset",
               "skyrl.backends.skyrl_train.workers.model_wrapper:HFModelWrapper",
               f"skyrl.train.dataset.preprocess:{COLLATE}")
    profile = PROFILE  # whole rows left-padded (outputs right-aligned); a VLM's images padded only (skyrl/media.py)
