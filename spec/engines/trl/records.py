"""Known-failure records of TRL 1.16 (engines ``trl`` and ``trl-fused``); spec/engines/trl/README.md reproduces each in
plain torch. Each names the invariants whose check compares an output with the per-sequence oracle."""

from __future__ import annotations

from ...protocol.profile import Feature

from dataclasses import replace
from itertools import accumulate

from ...protocol.engine import EngineUnderTest, OutputSpan, PaddedLayout
from ...protocol.known import KnownFailure, When
from ...protocol.profile import drawn_config, equivalents_on
from ..kit.records import CANCELLATION, LOW_PRECISION_LOGITS, MISMATCH, ORACLE_INVARIANTS, UNCLAMPED, VALUE_MISMATCH
from .config import DETACHED_ENTROPY, GRPO_ROWS, HEAD_IN_LOGITS_DTYPE, METRICS_ONLY, TRL_SWITCHES

__all__ = ["REASONS", "LOGITS_RECORDS", "FUSED_RECORDS", "PROFILE", "FUSED_SURFACE", "FUSED_UNREACHABLE",
           "FUSED_EQUIVALENT_MUTANTS", "FUSED_OFF_PATH", "PER_SAMPLE_LAYOUT"]

IN_LOGITS_DTYPE = ("selective_log_softmax and entropy_from_logits compute in the logits' dtype (a per-row "
                   "log_softmax in bf16/fp16; outputs bf16/fp16): up to 0.06 nats of log-prob error in bf16, and "
                   "fp16 logits divided by T = 1e-8 overflow to inf, NaN log-probs; library difference (the "
                   "contract upcasts to float32)")
NO_CLAMP = ("the temperature divides the logits as given, with no 1e-8 clamp: T = 5e-9 doubles the log-probs of "
            "the clamped contract; library difference")
FUSED_HEAD_DTYPE = ("add_fused_lm_head projects the hidden states through the LM head in their own dtype (torch.mm into a "
                    "bf16/fp16 tile) unless cast_lm_head_to_fp32=True (GRPOConfig's default is False): the logits are "
                    "rounded to bf16 before the float32 softmax (4e-4 nats at V = 2); library difference (the "
                    "contract computes the product in float32)")
FUSED_ENTROPY = ("the fused head's entropy is log_z - sum(p z) / sum(p) in float32: two large, nearly equal terms at "
                 "low temperature (two tied top logits, true entropy ln 2: 0.6875 at T = 1e-6, 0 at T = 1e-8); "
                 "library bug (precision)")

DETACHED = ("selective_log_softmax_and_entropy(entropy_requires_grad=False), TPO's call, computes the entropy under "
            "torch.no_grad: the entropy is a metric only, detached (no loss term can backpropagate through it); "
            "library difference (the contract's entropy carries the logits' gradient, for an entropy bonus)")

SFT_METRICS = ("SFTTrainer with compute_loss_func (or label smoothing) trains on the user's loss of the unpatched "
               "forward's logits and runs the fused forward under torch.no_grad for its metrics: the fused log-probs "
               "and entropy are detached; library design (the contract's log-probs carry the gradient)")

UNCHECKED_TEMPERATURE = ("GRPO's completion scoring (SDFT's _forward_logits: logits / self.temperature, then "
                         "selective_log_softmax at T = 1) takes a temperature <= 0 without a check: T = 0 gives "
                         "inf/NaN log-probs, silently, where the SFT path's selective_log_softmax(temperature=T) "
                         "raises 'temperature must be positive' and GRPOConfig validates nothing; library bug (a "
                         "greedy rollout's T = 0 reaches the loss as NaN; TRL #3640 reports T near 0, not this)")

FUSED_TEMPERATURE = ("add_fused_lm_head scales the logits by 1/temperature with no check: a negative temperature "
                     "scores the inverted distribution (finite log-probs, silently wrong), T = 0 raises "
                     "ZeroDivisionError; library bug (the unfused selective_log_softmax raises 'temperature must be "
                     "positive')")

PER_SAMPLE_AS_PER_IMAGE = (
    "GRPO's chunked scoring (_get_per_token_logps_and_entropies(batch_size=per_device_train_batch_size), the "
    "generation batch's old and reference log-probs) tells a flat pixel_values, one entry per image (LLaVA's), from a "
    "padded one, one entry per sample (Idefics3's, SmolVLM's), by pixel_values.size(0) == sum(num_images): where a "
    "batch's images number its rows but are spread unevenly over them (two, none, one), Idefics3's pixel_values is "
    "sliced on image boundaries while its pixel_attention_mask is sliced on rows, and the first chunk whose image "
    "range is not its row range hands the model image slots of other rows beside a mask of other shape (Idefics3's "
    "get_image_features raises IndexError); library bug (the heuristic of TRL #6570, which split the two layouts; "
    "unsloth #11031 names the same collision, counts summing to the batch size, in its own split)")


def _per_sample_as_per_image(case) -> bool:
    """Idefics3's layout (``vision_family``) scored in chunks (``score_chunk``) where the images number the rows and
    some chunk's image range is not its row range."""
    config, rows = drawn_config(case), len(case.prompt_lens)
    chunk = config.get("score_chunk")
    if config.get("vision_family") != "idefics3" or not chunk or case.use_remove_padding or not case.media:
        return False
    images = [0, *accumulate(sum(item.kind == "image" for item in items) for items in case.media)]
    return images[-1] == rows and any(images[min(s + chunk, rows)] - images[s] != min(s + chunk, rows) - s
                                      for s in range(0, rows, chunk))


#: every engine-case check the scoring runs under: the model call raises, before any output
PER_SAMPLE_LAYOUT = When("Idefics3's per-sample pixel_values scored in chunks, its images as many as its rows but "
                         "spread unevenly", _per_sample_as_per_image)
_LAYOUT_CHECKS = ("INV-BATCH-001", "INV-BATCH-002", "INV-BATCH-003", "INV-DEV-001", "INV-EDGE-001", "INV-FLAG-001",
                  "INV-FLAG-002", "INV-FLAG-004", "INV-FLAG-005", "INV-GRAD-001", "INV-INPUT-001", "INV-INPUT-002",
                  "INV-KEYS-001", "INV-LABEL-001", "INV-LAYOUT-001", "INV-LEAK-001", "INV-LEAK-002", "INV-MASK-001",
                  "INV-MASK-002", "INV-MASK-003", "INV-MM-001", "INV-MM-002", "INV-MUT-001", "INV-MUT-004",
                  "INV-MUT-005", "INV-POS-001", "INV-SLICE-006", "INV-TEMP-001", "INV-TEMP-003", "INV-TEMP-006",
                  "INV-VAL-001", "INV-VAL-002")
_SLOTS = r"pixel_values \(.*\) and pixel_attention_mask \(.*\) hold other image slots"

#: (INV-VAL-001 and INV-SLICE-006 read log-probs of drawn labels only: a label that is its row's argmax scores 0 at
#: any T below the clamp, so the failure is possible, not certain; measured: a ci run whose packed INV-VAL-001
#: examples under the condition all passed. INV-TEMP-006 draws its cases at the clamp to show it.)
_UNCLAMPED = tuple(KnownFailure(inv, NO_CLAMP, matches=MISMATCH, when=UNCLAMPED, certain=inv == "INV-TEMP-006")
                   for inv in ("INV-VAL-001", "INV-TEMP-006", "INV-SLICE-006"))

LOGITS_RECORDS: tuple[KnownFailure, ...] = (
    *(KnownFailure(inv, IN_LOGITS_DTYPE, matches=MISMATCH, when=LOW_PRECISION_LOGITS) for inv in ORACLE_INVARIANTS),
    *_UNCLAMPED,
    KnownFailure("INV-GRAD-001", DETACHED, matches=r"output 'entropy' does not require grad", when=DETACHED_ENTROPY),
    KnownFailure("INV-FLAG-004", UNCHECKED_TEMPERATURE, matches=r"temperature=0\.0 .* was accepted silently",
                 when=GRPO_ROWS))

FUSED_RECORDS: tuple[KnownFailure, ...] = (
    *(KnownFailure(inv, FUSED_HEAD_DTYPE, matches=MISMATCH, when=LOW_PRECISION_LOGITS & HEAD_IN_LOGITS_DTYPE)
      for inv in ORACLE_INVARIANTS),
    *_UNCLAMPED,
    KnownFailure("INV-VAL-002", FUSED_ENTROPY, matches=VALUE_MISMATCH, when=CANCELLATION, certain=False),
    KnownFailure("INV-GRAD-001", SFT_METRICS, matches=r"output '(log_probs|entropy)' does not require grad",
                 when=METRICS_ONLY),
    KnownFailure("INV-FLAG-004", FUSED_TEMPERATURE, matches=r"temperature=-1\.0 .* was accepted silently"),
    *(KnownFailure(inv, PER_SAMPLE_AS_PER_IMAGE, raises=(ValueError, AssertionError), matches=_SLOTS,
                   when=PER_SAMPLE_LAYOUT, modes=("padded",)) for inv in _LAYOUT_CHECKS))

#: TRL's preparation the adapters run, whose lines and branches ``spec verify`` measures (the profile's surface,
#: spec/run/engine_coverage.py): the batch builders (both engines), then each engine's scoring: ``trl`` the logits
#: API (SDFT's logits, the log-softmax and entropy helpers), ``trl-fused`` GRPO's fused LM head
_BATCH = ("trl.trainer.utils:pad", "trl.trainer.sft_trainer:DataCollatorForLanguageModeling.torch_call",
          "trl.trainer.sft_trainer:DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths")
SURFACE = (*_BATCH, *(f"trl.trainer.utils:{f}" for f in ("selective_log_softmax", "entropy_from_logits",
                                                         "selective_log_softmax_and_entropy")),
           "trl.experimental.sdft.sdft_trainer:SDFTTrainer._forward_logits")
FUSED_SURFACE = (*_BATCH, "trl.trainer.utils:add_fused_lm_head",
                 "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies")

#: branches of the surfaces no CPU run of the suite reaches (TRL 1.16.0's lines), each with its reason (a ``gap:``
#: reason names the input a real trainer sends that the case space does not draw yet)
_U, _SFT, _GRPO = "trl.trainer.utils", "trl.trainer.sft_trainer", "trl.trainer.grpo_trainer"
_TRITON = "needs Triton on a CUDA device (_supports_trl_loss_kernel: TRL's fused log-prob/entropy kernel)"
_BATCH_UNREACHABLE: dict[str, str] = {
    "*:raise": "an error path: TRL raises for an input it rejects (a temperature <= 0, a padding_side other than "
               "left/right); the suite's valid cases never take it",
}
_LOGITS_UNREACHABLE: dict[str, str] = {
    f"{_U}:572->573": _TRITON, f"{_U}:625->626": _TRITON, f"{_U}:699->700": _TRITON,
}
_PLAIN_FORWARD = ("the unpatched forward handed labels, shift_labels or num_items_in_batch, Hugging Face's own "
                  "loss; no TRL 1.16 trainer calls it so (SFT, DPO, KTO, RLOO and GRPO pass labels with "
                  "fused_lm_head=True; SFT's compute_loss_func path, drawn, and generation hand it none): only a "
                  "user's own model(..., labels=...) call")
_FUSED_UNREACHABLE: dict[str, str] = {
    f"{_U}:1669->1670": "an MoE model under transformers < 5 (its num_experts read off the model; the suite runs "
                        "transformers 5)",
    f"{_U}:1674->1677": "another model family: GPT-OSS's config (model_type gpt_oss, no num_experts) under "
                        "transformers 5.0 to 5.5 (the suite runs 5.25; the stand-in's MoE config is Qwen3-MoE's)",
    f"{_U}:1594": "a vision-language model's text config under transformers < 5 (the suite runs transformers 5)",
    f"{_U}:1636": "needs FSDP2's sharded LM head (a DTensor weight on a device mesh)",
    f"{_U}:1638": "needs FSDP2's sharded LM head (a DTensor weight on a device mesh)",
    f"{_U}:1655->1658": "needs Triton on a CUDA device (_use_triton: only the valid positions are scored, compact)",
}

#: the exits of trl-fused's on-path add_fused_lm_head that only a caller outside the preparation takes (not counted)
FUSED_OFF_PATH: dict[str, str] = {f"{_U}:{line}": _PLAIN_FORWARD for line in ("1603->1604", "1605->1606", "1607->1608")}

#: survivors of ``spec mutate --engine trl`` that no input tells from TRL's code, each with why (by mutant id)
_ONE_DIM = "are 1-D tensors, one per example: torch.cat along dim 0 is along dim -1"
EQUIVALENT_MUTANTS: dict[str, str] = {
    f"{_SFT}:DataCollatorForLanguageModeling.torch_call:190 dim: dim -> other dim":
        f"the examples' input_ids {_ONE_DIM}",
    f"{_SFT}:DataCollatorForLanguageModeling.torch_call:191 dim: dim -> other dim": f"the examples' labels {_ONE_DIM}",
    f"{_U}:entropy_from_logits:642 dim: dim -> other dim":
        "each chunk's entropy is 1-D (a slice of the flattened logits' rows): torch.cat along dim 0 is along dim -1",
    f"{_SFT}:DataCollatorForLanguageModeling.torch_call:192 dim: dim -> other dim":
        f"the examples' position_ids (an arange each, or the packer's split of one 1-D cumsum) {_ONE_DIM}",
    f"{_U}:pad:176 dtype: dtype= dropped":
        "every tensor the preparation pads is int64 (token ids, GRPO's and SFT's masks of ones_like ids, labels, "
        "position ids) with an int padding value, so torch.full infers the same int64 without dtype=",
    f"{_U}:pad:188 slice: slice lower + 1":
        "the mutant drops the slice of the first trailing dim (t.shape[2:]): every tensor the preparation pads is 1-D "
        "(ids, masks, labels) or 2-D of one width in every sample (mRoPE positions (j, 4)), so output[i][seq_slice] "
        "fills the same entries (3-D tensors, or 2-D ones of different widths, would tell them apart; none here)",
    f"{_U}:selective_log_softmax:599 inplace: .masked_fill -> .masked_fill_":
        "per_token_logps is a fresh result (a subtraction or a torch.stack, squeezed): nothing else holds it, and "
        "masking it in place gives the same values and the same gradient (MaskedFillBackward either way)",
    f"{_U}:selective_log_softmax_and_entropy:711 inplace: .masked_fill -> .masked_fill_":
        "entropy is a fresh result (entropy_from_logits' torch.cat, reshaped): nothing else holds it, and masking it "
        "in place gives the same values and the same gradient",
    "trl.experimental.sdft.sdft_trainer:SDFTTrainer._forward_logits:1103 dict key: key 'use_cache' dropped":
        "use_cache only decides whether the forward also builds and returns a KV cache (past_key_values); the "
        "logits SDFT reads are the same either way",
}

#: survivors of ``spec mutate --engine trl-fused`` that no input tells from TRL's code, each with why (by mutant id)
_UNPATCHED_NONE = ("handed the unpatched forward as None (the mutant adds the keyword where it is None): a Hugging "
                   "Face causal LM reads it only to compute a loss from labels, and the path that calls the unpatched "
                   "forward (SFT's compute_loss_func logits) hands no labels; None is the keyword's own default")
_AT_FIVE = ("Version(transformers.__version__) < Version('5.0.0') and <= differ only under transformers 5.0.0 "
            "itself; the installed 5.25 is above both")
FUSED_EQUIVALENT_MUTANTS: dict[str, str] = {
    # trl's own on the batch builders both surfaces share (an id is "module:function:LINE operator: ...")
    **equivalents_on(EQUIVALENT_MUTANTS, _BATCH),
    f"{_U}:add_fused_lm_head:1603 branch: condition negated": "labels " + _UNPATCHED_NONE,
    f"{_U}:add_fused_lm_head:1605 branch: condition negated": "shift_labels " + _UNPATCHED_NONE,
    f"{_U}:add_fused_lm_head:1594 compare: Lt -> LtE": _AT_FIVE,
    f"{_U}:add_fused_lm_head:1669 compare: Lt -> LtE": _AT_FIVE,
    f"{_U}:add_fused_lm_head:1607 branch: condition negated": "num_items_in_batch " + _UNPATCHED_NONE,
    f"{_U}:add_fused_lm_head:1662 inplace: .clamp -> .clamp_":
        "mask.sum() is a fresh integer tensor nothing else holds (no gradient): clamping it in place gives the same "
        "divisor",
    f"{_U}:add_fused_lm_head:1674 compare: Eq -> NotEq":
        "the mutant reads num_experts off the model where the config is not GPT-OSS's and the transformers version is "
        "in [5.0, 5.6): the installed transformers 5.25 is outside that window, so both read text_config.num_experts",
    f"{_U}:add_fused_lm_head:1674 compare: LtE -> Lt":
        "the comparison runs only after text_config.model_type == 'gpt_oss' (a GPT-OSS config, declared another "
        "model family: 1674->1677), which the stand-in's config never is; it would differ only under transformers "
        "5.0.0 itself",
}

#: trl's profile: GRPO's batch (left-padded prompts, right-padded completions; SFT's right-padded rows where its
#: ``sft_collator`` switch is drawn), completion-only log-probs
#: (``logits_to_keep`` is the completion width), the surface and its unreachable branches (no conventions declared)
#: what TRL refuses (INV-FLAG-004 hands it each): a temperature <= 0 (selective_log_softmax and its entropy companion
#: raise "temperature must be positive"; no clamp, NO_CLAMP above)
REFUSES = {"temperature_nonpositive": "TRL's scoring raises ValueError('temperature must be positive')"}
PROFILE = replace(EngineUnderTest.profile, surface=SURFACE, unreachable={**_BATCH_UNREACHABLE, **_LOGITS_UNREACHABLE},
                  refuses=REFUSES,
                  equivalent_mutants=EQUIVALENT_MUTANTS,
                  padded_layouts=(PaddedLayout.LEFT_RIGHT, PaddedLayout.RIGHT),  # GRPO's; SFT's (its switch)
                  output_span=OutputSpan.RESPONSE, config_space=TRL_SWITCHES)  # TRL's switches: spec/engines/trl/config.py
#: (trl-fused's: trl's profile, its layout included, with FUSED_SURFACE, FUSED_UNREACHABLE and FUSED_OFF_PATH:
#: spec/engines/trl/fused.py)
FUSED_UNREACHABLE: dict[str, str] = {**_BATCH_UNREACHABLE, **_FUSED_UNREACHABLE}

#: why the engine lacks each feature it does not offer (the kit's ThirdPartyEngine.reasons)
REASONS = {
    Feature.SP: "sequence parallelism goes through accelerate's context parallelism, outside this API",
    Feature.VALUE: "no value head (TRL 1.16's GRPO/RLOO are critic-free)",
    Feature.FUSED: "TRL hands the model no temperature or shift_labels: its fused head is engine trl-fused",
    Feature.TEMPERATURE_HANDOFF: "one float temperature per trainer (self.temperature); nothing is handed over",
    Feature.CU_SEQLENS: "the padding-free collator always hands flash-attention cu_seq_lens_q/k; no setting",
    Feature.CHUNKING: "entropy_from_logits' chunk_size bounds memory only; TRL exposes no setting for it here",
    Feature.PER_SAMPLE_TEMPERATURE: "one float temperature per trainer (GRPOConfig.temperature)",
}
