"""Known-failure records of TRL 1.16 (engines ``trl`` and ``trl-fused``); docs/engines/trl.md reproduces each in
plain torch. Each names the invariants whose check compares an output with the per-sequence oracle."""

from __future__ import annotations

from dataclasses import replace

from ..protocol.engine import EngineUnderTest
from ..protocol.known import KnownFailure, When
from .verl_records import CANCELLATION, UNCLAMPED, VALUE_MISMATCH

__all__ = ["LOGITS_RECORDS", "FUSED_RECORDS", "LOW_PRECISION", "ORACLE_INVARIANTS", "MISMATCH"]

#: the checks that compare log-probs / entropy with the oracle
ORACLE_INVARIANTS = ("INV-VAL-001", "INV-VAL-002", "INV-TEMP-001", "INV-TEMP-003", "INV-TEMP-006", "INV-SLICE-006")
#: a value of the consumer's response view differs from the oracle's (INV-SLICE-006), or any other output's
MISMATCH = VALUE_MISMATCH + r"|response_view of \w+ \(B, R\): at \(\d+, \d+\) got .* expected .* \(\|diff\|"
LOW_PRECISION = When("logits in bfloat16 or float16", lambda case: case.logits_dtype != "float32")

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

#: (INV-VAL-001 and INV-SLICE-006 read log-probs of drawn labels only: a label that is its row's argmax scores 0 at
#: any T below the clamp, so the failure is possible, not certain; measured: a ci run whose packed INV-VAL-001
#: examples under the condition all passed. INV-TEMP-006 draws its cases at the clamp to show it.)
_UNCLAMPED = tuple(KnownFailure(inv, NO_CLAMP, matches=MISMATCH, when=UNCLAMPED, certain=inv == "INV-TEMP-006")
                   for inv in ("INV-VAL-001", "INV-TEMP-006", "INV-SLICE-006"))

LOGITS_RECORDS: tuple[KnownFailure, ...] = (
    *(KnownFailure(inv, IN_LOGITS_DTYPE, matches=MISMATCH, when=LOW_PRECISION) for inv in ORACLE_INVARIANTS),
    *_UNCLAMPED)

FUSED_RECORDS: tuple[KnownFailure, ...] = (
    *(KnownFailure(inv, FUSED_HEAD_DTYPE, matches=MISMATCH, when=LOW_PRECISION) for inv in ORACLE_INVARIANTS),
    *_UNCLAMPED,
    KnownFailure("INV-VAL-002", FUSED_ENTROPY, matches=VALUE_MISMATCH, when=CANCELLATION, certain=False))

#: TRL's preparation the adapters run, whose lines and branches ``spec verify`` measures (the profile's surface,
#: spec/run/engine_coverage.py): the batch builders, the logits API and GRPO's fused LM head
SURFACE = (
    *(f"trl.trainer.utils:{f}" for f in ("pad", "selective_log_softmax", "entropy_from_logits",
                                         "selective_log_softmax_and_entropy", "add_fused_lm_head")),
    "trl.trainer.sft_trainer:DataCollatorForLanguageModeling.torch_call",
    "trl.trainer.sft_trainer:DataCollatorForLanguageModeling.get_position_ids_from_packed_seq_lengths",
    "trl.trainer.grpo_trainer:GRPOTrainer._get_per_token_logps_and_entropies",
    "trl.experimental.sdft.sdft_trainer:SDFTTrainer._forward_logits")

#: the adapter's profile: the default one with this surface (the engine declares no conventions)
PROFILE = replace(EngineUnderTest.profile, surface=SURFACE)
