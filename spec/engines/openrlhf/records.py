"""Known-failure records of OpenRLHF 0.11.2 (engine ``openrlhf``); spec/engines/openrlhf/README.md reproduces each in plain
torch."""

from __future__ import annotations

from ...protocol.profile import Feature

from dataclasses import replace

from ...protocol.engine import EngineUnderTest
from ...protocol.known import KnownFailure, When
from ..kit.records import CANCELLATION, MISMATCH, UNCLAMPED
from .config import GATHERED, GATHERED_LOGITS, SWITCHES

__all__ = ["REASONS", "RECORDS"]

NO_CLAMP = ("Actor.forward divides the logits by its temperature as given (output['logits'].div_(self.temperature)), "
            "with no 1e-8 clamp: T = 5e-9 doubles the log-probs of the clamped contract; library difference")
ENTROPY = ("compute_entropy is logsumexp(z) - sum(softmax(z) * z) in float32: two large, nearly equal terms at low "
           "temperature (two tied top logits, true entropy ln 2: 0.6875 at T = 1e-6, 0 at T = 1e-8); library bug "
           "(precision)")
PACKED_MROPE = ("packed (packing_samples), unpad_and_slice_tensor hands every model 1-D positions cumsum(mask) - 1, also a "
                "vision model whose mRoPE positions the padded path lets it compute (is_vlm): its packed logits are "
                "those of text positions; library bug (packing with a VLM)")
MROPE_PACKED = When("mRoPE positions in the packed mode", lambda case: case.mrope and case.use_remove_padding)
MROPE = When("mRoPE positions (the packed run of the padded-vs-packed comparison)", lambda case: case.mrope)
#: the checks whose packed outputs or inputs the 1-D positions change
MROPE_INVARIANTS = ("INV-VAL-001", "INV-VAL-002", "INV-TEMP-001", "INV-TEMP-003", "INV-TEMP-006", "INV-SLICE-006",
                    "INV-MM-002")

VIDEO_ONLY = ("padded, Actor.forward picks the key of the token types it builds for a VLM by 'image_grid_thw' in "
              "mm_inputs: a micro-batch whose media are all videos hands a Qwen-VL model 'token_type_ids' (Gemma's "
              "key) and no 'mm_token_type_ids', so it cannot find its media tokens (transformers 5 raises; the "
              "stand-in computes text positions: the logits are those of 1-D positions); library bug (video-only "
              "batches)")


def _videos_without_images(samples) -> bool:
    kinds = {m.kind for sample in samples for m in sample}
    return "video" in kinds and "image" not in kinds


VIDEOS_ONLY = When("padded mRoPE, the micro-batch's media all videos",
                   lambda case: case.mrope and not case.use_remove_padding and _videos_without_images(case.media))
#: a sub-batch of the samples with videos and no image (INV-BATCH-002, INV-EDGE-001 run such sub-batches)
A_SAMPLE_VIDEOS_ONLY = When("padded mRoPE, a sample whose media are all videos (a sub-batch of it alone)",
                            lambda case: case.mrope and not case.use_remove_padding
                            and any(_videos_without_images([sample]) for sample in case.media))

GATHERED_PADDING = ("packed with allgather_logits, gather_and_pad_tensor re-pads the logits-only return's (1, n, V) "
                    "logits to (B, L, 1, V): pad_input keeps the packed row's batch axis and its squeeze(-1), written "
                    "for (1, n) log-probs, drops nothing; the caller, expecting (B, L, V) logits as the padded path "
                    "returns them, refuses them; library bug (latent: no caller in 0.11.2 asks allgather_logits)")
GATHERED_SHAPE = (r"ValueError: output\['logits'\] of the logits-only return: shape \(\d+, \d+, 1, \d+\), "
                  r"expected \(B, L, V\)")
#: the checks that read a packed run's outputs (each fails where the caller refuses the gathered logits)
GATHERED_INVARIANTS = ("INV-BATCH-001", "INV-BATCH-002", "INV-BATCH-003", "INV-DEV-001", "INV-FLAG-001",
                       "INV-FLAG-002", "INV-GRAD-001", "INV-KEYS-001", "INV-LAYOUT-001", "INV-LEAK-001",
                       "INV-LEAK-002", "INV-MM-002", "INV-MUT-001", "INV-MUT-004", "INV-MUT-005", "INV-SLICE-006",
                       "INV-TEMP-001", "INV-TEMP-003", "INV-TEMP-006", "INV-VAL-001", "INV-VAL-002")

RECORDS: tuple[KnownFailure, ...] = (
    *(KnownFailure(inv, GATHERED_PADDING, raises=ValueError, matches=GATHERED_SHAPE, when=GATHERED_LOGITS,
                   modes=("packed",)) for inv in GATHERED_INVARIANTS),
    *(KnownFailure(inv, GATHERED_PADDING, raises=ValueError, matches=GATHERED_SHAPE, when=GATHERED)
      for inv in ("INV-KEYS-002", "INV-KEYS-003")),  # (their packed run)
    KnownFailure("INV-EDGE-001", GATHERED_PADDING, matches="refused a zero-length response with " + GATHERED_SHAPE,
                 when=GATHERED_LOGITS, modes=("packed",)),
    *(KnownFailure(inv, PACKED_MROPE, matches=MISMATCH, when=MROPE_PACKED, modes=("packed",)) for inv in MROPE_INVARIANTS),
    KnownFailure("INV-KEYS-003", PACKED_MROPE, matches=MISMATCH, when=MROPE),
    KnownFailure("INV-POS-002", PACKED_MROPE, matches=r"packed position_ids shape \(1, \d+\), expected \(4, 1, \d+\)",
                 when=MROPE_PACKED, modes=("packed",)),
    # (INV-SLICE-006 reads log-probs of drawn labels only: a label far above the rest scores 0 at any T)
    *(KnownFailure(inv, NO_CLAMP, matches=MISMATCH, when=UNCLAMPED, certain=inv != "INV-SLICE-006")
      for inv in ("INV-VAL-001", "INV-TEMP-006", "INV-SLICE-006")),
    KnownFailure("INV-VAL-002", ENTROPY, matches=MISMATCH, when=CANCELLATION, certain=False),
    *(KnownFailure(inv, VIDEO_ONLY, matches=MISMATCH, when=VIDEOS_ONLY, modes=("padded",), certain=False)
      for inv in MROPE_INVARIANTS),
    KnownFailure("INV-MM-001", VIDEO_ONLY, matches=r"no 'mm_token_type_ids'", when=VIDEOS_ONLY, modes=("padded",)),
    KnownFailure("INV-POS-001", VIDEO_ONLY, matches=r"handed the model no position_ids", when=VIDEOS_ONLY,
                 modes=("padded",)),
    *(KnownFailure(inv, VIDEO_ONLY, matches=MISMATCH, when=A_SAMPLE_VIDEOS_ONLY, modes=("padded",), certain=False)
      for inv in ("INV-BATCH-002", "INV-EDGE-001")),
)

#: OpenRLHF's preparation the adapter runs, whose lines and branches ``spec verify`` measures (the profile's surface,
#: spec/run/engine_coverage.py): Actor.forward and what it calls (log-probs, entropy, ring-attention slicing), the padder,
#: the merge of a VLM experience's per-sample images
SURFACE = (
    "openrlhf.models.actor:Actor.forward", "openrlhf.models.utils:log_probs_from_logits",
    "openrlhf.models.utils:_logsumexp_by_chunk", "openrlhf.models.utils:compute_entropy",
    "openrlhf.models.ring_attn_utils:unpad_and_slice_tensor", "openrlhf.models.ring_attn_utils:gather_and_pad_tensor",
    "openrlhf.utils.utils:zero_pad_sequences", "openrlhf.utils.vlm_utils:merge_mm_train_inputs")

#: branches of SURFACE no CPU run of the suite reaches (OpenRLHF 0.11.2's lines), each with its reason (a ``gap:``
#: reason names the input a real trainer sends that the case space does not draw yet)
_A, _R, _U = "openrlhf.models.actor", "openrlhf.models.ring_attn_utils", "openrlhf.models.utils"
_RING = "needs ring attention: a ring_attn_group (ring_flash_attn and a process group; the engine declares Feature.SP)"
UNREACHABLE: dict[str, str] = {
    f"{_R}:142->143": _RING, f"{_R}:177->178": _RING, f"{_R}:179": _RING,
}

#: exits of log_probs_from_logits only a caller outside the preparation takes: Actor.forward (line 289) is its only
#: caller in OpenRLHF 0.11.2 (the SFT, DPO, PPO and reference calls all go through it; the logits-only return's caller
#: scores float32 logits too), so only a user's own call takes them (not counted; the else block's row loop with it)
_ONLY_CALLER = ("only a user's own log_probs_from_logits call: its one caller in OpenRLHF 0.11.2, Actor.forward "
                "(line 289), ")
OFF_PATH: dict[str, str] = {
    f"{_U}:173->174": f"{_ONLY_CALLER}divides the logits by its temperature itself (line 271) and passes the default "
                      "temperature 1.0",
    f"{_U}:176->190": f"{_ONLY_CALLER}casts the logits to float32 first (line 267, OpenRLHF PR 634): the bf16/fp16 "
                      "row loop runs for other callers' logits only",
}

#: survivors of ``spec mutate --engine openrlhf`` that no input tells from OpenRLHF's code, each with why (by mutant id)
EQUIVALENT_MUTANTS: dict[str, str] = {
    f"{_U}:log_probs_from_logits:173 branch: condition negated":
        "Actor.forward, its only caller, divides the logits by its temperature itself and calls "
        "log_probs_from_logits with the default 1.0 (173->174 is declared off the path for that reason): the mutant "
        "then divides by 1.0 in place, which leaves every value as it is",
    f"{_U}:_logsumexp_by_chunk:164 dtype: dtype= dropped":
        "torch.zeros without dtype= is float32; the chunked logsumexp runs only for float32 or float64 logits "
        "(bf16 and fp16 take the row loop), and a model's head hands float32: the same buffer (float64 logits, "
        "which no trainer's model emits and the cases do not draw, would have their logsumexp rounded to float32)",
    f"{_U}:log_probs_from_logits:173 compare: NotEq -> Eq":
        "as log_probs_from_logits:173 negated: with Actor.forward's temperature 1.0 the mutant divides the logits by "
        "1.0 in place, which leaves every value as it is",
    f"{_U}:log_probs_from_logits:176 branch: condition negated":
        "Actor.forward casts the logits to float32 first (line 267), so the mutant sends them through the row loop: "
        "log_softmax per row then a gather, against a gather minus the chunked logsumexp; both are the log-softmax "
        "at the label in float32, the same log-probs up to rounding (skyrl-train's logprobs_from_logits_v2:164 is "
        "the same pair of branches)",
    f"{_A}:Actor.forward:262 cast: .long() removed":
        "torch promotes the cumsum of an integer or bool tensor to int64: the positions of OpenRLHF's 0/1 integer "
        "attention mask (or a bool one) are int64 with or without .long()",
    f"{_A}:Actor.forward:263 inplace: .masked_fill_ -> .masked_fill":
        "the padded columns' positions only: OpenRLHF right-pads whole sequences (make_experience_batch's "
        "zero_pad_sequences), so there cumsum(mask) - 1 repeats the row's last position instead of 1, a valid index "
        "either way; the mask hides those columns and their outputs are dropped, and the contract leaves their "
        "positions to the engine (INV-POS-003's 0 is verl's convention, which OpenRLHF does not declare)",
    f"{_A}:Actor.forward:298 cast: .float() removed":
        "log_probs is float32 (the logits are cast to float32 at line 267) and the action_mask 0/1 (bool, as "
        "OpenRLHF's experience maker builds it, or an integer dtype): log_probs * action_mask promotes to float32 "
        "and multiplies by the same 1 and 0 as log_probs * action_mask.float(), bit for bit",
}

#: the adapter's profile: the default one with this surface (the engine declares no conventions), a VLM's images and
#: videos in both modes (packed: F13)
PROFILE = replace(EngineUnderTest.profile, surface=SURFACE, unreachable=UNREACHABLE, off_path=OFF_PATH,
                  equivalent_mutants=EQUIVALENT_MUTANTS, config_space=SWITCHES,  # spec/engines/openrlhf/config.py
                  media=("image", "video"))

#: why the engine lacks each feature it does not offer (the kit's ThirdPartyEngine.reasons)
REASONS = {
    Feature.SP: "ring attention needs ring_flash_attn and a process group (not run here)",
    Feature.VALUE: "the critic is another model class, not Actor.forward (the step's value loss runs it: critic.py)",
    Feature.TEMPERATURE_HANDOFF: "one float temperature per actor (self.temperature); nothing is handed over",
    Feature.CU_SEQLENS: "the packed path hands the model no cu_seqlens (flash-attn finds them from positions)",
    Feature.PER_SAMPLE_TEMPERATURE: "one float temperature per actor (Actor(temperature=...))",
}
