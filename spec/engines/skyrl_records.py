"""Known-failure records of SkyRL (engines ``skyrl-train`` 0.3.1 and ``skyrl`` 0.4.0); docs/engines/skyrl.md and
docs/findings/F22, F23 reproduce the library's in plain torch.

``RECORDS`` are the library's (real differences from the contract). ``SUITE_STOPGAPS`` are the suite's false alarms,
recorded only so that the CI step is green until the suite reads ``SkyRLTrainEngine.profile`` (issue 35: a text-only
engine is never drawn mRoPE positions; verl's int32 mask and untouched logits are verl's conventions): drop them then.
"""

from __future__ import annotations

from ..protocol.known import KnownFailure
from .openrlhf_records import MROPE
from .trl_records import INT64_MASK_RECORD, LOW_PRECISION, MISMATCH, ORACLE_INVARIANTS
from .verl_records import UNCLAMPED

__all__ = ["RECORDS", "LIBRARY_RECORDS", "SUITE_STOPGAPS"]

IN_LOGITS_DTYPE = ("logprobs_from_logits_v2 takes a per-row F.log_softmax in the logits' dtype and chunked_entropy_from_logits "
                   "writes into a tensor of the logits' dtype: bf16/fp16 logits give bf16/fp16 log-probs and entropy "
                   "(0.003 nats off at V = 2); under the worker's torch.autocast(cuda, bf16) the log_softmax runs in float32 "
                   "but the entropy is still stored in bf16; library difference (F22)")
NO_CLAMP = ("forward divides the logits by its temperature as given (logits_BSV.div_(temperature)), with no 1e-8 clamp: "
            "T = 5e-9 doubles the log-probs of the clamped contract; library difference (F23)")
TEXT_ONLY = ("SUITE FALSE ALARM: a text-only engine (profile positions=('rope',)): forward always computes 1-D positions "
             "cumsum(mask) - 1; the suite still draws mRoPE cases (issue 35, profile35)")
LOGITS_IN_PLACE = ("SUITE FALSE ALARM: forward scales output['logits'] in place (div_); no SkyRL caller reads the logits again "
                   "(verl's convention LOGITS_UNTOUCHED, not the contract: issue 35, contract35)")
INT64_MASK = ("SUITE FALSE ALARM: the padded mask is int64 (convert_prompts_responses_to_batch_tensors); int32 is verl's "
              "convention INT32_ATTENTION_MASK, harmless to a Hugging Face model (issue 35, contract35)")
DTYPE = r"has dtype torch\.(bfloat16|float16), expected torch\.float32|" + MISMATCH

LIBRARY_RECORDS: tuple[KnownFailure, ...] = (
    *(KnownFailure(inv, IN_LOGITS_DTYPE, matches=MISMATCH, when=LOW_PRECISION) for inv in ORACLE_INVARIANTS),
    KnownFailure("INV-DEV-001", IN_LOGITS_DTYPE, matches=DTYPE, when=LOW_PRECISION),
    *(KnownFailure(inv, NO_CLAMP, matches=MISMATCH, when=UNCLAMPED, certain=inv == "INV-TEMP-006")
      for inv in ("INV-VAL-001", "INV-TEMP-006", "INV-SLICE-006")),
)
SUITE_STOPGAPS: tuple[KnownFailure, ...] = (
    *(KnownFailure(inv, TEXT_ONLY, matches=MISMATCH, when=MROPE) for inv in ORACLE_INVARIANTS),
    *(KnownFailure(inv, TEXT_ONLY, matches=r"position_ids shape \(\d+, \d+\), expected \(4, \d+, ", when=MROPE)
      for inv in ("INV-POS-001", "INV-POS-002")),
    KnownFailure("INV-MUT-002", LOGITS_IN_PLACE, matches=r"model output 'logits' was modified in place"),
    KnownFailure("INV-MASK-002", INT64_MASK, modes=("padded",), matches=INT64_MASK_RECORD.matches),
)
RECORDS = LIBRARY_RECORDS + SUITE_STOPGAPS
