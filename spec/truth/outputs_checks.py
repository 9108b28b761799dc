"""The checks of what ``prepare_model_outputs`` returns, stated once: the keys the flags ask for, every per-token
output against the oracle at the positions a consumer reads, the outputs' device and dtype, the gradient a loss needs.
The invariants (spec/invariants/outputs.py, context.py, core.py's ``match_oracle``) call them on the suite's run; a
standalone reproducer calls the same functions, vendored beside it (spec/repro/templates.py writes this module's
source into ``repro_suite.py``; spec/repro/runtime.py calls them on the file's run and its float64 reference). So they
take plain values (the flags, the per-sequence expectation and tolerance, the positions read) and fail by
:func:`~spec.truth.failing.fail`.
"""

from __future__ import annotations

import contextlib

import torch

from .closeness import close
from .failing import add_facts, fail

__all__ = ["expected_keys", "output_keys", "per_seq", "sequences", "locate", "oracle_values", "outputs_device_dtype",
           "DIFFERENTIABLE", "outputs_carry_grad"]

#: outputs a policy or critic loss differentiates (the distillation terms are the processor's, overlap_count a
#: count; fused kernels' outputs are the model's own)
DIFFERENTIABLE = ("log_probs", "entropy", "sum_pi_squared", "values")


def expected_keys(head: str, distillation_only: bool, calculate_entropy: bool, calculate_sum_pi_squared: bool,
                  distillation_keys) -> set[str]:
    """The output keys the flags ask for: ``values`` for a value head; else log_probs (unless distillation_only),
    entropy, sum_pi_squared and the processor's keys."""
    if head == "value":
        return {"values"}
    keys = set() if distillation_only else {"log_probs"}
    keys |= {"entropy"} if calculate_entropy else set()
    keys |= {"sum_pi_squared"} if calculate_sum_pi_squared else set()
    return keys | set(distillation_keys)


def output_keys(got, want: set[str], what: str) -> None:
    """INV-KEYS-001: the outputs ``what`` have exactly the keys ``want`` the flags ask for."""
    got = set(got)
    if got != want:
        fail(f"{what} have keys {sorted(got)}, the flags ask for {sorted(want)}"
             + (f" (missing {sorted(want - got)})" if want - got else ""))


def per_seq(nested: torch.Tensor) -> list[torch.Tensor]:
    """A nested output as a list of CPU float64 tensors, one per sequence."""
    return [t.detach().to("cpu", torch.float64) for t in nested.unbind()]


def sequences(value, what: str, count: int) -> list[torch.Tensor]:
    """A nested output (or a list of sequences) as ``count`` CPU float64 sequences; the count is checked
    before any value (an engine returning too few sequences must not be compared on the ones it has)."""
    if isinstance(value, torch.Tensor) and not value.is_nested:
        fail(f"{what}: a dense tensor of shape {tuple(value.shape)}, expected a nested tensor of {count} sequences")
    seqs = per_seq(value) if isinstance(value, torch.Tensor) else list(value)
    if len(seqs) != count:
        fail(f"{what}: {len(seqs)} sequences, expected {count}")
    return seqs


def locate(exc: BaseException, key: str, sequence: int, at: torch.Tensor) -> None:
    """The output key, sequence and token position of a value check's failure (``exc.facts``), the position
    read back from the index :func:`close` found in the positions ``at`` it compared."""
    index = getattr(exc, "facts", {}).get("index")
    position = int(at[index[0]]) if index and at.numel() > index[0] else None
    add_facts(exc, key=key, sequence=sequence, **({"position": position} if position is not None else {}))


def _dense_from_zero(positions: torch.Tensor) -> bool:
    return positions.numel() == 0 or int(positions[0]) == 0


def oracle_values(key: str, got, wants, tols, seq_lens, read, what: str = "", on_mismatch=None) -> None:
    """The oracle-match loop: output ``key`` (nested) against the per-sequence expectation ``wants``, each token a
    consumer reads (``read[i]``: :func:`~spec.truth.rules.read_positions`) within its tolerance ``tols[i]``.
    ``on_mismatch(exc, i, at, actual)``: called on a value failure before it is raised (the invariants measure
    it against the known mechanisms' bounds)."""
    seqs = sequences(got, f"{what or key}", len(wants))
    for i, (actual, want, tol) in enumerate(zip(seqs, wants, tols)):
        if actual.dim() != 1 or actual.shape[0] != seq_lens[i]:
            fail(f"{key!r} of sequence {i} has shape {tuple(actual.shape)}, expected ({seq_lens[i]},)", key=key,
                 sequence=i)
        at = read[i]
        try:
            close(actual[at], want[at], f"{key!r} of sequence {i}{what and ' ' + what}"
                  + ("" if _dense_from_zero(at) else f" (positions {at.tolist()})"), atol=tol[at])
        except AssertionError as exc:
            locate(exc, key, i, at)
            if on_mismatch is not None:
                on_mismatch(exc, i, at, actual)
            raise


def outputs_device_dtype(outputs, device, each=contextlib.nullcontext) -> None:
    """INV-DEV-001: every output lives on the batch's device (``device``) as float32. Every output is looked at: each
    one on the wrong device or in another dtype is a fact of its own, raised inside ``each()`` (a collector of every
    failing fact, ``spec.invariants.core.EveryFailure.each``; by default the first fails), with its ``key``; a wrong
    dtype's failure also carries ``output_dtype`` (key, dtype), so a record excuses only the declared one and an
    excused bf16 ``log_probs`` never hides an undeclared bf16 ``entropy``."""
    want = torch.device(device).type
    for key, value in outputs.items():
        values = value.values() if value.is_nested else value
        with each():
            if values.device.type != want:
                fail(f"output {key!r} is on {values.device}, the batch is on {device}", key=key)
        with each():
            if values.dtype != torch.float32:
                wrong = AssertionError(f"output {key!r} has dtype {values.dtype}, expected torch.float32")
                wrong.facts = {"key": key}
                wrong.output_dtype = (key, str(values.dtype))
                raise wrong


def outputs_carry_grad(rank_outputs, metrics=frozenset(), each=contextlib.nullcontext) -> None:
    """INV-GRAD-001: with the model's logits requiring grad, every output a loss differentiates requires grad, and an
    output the engine declares a metric only (``metrics``, ``EngineProfile.metrics``) does not; each output a fact of
    its own, raised inside ``each()`` (as :func:`outputs_device_dtype`)."""
    for r, outputs in enumerate(rank_outputs):
        for key in DIFFERENTIABLE:
            if key not in outputs:
                continue
            with each():
                if key in metrics and outputs[key].requires_grad:
                    fail(f"rank {r}: output {key!r} requires grad although the engine's profile declares it a metric "
                         "only (EngineProfile.metrics): a loss reading it would backpropagate through it", key=key)
                if key not in metrics and not outputs[key].requires_grad:
                    fail(f"rank {r}: output {key!r} does not require grad although the model's logits do "
                         f"(detached from the autograd graph: the loss gets no gradient through it; an output "
                         f"computed as a metric only is declared so: EngineProfile(metrics={{{key!r}}}))", key=key)
