"""Which checks a reproducer runs for a failed invariant, and on which runs of the case: each invariant's own
record (``InvariantInfo.repro``, :mod:`spec.invariants.reproduction`, declared where the invariant is registered),
collected here by kind.

A reproducer states the invariant's consumer-visible property as checks on one or more runs of the
shrunk case (the case itself, plus the variants a run-vs-run invariant compares it with). Every run is
checked against the float64 reference written out in the file, so a run-vs-run invariant (packed vs
padded, a permutation, halves, a float vs a tensor temperature, sequence parallelism, a bucket, chunking)
becomes "each of the runs equals the reference": where the two runs disagree, one of them is wrong.

Checks (:mod:`.runtime` runs them), each the property of the invariant that names it, and each, where the invariant
states it, the invariant's own check (spec/truth/*_checks.py, written into ``repro_suite.py``: the same function the
invariant calls):

* on the outputs (spec/truth/outputs_checks.py, slice_checks.py, state_checks.py): ``keys`` (the output keys the flags
  ask for), ``values`` (every output against the reference, the suite's oracle, per token a consumer reads, within
  the oracle's tolerance), ``float32`` (the outputs' device and dtype), ``grad`` (what a loss differentiates carries
  grad), ``response_values`` (the (B, R) log-probs a loss reads, in every framework's consumer view), ``slice``
  (``no_padding_2_padding`` of the log-probs: its shape and the reference's response slice), ``unchanged`` (the
  micro-batch, the model's logits and ``output_args`` are left as they were);
* on what ``prepare_model_inputs`` hands over (run alone, as the suite's input invariants run it;
  spec/truth/handoff_checks.py): ``mask`` / ``mask_shape`` (the padded attention mask marks each sample's tokens where
  the declared layout puts them; its shape and sum), ``mask_dtype`` (0/1 integers on the ids' device, int32 where the
  engine declares it), ``padded_ids`` / ``padded_positions`` / ``packed_inputs`` (the ids and positions the model is
  handed hold each sample's own), ``labels`` / ``shard_labels`` (each packed token's label is the next token of its
  sequence, across shard edges too), ``ids_fill`` / ``positions_fill`` (padded columns hold pad_token_id / 0),
  ``tail`` / ``tail_fill`` (the packed tail padding's length, pad_size and restarting positions; its ids 0 and
  temperature 1), ``rolled_row`` (the labels are the whole packed row rolled by one, zeros after),
  ``token_temperature`` / ``padded_temperature`` (each token's or sample's own temperature handed to the output
  step), ``fused_inputs`` / ``return_dict`` (what a fused-kernel model gets), ``cu_seqlens`` / ``cu_seqlens_cpu``,
  ``media_handed`` (each sample's image and video features and grids, in sample order, beside as many media tokens:
  spec/truth/media_checks.py);
* on the helpers, with per-token tensors built from the seed (no run of the case; spec/truth/slice_checks.py):
  ``mask_helper``, ``slice_reads`` (the slice reads only response positions, NaN elsewhere never leaks),
  ``from_nested``, ``round_trip``, ``slice_dtypes``;
* run against run: ``flags_default`` (the flags at their defaults left out), ``flags_recoded`` (0/1 ints, numpy
  scalars, a plain str), each the same hand-off and outputs as the case's run (spec/truth/settings_checks.py) and the
  reference; ``on_cuda`` (a CUDA run against the reference; exit 2 without a GPU); ``reused`` / ``earlier_kept``
  (one engine object through the run before, then the case: what a fresh one gives, and the earlier results left as
  returned; spec/truth/state_checks.py);
* rejections, "the call raises a clear exception, never returns a silently wrong tensor": ``bad_flags``,
  ``bad_settings`` (the values the invariants try: spec/truth/settings_checks.py), ``rejects_pad_mode``, ``rejects``
  (the case itself is invalid), ``refused`` (each setting the engine's profile declares unsupported, by the
  preparation and by prepare_model_outputs alone); only the engine's own exception counts, not the stand-in model's
  or the processor's.

Invariants without a record have no standalone reproducer: the file written for them says so, and the
report lists them.
"""

from __future__ import annotations

from typing import TypeVar

from ..invariants import CATALOGUE
from ..invariants.reproduction import LayerCheck, Plan

__all__ = ["Plan", "plan_for", "rank_plan_for", "layer_checks"]

R = TypeVar("R")


def _records(kind: type[R]) -> dict[str, R]:
    return {inv: info.repro for inv, info in CATALOGUE.items() if isinstance(info.repro, kind)}


def _plan(invariant: str) -> Plan | None:
    """``invariant``'s :class:`Plan`, read off the catalogue when asked (an invariant registered after this module
    was imported has its plan too); None where it has none."""
    info = CATALOGUE.get(invariant)
    return info.repro if info is not None and isinstance(info.repro, Plan) else None


def plan_for(invariant: str) -> Plan | None:
    """``invariant``'s plan on one process (None: no engine-case reproducer, or one on real ranks)."""
    plan = _plan(invariant)
    return plan if plan is not None and not plan.real_ranks else None


def rank_plan_for(invariant: str) -> Plan | None:
    """``invariant``'s plan on real gloo ranks (spec/repro/ranks.py), None where it has none."""
    plan = _plan(invariant)
    return plan if plan is not None and plan.real_ranks else None


def layer_checks(on: str) -> dict[str, tuple[tuple[str, ...], str | None]]:
    """invariant ID -> (the layer functions it calls, its vendored check) of the micro-batch invariants whose
    reproducer runs ``on`` (:class:`LayerCheck`: "cut", "helpers", "ranks", "engine")."""
    return {inv: (CATALOGUE[inv].functions, record.check) for inv, record in _records(LayerCheck).items()
            if record.on == on}
