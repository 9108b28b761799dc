"""Which checks a reproducer runs for a failed invariant, and on which runs of the case.

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

Invariants without a plan have no standalone reproducer: the file written for them says so, and the
report lists them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..cases.structure import EngineCase
from ..invariants.state import sibling

__all__ = ["Plan", "plan_for", "PLANS"]

#: a variant: (label, the case of the run) from the shrunk case
Variant = Callable[[EngineCase], list[tuple[str, EngineCase]]]


def _alone(case: EngineCase) -> list[tuple[str, EngineCase]]:
    return [("the case", case)]


def _both_modes(case: EngineCase) -> list[tuple[str, EngineCase]]:
    return [("packed", case.with_(use_remove_padding=True)),
            ("padded", case.with_(use_remove_padding=False, sp_size=1, pad_to_length=None))]


def _float_and_tensor(case: EngineCase) -> list[tuple[str, EngineCase]]:
    temps = case.temperatures()
    runs = [("the case", case)]
    if len(set(temps)) == 1:
        other = case.with_(temperature=temps) if not case.per_sample_temperature else case.with_(temperature=temps[0])
        runs.append(("the same temperature as a (B,) tensor" if not case.per_sample_temperature
                     else "the same temperature as a float", other))
    return runs


def _doubled(case: EngineCase) -> EngineCase:
    if case.batch_size > 1:
        return case
    temperature = case.temperature * 2 if isinstance(case.temperature, tuple) else case.temperature
    return case.with_(prompt_lens=case.prompt_lens * 2, response_lens=case.response_lens * 2, temperature=temperature)


def _permuted(case: EngineCase) -> list[tuple[str, EngineCase]]:
    case = _doubled(case)
    rows = list(range(case.batch_size))[::-1]
    return [("the case", case), (f"its samples in the order {rows}", case.subset(rows))]


def _halves(case: EngineCase) -> list[tuple[str, EngineCase]]:
    case = _doubled(case)
    half = case.batch_size // 2
    first, second = list(range(half)), list(range(half, case.batch_size))
    return [("the case", case), (f"samples {first} alone", case.subset(first)),
            (f"samples {second} alone", case.subset(second))]


def _sp(case: EngineCase) -> list[tuple[str, EngineCase]]:
    return [(f"sp={max(case.sp_size, 2)}", case.with_(sp_size=max(case.sp_size, 2))), ("sp=1", case.with_(sp_size=1))]


def _bucket(case: EngineCase) -> list[tuple[str, EngineCase]]:
    bucket = case.pad_to_length or case.total_nnz + 3
    return [(f"bucket={bucket}", case.with_(pad_to_length=bucket)), ("no bucket", case.with_(pad_to_length=None))]


def _chunked(case: EngineCase) -> list[tuple[str, EngineCase]]:
    chunk = case.entropy_chunk_size or 2
    return [(f"entropy chunk size {chunk}", case.with_(entropy_chunk_size=chunk)),
            ("no chunking", case.with_(entropy_chunk_size=None))]


def _after_sibling(case: EngineCase) -> list[tuple[str, EngineCase]]:
    """The micro-batch a reused engine object prepares first (the suite's sibling), then the case."""
    return [("the micro-batch before it (the same (B, L), other rows, tokens and temperatures)", sibling(case)),
            ("the case", case)]


@dataclass(frozen=True)
class Plan:
    checks: tuple[str, ...]
    runs: Variant = _alone
    #: what fills the padded logit slots and the packed tail (the suite's poisons)
    poison: str = "nan"
    #: the output keys the invariant asserts, the only ones ``values`` compares (empty: every key the flags ask for)
    keys: tuple[str, ...] = ()


VALUES = Plan(("keys", "values"))

#: invariant ID -> its plan (an ID missing here has no standalone reproducer)
PLANS: dict[str, Plan] = {
    # each a key of its own: the file compares what the invariant asserts, nothing else
    "INV-VAL-001": Plan(("keys", "values"), keys=("log_probs",)),
    "INV-VAL-002": Plan(("keys", "values"), keys=("entropy",)),
    "INV-VAL-003": Plan(("keys", "values"), keys=("sum_pi_squared",)),
    "INV-VAL-005": Plan(("keys", "values"), keys=("values",)),
    **{inv: VALUES for inv in ("INV-VAL-004", "INV-TEMP-001", "INV-TEMP-003", "INV-TEMP-006", "INV-KEYS-001", "INV-LEAK-001",
                               "INV-LAYOUT-001")},
    "INV-LEAK-002": Plan(("keys", "values"), poison="huge"),
    # fused kernels with top-K distillation: the keys the flags ask for (the terms a fused kernel computes) and their
    # values against the reference
    "INV-FUSED-003": Plan(("keys", "values")),
    "INV-DEV-001": Plan(("keys", "values", "float32")),
    "INV-KEYS-002": Plan(("keys", "values"), _both_modes),
    "INV-KEYS-003": Plan(("keys", "values"), _both_modes),
    "INV-TEMP-002": Plan(("keys", "values"), _float_and_tensor),
    "INV-BATCH-001": Plan(("keys", "values"), _permuted),
    "INV-BATCH-002": Plan(("keys", "values"), _halves),
    "INV-SP-001": Plan(("keys", "values"), _sp),
    "INV-SP-002": Plan(("keys", "values"), _bucket),
    "INV-CHUNK-001": Plan(("keys", "values"), _chunked),
    # the hand-off invariants read prepare_model_inputs alone (a model fed wrong inputs must not crash first)
    "INV-MASK-001": Plan(("mask",)),
    "INV-MASK-002": Plan(("mask_dtype",)),
    "INV-MASK-003": Plan(("mask_shape",)),
    "INV-LABEL-001": Plan(("labels",)),
    "INV-INPUT-001": Plan(("padded_ids",)),
    "INV-POS-001": Plan(("padded_positions",)),
    "INV-POS-002": Plan(("packed_inputs",)),
    "INV-GRAD-001": Plan(("grad", "keys", "values")),
    "INV-MUT-001": Plan(("unchanged",)),
    "INV-MUT-002": Plan(("unchanged",)),
    "INV-MUT-004": Plan(("unchanged",)),
    "INV-SLICE-001": Plan(("slice",)),
    "INV-SLICE-002": Plan(("slice", "keys", "values")),
    # what prepare_model_inputs hands over (run alone, as the suite's input invariants run it)
    "INV-INPUT-002": Plan(("ids_fill",)),
    "INV-POS-003": Plan(("positions_fill",)),
    "INV-PAD-001": Plan(("tail",)),
    "INV-PAD-002": Plan(("tail_fill",)),
    "INV-LABEL-002": Plan(("shard_labels",)),
    "INV-LABEL-003": Plan(("rolled_row",)),
    "INV-TEMP-004": Plan(("token_temperature",)),
    "INV-TEMP-005": Plan(("padded_temperature",)),
    "INV-FUSED-001": Plan(("fused_inputs",)),
    "INV-FUSED-002": Plan(("return_dict",)),
    "INV-CU-001": Plan(("cu_seqlens",)),
    "INV-CU-002": Plan(("cu_seqlens_cpu",)),
    # the helpers, on per-token tensors the file builds (no run of the engine)
    "INV-MASK-004": Plan(("mask_helper",)),
    "INV-SLICE-003": Plan(("slice_reads",)),
    "INV-SLICE-004": Plan(("from_nested",)),
    "INV-SLICE-005": Plan(("round_trip",)),
    "INV-DTYPE-001": Plan(("slice_dtypes",)),
    "INV-SLICE-006": Plan(("keys", "response_values")),
    # flags: left out, spelled otherwise (each run against the case's run and the reference), or bad (rejected)
    "INV-FLAG-001": Plan(("flags_default",)),
    "INV-FLAG-002": Plan(("flags_recoded",)),
    "INV-FLAG-003": Plan(("bad_flags",)),
    "INV-SET-001": Plan(("bad_settings",)),
    # a setting the engine's profile declares unsupported: refused by the preparation and prepare_model_outputs alone
    "INV-FLAG-004": Plan(("refused",)),
    "INV-FLAG-005": Plan(("refused",)),
    "INV-ERR-001": Plan(("rejects_pad_mode",)),
    "INV-ERR-002": Plan(("rejects",)),
    "INV-ERR-003": Plan(("rejects",)),
    # the CPU run and a CUDA run of the case, each against the reference (exit 2 without a CUDA device)
    "INV-DEV-002": Plan(("keys", "values", "on_cuda")),
    # one engine object kept across two micro-batches
    "INV-BATCH-003": Plan(("reused",), _after_sibling),
    "INV-MUT-005": Plan(("earlier_kept",), _after_sibling),
    # images and videos: what prepare_model_inputs hands the model of them (the samples' own dicts, from the micro-batch
    # built afresh), and the log-probs of each sample with its own images against the reference (its own media dict)
    "INV-MM-001": Plan(("media_handed",)),
    "INV-MM-002": Plan(("keys", "values"), keys=("log_probs",)),
}


def plan_for(invariant: str) -> Plan | None:
    return PLANS.get(invariant)
