"""Invariants across runs: sequence parallelism, bucket, batch order and composition, devices, mutation,
and the configurations the contract makes errors."""

from __future__ import annotations

import torch

from ..execute.attribution import expect_engine_error
from ..execute.harness import execute
from ..cases.materialize import PadMode, materialize, select_rows
from ..protocol.profile import Convention
from ..truth import state_checks as state
from ..truth.rules import distinct_temperatures
from .core import VALUE_FACTS, Ctx, invariant, match_runs
from .inputs import _bucketed
from .reproduction import Plan, bucketed, chunked, halves, permuted, sequence_parallel

PACKED = ("packed",)


@invariant("INV-SP-001", "sequence-parallel size 2, 3 or 4 changes nothing in the outputs", contract=7,
           facts=VALUE_FACTS,
           protects="sequence parallelism never changes a sample's outputs",
           modes=PACKED, needs=("sp",),
           adjust=lambda c: c.with_(sp_size=max(c.sp_size, 2), distillation_keys=(), distillation_only=False),
           repro=Plan(("keys", "values"), sequence_parallel))
def sp_invariance(ctx: Ctx) -> None:
    single = ctx.rerun(ctx.case.with_(sp_size=1)).outputs
    for r, outputs in enumerate(ctx.run.rank_outputs):
        match_runs(ctx, outputs, single, f"sp={ctx.case.sp_size} rank {r} vs sp=1")


@invariant("INV-SP-002", "a static bucket for the packed length changes nothing in the outputs", contract=7,
           facts=VALUE_FACTS,
           protects="a static bucket never changes a sample's outputs",
           modes=PACKED, needs=("bucket",), adjust=_bucketed, repro=Plan(("keys", "values"), bucketed))
def bucket_invariance(ctx: Ctx) -> None:
    plain = ctx.rerun(ctx.case.with_(pad_to_length=None)).outputs
    match_runs(ctx, ctx.run.outputs, plain, f"bucket={ctx.case.pad_to_length} vs none")


def _rows_match(ctx: Ctx, rows: list[int], what: str) -> None:
    """Run the samples ``rows`` alone, in that order; each must match its row of the whole run."""
    part = execute(ctx.engine, ctx.case.subset(rows), ctx.device, micro_batch=select_rows(ctx.run.micro_batch, rows))
    whole = {}
    for key, value in ctx.run.outputs.items():
        parts = value.unbind() if isinstance(value, torch.Tensor) and value.is_nested else None
        whole[key] = [parts[i] for i in rows] if parts is not None else value
    match_runs(ctx, part.outputs, whole, what, rows=rows)


def two_or_more(case):
    """At least two samples (a permutation or a split of one sample is the identity): one sample doubled."""
    if case.batch_size > 1:
        return case
    temperature = case.temperature * 2 if isinstance(case.temperature, tuple) else case.temperature
    return case.with_(prompt_lens=case.prompt_lens * 2, response_lens=case.response_lens * 2, temperature=temperature)


@invariant("INV-BATCH-001", "permuting the samples permutes the outputs and changes nothing else", contract=8,
           protects="a sample's outputs do not depend on its place in the batch",
           adjust=lambda c: distinct_temperatures(two_or_more(c)), repro=Plan(("keys", "values"), permuted))
def permutation(ctx: Ctx) -> None:
    b = ctx.case.batch_size
    perm = list(range(b))[::-1]
    perm = perm[1:] + perm[:1] if b > 2 else perm
    _rows_match(ctx, perm, f"after permutation {perm}")


@invariant("INV-BATCH-002", "a batch's outputs equal those of its halves run separately (concatenation)",
           contract=8,
           protects="a sample's outputs do not depend on the other samples in its micro-batch", adjust=lambda c: distinct_temperatures(two_or_more(c)),
           repro=Plan(("keys", "values"), halves))
def concatenation(ctx: Ctx) -> None:
    b = ctx.case.batch_size
    for rows in (list(range(b // 2)), list(range(b // 2, b))):
        _rows_match(ctx, rows, f"run in the sub-batch {rows}")


@invariant("INV-DEV-002", "CPU and CUDA agree within tolerance on every output", contract=9, facts=VALUE_FACTS,
           protects="a GPU run gives the CPU run's values", needs=("cuda",), repro=Plan(("keys", "values", "on_cuda")))
def cpu_cuda_agree(ctx: Ctx) -> None:
    on_cpu = execute(ctx.engine, ctx.case, "cpu").outputs
    on_cuda = execute(ctx.engine, ctx.case, "cuda").outputs
    match_runs(ctx, on_cuda, on_cpu, "cuda vs cpu")


@invariant("INV-MUT-001", "prepare_model_inputs/outputs leave the micro-batch unchanged", contract=10,
           protects="the trainer's micro-batch is the same after the engine ran (later steps reuse it)",
           repro=Plan(("unchanged",)))
def batch_not_mutated(ctx: Ctx) -> None:
    state.micro_batch_unchanged(ctx.run.snapshot, state.batch_items(ctx.run.micro_batch))


@invariant("INV-MUT-002", "prepare_model_outputs leaves the model's output tensors (logits) unchanged (verl's "
           "LOGITS_UNTOUCHED convention)", contract=10, convention=Convention.LOGITS_UNTOUCHED,
           protects="the model's output (logits) is the same after prepare_model_outputs, for a reader the engine's "
           "caller keeps (a convention: the contract's caller reads the model output no more, docs/contract.md)",
           repro=Plan(("unchanged",)))
def logits_not_mutated(ctx: Ctx) -> None:
    state.model_output_unchanged([{key: getattr(out, key) for key in snap} for out, snap in
                                  zip(ctx.run.model_outputs, ctx.run.model_output_snapshots)],
                                 ctx.run.model_output_snapshots)


def _expect_error(ctx: Ctx, case, what: str, micro_batch=None) -> None:
    """Passes only when the engine's own call raised: an exception of the suite's model or processor
    is no rejection (spec/execute/attribution.py). impl's exception types are tested in tests/test_errors.py."""
    expect_engine_error(lambda: execute(ctx.engine, case, ctx.device, micro_batch=micro_batch), what)


@invariant("INV-ERR-001", "a pad mode other than no_padding is rejected", contract=10,
           protects="an unsupported pad mode fails loudly instead of producing misaligned tensors", modes=("any",),
           repro=Plan(("rejects_pad_mode",)))
def rejects_pad_mode(ctx: Ctx) -> None:
    mb = materialize(ctx.case, ctx.device)
    mb.set_non_tensor("pad_mode", PadMode.RIGHT if ctx.case.seed % 2 else PadMode.LEFT_RIGHT)
    _expect_error(ctx, ctx.case, f"pad_mode={mb['pad_mode']!r}", micro_batch=mb)


@invariant("INV-ERR-002", "a static bucket together with top-K distillation is rejected", contract=10,
           protects="bucket + top-K distillation fails loudly instead of misaligning teacher tensors",
           modes=("packed",), needs=("bucket", "distillation"),
           adjust=lambda c: c.with_(pad_to_length=c.pad_to_length or 8, sp_size=1, use_fused_kernels=False,
                                    distillation_keys=c.distillation_keys or ("student_mass",)),
           repro=Plan(("rejects",)))
def rejects_bucket_with_topk(ctx: Ctx) -> None:
    _expect_error(ctx, ctx.case, f"bucket={ctx.case.pad_to_length} with top-K distillation")


@invariant("INV-ERR-003", "fused kernels with a per-sample temperature tensor are rejected", contract=10,
           protects="fused kernels with per-sample temperatures fail loudly instead of using one of them",
           needs=("fused", "per_sample_temperature"),
           adjust=lambda c: c.with_(use_fused_kernels=True, calculate_sum_pi_squared=False, distillation_keys=(),
                                    distillation_only=False,
                                    temperature=tuple(0.5 + 0.5 * i for i in range(c.batch_size))),
           repro=Plan(("rejects",)))
def rejects_fused_per_sample_temperature(ctx: Ctx) -> None:
    _expect_error(ctx, ctx.case, "use_fused_kernels with a per-sample temperature tensor")


@invariant("INV-CHUNK-001", "the entropy/log-prob chunk size (an engine setting) changes nothing in the outputs",
           contract=7, facts=VALUE_FACTS,
           protects="entropy chunking/checkpointing never changes an output", needs=("chunking",),
           adjust=lambda c: c.with_(calculate_entropy=True, entropy_chunk_size=max(
               1, min(c.entropy_chunk_size or 2, c.total_nnz - 1))), repro=Plan(("keys", "values"), chunked))
def chunk_invariance(ctx: Ctx) -> None:
    unchunked = ctx.case.with_(entropy_chunk_size=None)
    whole = ctx.rerun(unchunked).outputs
    match_runs(ctx, ctx.run.outputs, whole, f"entropy_chunk_size={ctx.case.entropy_chunk_size} vs none",
               reference=unchunked)


@invariant("INV-MUT-004", "prepare_model_outputs leaves output_args unchanged", contract=10,
           protects="output_args are intact after prepare_model_outputs (reused e.g. for a second head)",
           repro=Plan(("unchanged",)))
def output_args_not_mutated(ctx: Ctx) -> None:
    state.output_args_unchanged(ctx.run.output_args, ctx.run.output_args_snapshots)
