"""verl 0.9.1's equivalent mutants: mutants of its preparation surface (``spec mutate --engine verl``) that no
input tells from verl's own code, each with the reason read off the source. Keyed by the mutant's stable id
(:attr:`spec.mutate.Mutant.id`); ``spec mutate`` classifies a survivor named here as equivalent (not scored) and
reports one that a check kills as killed (the declaration was wrong).

Every other survivor is a gap of the suite: closed by a case or a check, never declared here.
"""

from __future__ import annotations

__all__ = ["VERL_EQUIVALENT_MUTANTS"]

_FSDP = "verl.workers.engine.fsdp.transformer_impl"
_SB = "verl.utils.seqlen_balancing"

VERL_EQUIVALENT_MUTANTS: dict[str, str] = {
    f"{_FSDP}:FSDPEngineWithLMHead.prepare_model_outputs:1501 dtype: dtype= dropped":
        "torch.zeros_like(seq_lengths, dtype=torch.int64): seq_lengths is the diff of a jagged tensor's int64 "
        "offsets, so zeros_like already gives int64",
    f"{_SB}:karmarkar_karp:127 compare: Gt -> GtE":
        "State.__lt__ returns self.spread > other.spread only after the spreads were found to differ: > and >= "
        "agree there",
    f"{_SB}:karmarkar_karp:80 accumulator: += -> =":
        "Set.add is called only on a fresh Set (sum 0) in State.__init__, once per set: 0 + val == val",
    "verl.utils.ulysses:ulysses_pad:288 compare: LtE -> Lt":
        "with sp_size == 1 the fall-through pads (1 - n % 1) % 1 = 0 tokens and returns the same tensors and a pad "
        "of 0, as the early return does",
}
