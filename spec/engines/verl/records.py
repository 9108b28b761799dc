"""Known-failure records that verl's native engines (TorchTitan, Automodel) share with one another or
with the FSDP engine: the same bug in the same shared code, so one record each, in one place.

Each engine's docs/engines/<name>.md has a minimal counterexample for each record it carries.
"""

from __future__ import annotations

from ...protocol.known import ALWAYS, KnownFailure, When
from .adapter import CANCELLATION, KNOWN_BUGS, MASK_INVARIANTS

__all__ = ["flag_types", "entropy_cancellation", "loss_mask_attention", "PER_SAMPLE_ON_VOCAB", "UNCLAMPED",
           "MASK_VISIBLE", "VALUE_MISMATCH"]

#: a value of an output differs from the oracle's (or the other run's) beyond the tolerance
VALUE_MISMATCH = r"'\w+' of sequence \d+.*: at \(\d+(, \d+)*,?\) got .* expected .* \(\|diff\|"


def _shared(invariant: str) -> KnownFailure:
    return next(r for r in KNOWN_BUGS["*"] if r.invariant == invariant)


def flag_types() -> KnownFailure:
    """Flags read with ``tu.get_non_tensor_data`` and tested by truthiness, as the FSDP engine does."""
    return _shared("INV-FLAG-003")


def entropy_cancellation(modes: tuple[str, ...] = ()) -> KnownFailure:
    """``verl_F.entropy_from_logits``: logsumexp(z) - sum(p z) cancels in float32 (low T, large vocabularies)."""
    record = _shared("INV-VAL-002")
    return KnownFailure(record.invariant, record.reason, raises=record.raises, matches=record.matches,
                        when=CANCELLATION, modes=modes, certain=False, bound=record.bound)


def loss_mask_attention(invariants: frozenset[str] | set[str] = MASK_INVARIANTS, *, reason: str) -> tuple[KnownFailure, ...]:
    """The padded attention mask built from the response-only ``loss_mask`` (verl #6278): the mask rows,
    and every padded output compared against a mask-independent reference (the rule of
    :data:`spec.engines.verl.adapter.MASK_INVARIANTS`)."""
    patterns = {"INV-MASK-001": r"attention_mask row \d+ is \[[01, ]*\], expected \[[01, ]*\]",
                "INV-MASK-003": r"attention_mask sums to \d+, total_nnz is \d+"}
    return tuple(KnownFailure(inv, reason + (" (seen end to end through the micro-batch layer)" if inv in _END_TO_END
                                             else ""),
                              raises=AssertionError, when=ALWAYS if inv in patterns else MASK_VISIBLE,
                              matches=patterns.get(inv, _END_TO_END.get(inv, VALUE_MISMATCH)),
                              modes=() if inv == "INV-KEYS-003" else ("padded",),
                              # end to end, whether a compared output is one the mask changes depends on the
                              # micro-batch cut (TorchTitan: 3 of 38 such cases failed)
                              certain=inv not in _END_TO_END)
                 for inv in sorted(invariants))


#: the micro-batch layer's end-to-end check (its own message: per sample, with the micro-batch sizes)
_END_TO_END = {"INV-MB-015": r"'(log_probs|entropy)' of sample \d+ \(micro-batches .*\): at \(\d+,\) got"}


#: where a response-only mask (r_i ones) changes an output that is read: any output at positions r_i .. n_i - 2 (a
#: prompt of 2 or more tokens; no output at a sequence's last token is read: spec.truth.rules.read_positions)
MASK_VISIBLE = When("a prompt of >= 2 tokens (an output at r_i .. n_i - 2 is read)",
                    lambda case: any(p >= 2 for p in case.prompt_lens))


def _per_sample_on_vocab(case) -> bool:
    temps = case.temperatures()
    return case.per_sample_temperature and not case.use_fused_kernels and case.batch_size >= 2 and \
        (case.batch_size != case.vocab or len(set(temps)) > 1)


#: a per-sample (B,) temperature divided into (n, V) / (B, L, V) logits as it is: it broadcasts on the vocab axis
PER_SAMPLE_ON_VOCAB = When("a per-sample temperature over B >= 2 samples (B != V: a shape error; B = V with unequal "
                           "values: vocab column j scaled by sample j's temperature)", _per_sample_on_vocab)
#: a temperature below the 1e-8 clamp reaches the division unclamped
UNCLAMPED = When("a temperature below 1e-8 (not clamped)", lambda case: min(case.temperatures()) < 1e-8)
