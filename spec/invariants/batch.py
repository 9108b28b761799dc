"""Invariants across runs: sequence parallelism, bucket, batch order and composition, devices, mutation,
and the configurations the contract makes errors."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from ..harness import execute
from ..materialize import select_rows
from .core import Ctx, close_sequence, fail, invariant, per_seq
from .outputs import _compare

PACKED = ("packed",)


def _tensor_items(td: TensorDict) -> dict[str, object]:
    out = {}
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, torch.Tensor):
            out[key] = ("nested", value.values().clone(), value.offsets().clone()) if value.is_nested else value
        else:
            out[key] = getattr(value, "data", value)
    return out


def _same(a: object, b: object) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return a == b


@invariant("INV-SP-001", "sequence-parallel size 2, 3 or 4 changes nothing in the outputs", contract=7,
           modes=PACKED, needs=("sp",),
           adjust=lambda c: c.with_(sp_size=max(c.sp_size, 2), distillation_keys=(), distillation_only=False))
def sp_invariance(ctx: Ctx) -> None:
    single = ctx.rerun(ctx.case.with_(sp_size=1)).outputs
    for r, outputs in enumerate(ctx.run.rank_outputs):
        _compare(outputs, single, f"sp={ctx.case.sp_size} rank {r} vs sp=1")


@invariant("INV-SP-002", "a static bucket for the packed length changes nothing in the outputs", contract=7,
           modes=PACKED, needs=("bucket",),
           adjust=lambda c: c.with_(pad_to_length=c.pad_to_length or 8, distillation_keys=(),
                                    distillation_only=False))
def bucket_invariance(ctx: Ctx) -> None:
    plain = ctx.rerun(ctx.case.with_(pad_to_length=None)).outputs
    _compare(ctx.run.outputs, plain, f"bucket={ctx.case.pad_to_length} vs none")


def _rows_match(ctx: Ctx, rows: list[int], what: str) -> None:
    """Run the samples ``rows`` alone, in that order; each must match its row of the whole run."""
    part = execute(ctx.engine, ctx.case.subset(rows), ctx.device, micro_batch=select_rows(ctx.run.micro_batch, rows))
    for key, value in ctx.run.outputs.items():
        whole, alone = per_seq(value), per_seq(part.outputs[key])
        for j, i in enumerate(rows):
            close_sequence(key, alone[j], whole[i], f"{key!r} of sample {i} {what}")


def _distinct_temperatures(case):
    """Per-sample temperatures that differ (unless fused kernels need one float): a row mix-up shows."""
    if case.use_fused_kernels:
        return case
    return case.with_(temperature=tuple(0.5 + 0.25 * i for i in range(case.batch_size)))


@invariant("INV-BATCH-001", "permuting the samples permutes the outputs and changes nothing else", contract=8,
           adjust=_distinct_temperatures)
def permutation(ctx: Ctx) -> None:
    b = ctx.case.batch_size
    perm = list(range(b))[::-1]
    perm = perm[1:] + perm[:1] if b > 2 else perm
    _rows_match(ctx, perm, f"after permutation {perm}")


@invariant("INV-BATCH-002", "a batch's outputs equal those of its halves run separately (concatenation)",
           contract=8, adjust=lambda c: _distinct_temperatures(c if c.batch_size > 1 else c.with_(
               prompt_lens=c.prompt_lens * 2, response_lens=c.response_lens * 2)))
def concatenation(ctx: Ctx) -> None:
    b = ctx.case.batch_size
    for rows in (list(range(b // 2)), list(range(b // 2, b))):
        _rows_match(ctx, rows, f"run in the sub-batch {rows}")


@invariant("INV-DEV-002", "CPU and CUDA agree within tolerance on every output", contract=9, needs=("cuda",))
def cpu_cuda_agree(ctx: Ctx) -> None:
    on_cpu = execute(ctx.engine, ctx.case, "cpu").outputs
    on_cuda = execute(ctx.engine, ctx.case, "cuda").outputs
    _compare(on_cuda, on_cpu, "cuda vs cpu")


@invariant("INV-MUT-001", "prepare_model_inputs/outputs leave the micro-batch unchanged", contract=10)
def batch_not_mutated(ctx: Ctx) -> None:
    before, after = _tensor_items(ctx.run.snapshot), _tensor_items(ctx.run.micro_batch)
    if set(before) != set(after):
        fail(f"micro-batch keys changed: {sorted(before)} -> {sorted(after)}")
    for key in before:
        if not _same(before[key], after[key]):
            fail(f"micro-batch {key!r} was modified in place")


@invariant("INV-MUT-002", "prepare_model_outputs leaves the model's output tensors (logits) unchanged",
           contract=10)
def logits_not_mutated(ctx: Ctx) -> None:
    for r, (out, snap) in enumerate(zip(ctx.run.model_outputs, ctx.run.model_output_snapshots)):
        for key, before in snap.items():
            now = getattr(out, key)
            if not torch.equal(now.nan_to_num(1.0), before.nan_to_num(1.0)):
                fail(f"rank {r}: model output {key!r} was modified in place by prepare_model_outputs")


def _expect_error(ctx: Ctx, case, what: str) -> None:
    try:
        execute(ctx.engine, case, ctx.device)
    except Exception:  # noqa: BLE001 - any exception is a rejection; impl's types are tested elsewhere
        return
    fail(f"{what} was accepted silently; the contract makes it an error")


@invariant("INV-ERR-001", "a pad mode other than no_padding is rejected", contract=10, modes=("any",))
def rejects_pad_mode(ctx: Ctx) -> None:
    from ..materialize import PadMode, materialize

    mb = materialize(ctx.case, ctx.device)
    mb.set_non_tensor("pad_mode", PadMode.RIGHT if ctx.case.seed % 2 else PadMode.LEFT_RIGHT)
    try:
        execute(ctx.engine, ctx.case, ctx.device, micro_batch=mb)
    except Exception:  # noqa: BLE001
        return
    fail(f"pad_mode={mb['pad_mode']!r} was accepted silently")


@invariant("INV-ERR-002", "a static bucket together with top-K distillation is rejected", contract=10,
           modes=("packed",), needs=("bucket", "distillation"),
           adjust=lambda c: c.with_(pad_to_length=c.pad_to_length or 8, sp_size=1, use_fused_kernels=False,
                                    distillation_keys=c.distillation_keys or ("student_mass",)))
def rejects_bucket_with_topk(ctx: Ctx) -> None:
    _expect_error(ctx, ctx.case, f"bucket={ctx.case.pad_to_length} with top-K distillation")


@invariant("INV-ERR-003", "fused kernels with a per-sample temperature tensor are rejected", contract=10,
           needs=("fused",),
           adjust=lambda c: c.with_(use_fused_kernels=True, calculate_sum_pi_squared=False, distillation_keys=(),
                                    distillation_only=False,
                                    temperature=tuple(0.5 + 0.5 * i for i in range(c.batch_size))))
def rejects_fused_per_sample_temperature(ctx: Ctx) -> None:
    _expect_error(ctx, ctx.case, "use_fused_kernels with a per-sample temperature tensor")


@invariant("INV-CHUNK-001", "the entropy/log-prob chunk size (an engine setting) changes nothing in the outputs",
           contract=7, needs=("chunking",),
           adjust=lambda c: c.with_(entropy_chunk_size=c.entropy_chunk_size or 2, calculate_entropy=True))
def chunk_invariance(ctx: Ctx) -> None:
    whole = ctx.rerun(ctx.case.with_(entropy_chunk_size=None)).outputs
    _compare(ctx.run.outputs, whole, f"entropy_chunk_size={ctx.case.entropy_chunk_size} vs none")


@invariant("INV-MUT-004", "prepare_model_outputs leaves output_args unchanged", contract=10)
def output_args_not_mutated(ctx: Ctx) -> None:
    for r, (args, snap) in enumerate(zip(ctx.run.output_args, ctx.run.output_args_snapshots)):
        if set(args) != set(snap):
            fail(f"rank {r}: output_args keys changed: {sorted(snap)} -> {sorted(args)}")
        for key, before in snap.items():
            if not _same(before, args[key]):
                fail(f"rank {r}: output_args[{key!r}] was modified by prepare_model_outputs")
