"""What several engines' known-failure records share: the conditions on a drawn case and the failure messages they
match, stated once (spec/protocol/known.py holds the record type). Imports no engine adapter: an engine's records
build on this module, never on another engine's.

* :data:`VALUE_MISMATCH` / :data:`MISMATCH`: the message of a value compared beyond its tolerance (any output; and
  the consumer's response view, INV-SLICE-006);
* :data:`CANCELLATION`: where a float32 difference of two large, nearly equal terms loses a small result's digits;
* :data:`UNCLAMPED`: a temperature below the contract's clamp (an engine that divides by it as given);
* :data:`LOW_PRECISION_LOGITS`: bf16/fp16 logits (an engine computing in the logits' dtype);
* :data:`ORACLE_INVARIANTS`: the checks that compare log-probs or entropy with the oracle.
"""

from __future__ import annotations

from ...protocol.known import When
from ...truth.rules import TEMPERATURE_FLOOR

__all__ = ["VALUE_MISMATCH", "SAMPLE_MISMATCH", "MISMATCH", "CANCELLATION", "UNCLAMPED", "LOW_PRECISION_LOGITS", "ORACLE_INVARIANTS"]

#: a value of an output differs from the oracle's (or the other run's) beyond the tolerance
VALUE_MISMATCH = r"'\w+' of sequence \d+.*: at \(\d+(, \d+)*,?\) got .* expected .* \(\|diff\|"
#: a value of a sample differs end to end, through the micro-batch layer (INV-MB-015's message: per sample, with the
#: micro-batch sizes)
SAMPLE_MISMATCH = r"'(log_probs|entropy)' of sample \d+ \(micro-batches .*\): at \(\d+,\) got"
#: a value of the consumer's response view differs from the oracle's (INV-SLICE-006), or any other output's
MISMATCH = VALUE_MISMATCH + r"|response_view of \w+ \(B, R\): at \(\d+, \d+\) got .* expected .* \(\|diff\|"

#: where a float32 difference of two large, nearly equal terms loses the digits of a small result
CANCELLATION = When("a temperature below 0.1 or a vocabulary above 32,768 (float32 cancellation)",
                    lambda c: min(c.temperatures()) < 0.1 or c.vocab > 32_768)
#: a temperature below the contract's clamp reaches the division unclamped
UNCLAMPED = When("a temperature below 1e-8 (not clamped)", lambda case: min(case.temperatures()) < TEMPERATURE_FLOOR)
#: logits in a lower precision than float32
LOW_PRECISION_LOGITS = When("logits in bfloat16 or float16", lambda case: case.logits_dtype != "float32")

#: the checks that compare log-probs / entropy with the oracle
ORACLE_INVARIANTS = ("INV-VAL-001", "INV-VAL-002", "INV-TEMP-001", "INV-TEMP-003", "INV-TEMP-006", "INV-SLICE-006",
                     "INV-MM-002")
