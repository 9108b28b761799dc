"""Megatron-style packing (spec/truth/megatron_packing.py): what its TP x CP design adds to the contract.

Each example checks every TP in {1, 2, 4} x CP in {1, 2, 4} x CP layout the engine offers (THD zig-zag CP also as
dynamic CP: ``local_cp_size``, the group taken per micro-batch); the
drawn case gives the sequence lengths and a seed from which the trailing dims ((L,), (L, K) or
(L, layers, top-k)), FP8 alignment, the static bucket (unless the case draws one) and the values
are chosen. Shrinking goes towards one short sequence, TP = CP = 1 failing first.
"""

from __future__ import annotations

import itertools

import torch

from ..truth.megatron_packing import PackSpec, ThdShard, case_bucket, full_loss_mask, nested_from, thd_alignment
from ..protocol.engine import ShardLayout
from .core import Ctx, fail, invariant

ANY = ("any",)
NEEDS = ("packing",)
SIZES = (1, 2, 4)
POISON = float("nan")


def _trailing(ctx: Ctx) -> tuple[int, ...]:
    return ((), (ctx.case.topk,), (2, ctx.case.topk))[ctx.case.seed % 3]


def _bucket(ctx: Ctx) -> int | None:
    return case_bucket(ctx.case)


def _specs(ctx: Ctx, *, bshd: bool = False) -> list[PackSpec]:
    fp8 = ctx.case.seed // 3 % 4 == 1
    layouts = (ShardLayout.ZIGZAG,) if bshd else ctx.engine.layouts
    specs = []
    for tp, cp, layout in itertools.product(SIZES, SIZES, layouts):
        if cp == 1 and layout is not layouts[0]:
            continue  # one CP rank: the layouts coincide
        specs.append(PackSpec(tp, cp, layout, fp8=fp8, bucket=None if bshd else _bucket(ctx)))
        if cp > 1 and not bshd and layout is ShardLayout.ZIGZAG:  # BSHD has no dynamic CP
            specs.append(PackSpec(tp, cp, layout, fp8=fp8, bucket=_bucket(ctx), dynamic=True))
    return specs


def _batch(ctx: Ctx, dtype=torch.float64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(ctx.case.seed)
    rows = [1.0 + torch.rand(n, *_trailing(ctx), generator=gen, dtype=torch.float64) for n in ctx.case.seq_lens]
    return nested_from([r.to(dtype) for r in rows])


class _at:
    """Name the parallel setting in any exception the engine raises while it is being checked."""

    def __init__(self, spec: PackSpec):
        self.spec = spec

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if exc is not None and not isinstance(exc, AssertionError):
            fail(f"[{self.spec}] the packer raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        return False


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    got_rows, want_rows = got.unbind(), want.unbind()
    if len(got_rows) != len(want_rows):
        fail(f"{what}: {len(got_rows)} sequences, expected {len(want_rows)}")
    for i, (a, b) in enumerate(zip(got_rows, want_rows)):
        if a.shape != b.shape or not torch.equal(a, b):
            fail(f"{what}: sequence {i} is {a.tolist()}, expected {b.tolist()}")


def _poisoned_thd(ctx: Ctx, x: torch.Tensor, spec: PackSpec, fill: float | None = None):
    """Every rank's shard with each padded row's values replaced by ``fill`` (default NaN; pads found by packing
    ones)."""
    packer = ctx.engine.packer
    ones = nested_from([torch.ones_like(t) for t in x.unbind()])
    shards = []
    for rank in range(spec.cp):
        shard = packer.pack_thd(x, spec, rank)
        valid = packer.pack_thd(ones, spec, rank).rows
        shard.rows = shard.rows.masked_fill(valid == 0, POISON if fill is None else fill)
        shards.append(shard)
    return shards


@invariant("INV-MEG-001", "packing round trip: postprocess(all ranks' preprocess(x)) == x for every TP x CP x "
           "layout, FP8 and bucket alignment, trailing dims, padding poisoned", contract=7, modes=ANY, needs=NEEDS,
           protects="what the model computed for a token comes back at that token, whatever the parallel layout")
def round_trip(ctx: Ctx) -> None:
    x = _batch(ctx)
    for spec in _specs(ctx):
        with _at(spec):
            _same(ctx.engine.packer.unpack_thd(_poisoned_thd(ctx, x, spec), x, spec), x, f"THD round trip [{spec}]")


@invariant("INV-MEG-002", "THD alignment: every sequence padded to a multiple of TP x CP (x2 zig-zag; FP8 "
           "lcm(16, .)), the total to CP (FP8: 128 x align; bucket: lcm(bucket, align)); equal shards per rank",
           contract=7, modes=ANY, needs=NEEDS,
           protects="TE/flash varlen kernels and the CP split get the shapes they require")
def alignment(ctx: Ctx) -> None:
    x = _batch(ctx)
    lens = torch.tensor(ctx.case.seq_lens)
    for spec in _specs(ctx):
        align, total_align = thd_alignment(spec)
        with _at(spec):
            shards = [ctx.engine.packer.pack_thd(x, spec, rank) for rank in range(spec.cp)]
        cu = shards[0].cu_seqlens_padded.cpu().long()
        padded = cu.diff()
        total = int(cu[-1])
        if int(cu[0]) != 0 or bool((padded < lens).any()):
            fail(f"[{spec}] cu_seqlens_padded {cu.tolist()} does not hold the lengths {lens.tolist()}")
        if bool((padded[:-1] % align).any()) or total % total_align:
            fail(f"[{spec}] padded lengths {padded.tolist()} (total {total}): each sequence must be a multiple of "
                 f"{align} (the last one may take the total's padding), the total of {total_align}")
        for rank, shard in enumerate(shards):
            if shard.rows.shape[1] * spec.cp != total or not torch.equal(shard.cu_seqlens_padded.cpu().long(), cu):
                fail(f"[{spec}] rank {rank} holds {shard.rows.shape[1]} rows (cu {shard.cu_seqlens_padded.tolist()}); "
                     f"expected {total}/{spec.cp} rows and cu {cu.tolist()}")


@invariant("INV-MEG-003", "re-assembled THD positions equal arange(len_i) for every sequence", contract=1,
           modes=ANY, needs=NEEDS, protects="rotary positions restart at every sequence on every rank")
def positions(ctx: Ctx) -> None:
    x = _batch(ctx)
    want = nested_from([torch.arange(n) for n in ctx.case.seq_lens])
    for spec in _specs(ctx):
        with _at(spec):
            shards = [ctx.engine.packer.pack_thd(x, spec, rank) for rank in range(spec.cp)]
            for shard in shards:
                shard.rows = shard.positions.reshape(1, -1).long()
            _same(ctx.engine.packer.unpack_thd(shards, want, spec), want, f"positions [{spec}]")


@invariant("INV-MEG-004", "THD and BSHD labels (need_roll) hold the next token within each sequence on every rank",
           contract=5, modes=ANY, needs=NEEDS,
           protects="log-probs score the next token of the same sequence, never a neighbour's or a shard edge's")
def labels(ctx: Ctx) -> None:
    x, packer = _batch(ctx), ctx.engine.packer
    for spec in _specs(ctx):
        with _at(spec):
            got = packer.unpack_thd([packer.pack_thd(x, spec, rank, need_roll=True) for rank in range(spec.cp)], x, spec)
        _next_tokens(got, x, f"THD labels [{spec}]")
    for spec in _specs(ctx, bshd=True):
        with _at(spec):
            got = packer.unpack_bshd([packer.pack_bshd(x, spec, rank, need_roll=True) for rank in range(spec.cp)], x,
                                     spec)
        _next_tokens(got, x, f"BSHD labels [{spec}]")


def _next_tokens(got: torch.Tensor, x: torch.Tensor, what: str) -> None:
    for i, (a, seq) in enumerate(zip(got.unbind(), x.unbind())):
        if a.shape != seq.shape or not torch.equal(a[:-1], seq[1:]):
            fail(f"{what}: sequence {i} got {a.tolist()}, expected the next tokens {seq[1:].tolist()} (then anything)")


@invariant("INV-MEG-005", "BSHD and THD agree: both round trips return x (BSHD padding poisoned), zig-zag CP",
           contract=3, modes=ANY, needs=NEEDS,
           protects="switching data_format between thd and bshd changes no per-token output")
def thd_vs_bshd(ctx: Ctx) -> None:
    x = _batch(ctx)
    packer = ctx.engine.packer
    for spec in _specs(ctx, bshd=True):
        with _at(spec):
            shards = []
            for rank in range(spec.cp):
                rows, mask, pos = packer.pack_bshd(x, spec, rank)
                keep = mask.view(*mask.shape, *([1] * (rows.dim() - 2)))
                shards.append((rows.masked_fill(~keep.bool(), POISON), mask, pos))
            bshd = packer.unpack_bshd(shards, x, spec)
            _same(bshd, x, f"BSHD round trip [{spec}]")
            thd = packer.unpack_thd([packer.pack_thd(x, spec, rank) for rank in range(spec.cp)], x, spec)
            _same(bshd, thd, f"BSHD vs THD [{spec}]")


@invariant("INV-MEG-007", "pipeline stages: a stage after the first is handed the first stage's packed boundaries "
           "(no positions); a stage before the last hands its output on untouched, THD and BSHD", contract=7,
           modes=ANY, needs=NEEDS,
           protects="every pipeline stage attends within the same sequences, and the hidden states a stage hands on "
                    "reach the next stage as it computed them")
def pipeline_stages(ctx: Ctx) -> None:
    x, packer = _batch(ctx), ctx.engine.packer
    for spec in _specs(ctx):
        with _at(spec):
            for rank in range(spec.cp):
                first = packer.pack_thd(x, spec, rank)
                later = packer.later_stage_thd(x, spec, rank)
                want, got = first.cu_seqlens_padded.tolist(), later.cu_seqlens_padded.tolist()
                if got != want:
                    fail(f"pipeline stage after the first [{spec}] rank {rank}: packed boundaries {got}, the first "
                         f"stage's {want}")
                if later.positions is not None:
                    fail(f"pipeline stage after the first [{spec}] rank {rank}: handed positions (its input is the "
                         "stage before's hidden states)")
                _handed_on(packer.hand_on_thd(first.rows, first, x, spec, rank), first.rows, f"[{spec}] rank {rank}",
                           "THD")
    for spec in _specs(ctx, bshd=True):
        with _at(spec):
            for rank in range(spec.cp):
                rows, mask, _pos = packer.pack_bshd(x, spec, rank)
                _handed_on(packer.hand_on_bshd(rows, mask, spec, rank), rows, f"[{spec}] rank {rank}", "BSHD")


def _handed_on(handed: torch.Tensor, output: torch.Tensor, where: str, layout: str) -> None:
    """A stage before the last hands on its ``layout`` output as it computed it (INV-MEG-007, THD and BSHD alike)."""
    if handed.shape != output.shape or not torch.equal(handed, output):
        fail(f"pipeline stage before the last {where}: hands on {tuple(handed.shape)} other than its {layout} output "
             f"{tuple(output.shape)}")


def _mtp_batch(ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids (distinct values, one per token) and a response mask with holes (a tool's output), from the seed."""
    gen = torch.Generator().manual_seed(ctx.case.seed)
    ids = nested_from([1.0 + torch.rand(n, generator=gen, dtype=torch.float64) for n in ctx.case.seq_lens])
    response = nested_from([torch.rand(r, generator=gen) < 0.75 for r in ctx.case.response_lens])
    return ids, response


def _like(handed: torch.Tensor | None, rows: torch.Tensor, what: str, rank: int) -> torch.Tensor:
    """What the model was handed on ``rank``, in float64, where it has the ids' packed shape there (THD and BSHD)."""
    if handed is None or tuple(handed.shape) != tuple(rows.shape):
        fail(f"{what} on rank {rank}: handed {None if handed is None else tuple(handed.shape)}, expected the ids' "
             f"packed shape {tuple(rows.shape)}")
    return handed.to(torch.float64)


def _replaced(shards: list[ThdShard], rows: list[torch.Tensor], what: str) -> list[ThdShard]:
    """The packed shards of the ids with each rank's rows replaced by what the model was handed there."""
    return [ThdShard(_like(handed, shard.rows, what, rank), shard.positions, shard.cu_seqlens_padded, shard.state)
            for rank, (shard, handed) in enumerate(zip(shards, rows))]


def _mtp_mask(got: torch.Tensor, full: torch.Tensor, what: str) -> None:
    for i, (a, want) in enumerate(zip(got.unbind(), full.unbind())):
        expected = torch.cat([want[1:], want.new_zeros(1)]).to(torch.float64)
        if a.shape != expected.shape or not torch.equal(a.to(torch.float64), expected):
            fail(f"{what}: sequence {i} got {a.tolist()}, expected the next token's loss mask {expected.tolist()} "
                 "(0 at the last token)")


def _counted(handed: list[torch.Tensor], full: torch.Tensor, what: str) -> None:
    counted, want = sum(float(h.to(torch.float64).sum()) for h in handed), float(full.values().sum())
    if counted != want:
        fail(f"{what}: the ranks' loss masks count {counted:g} positions, the sequences' {want:g} (padding counted)")


def _targets_checked(labels: torch.Tensor, masks: torch.Tensor, handed: list, x: torch.Tensor, full: torch.Tensor,
                     layout: str, spec: PackSpec, where: str) -> None:
    """What both layouts promise of the re-assembled MTP targets: the next tokens, the next token's loss mask, and
    no padding row counted on any rank."""
    _next_tokens(labels, x, f"{layout} MTP labels [{spec}]")
    _mtp_mask(masks, full, f"{layout} MTP loss mask [{spec}] {where}")
    _counted([h.loss_mask for h in handed], full, f"{layout} MTP loss mask [{spec}] {where}")


def _sampled(specs: list[PackSpec], seed: int, k: int) -> list[PackSpec]:
    """The first spec (one rank: where a failing case shrinks) and ``k`` more picked by ``seed``, in order: a check
    that runs the engine's whole forward per spec and rank covers every spec across a run's examples, not each in
    every example."""
    rest = specs[1:]
    picked = {(seed * 7919 + i * 104729) % len(rest) for i in range(k)} if rest else set()
    return [specs[0], *(rest[i] for i in sorted(picked))]


@invariant("INV-MEG-008", "multi-token prediction: the model is handed, packed like the ids on every rank, the next "
           "token of the same sequence as its label and the next token's loss mask (the prompt's zeros, then the "
           "response mask; 0 at a sequence's last token and on padding), THD and BSHD; THD also the rotary positions "
           "and the step's loss normalization factor (one rank and a few TP x CP x layout picked by the seed per "
           "example)", contract=5, modes=ANY, needs=NEEDS,
           protects="the MTP loss trains each position on its own sequence's next tokens, over exactly the response "
                    "tokens the policy loss counts, scaled as the step asks")
def mtp_targets(ctx: Ctx) -> None:
    x, response = _mtp_batch(ctx)
    full = full_loss_mask(response, list(ctx.case.seq_lens))
    factor = (None, 0.5, 1.25)[ctx.case.seed % 3]
    dense = ctx.case.seed // 7 % 2 == 1
    packer, where = ctx.engine.packer, f"(loss mask handed {'padded' if dense else 'nested'})"
    positions = nested_from([torch.arange(n, dtype=torch.float64) for n in ctx.case.seq_lens])
    for spec in _sampled(_specs(ctx), ctx.case.seed, 2):
        with _at(spec):
            handed = [packer.mtp_targets(x, response, spec, rank, packed=True, factor=factor, dense_mask=dense)
                      for rank in range(spec.cp)]
            shards = [packer.pack_thd(x, spec, rank) for rank in range(spec.cp)]
            labels = packer.unpack_thd(_replaced(shards, [h.labels for h in handed], "MTP labels"), x, spec)
            masks = packer.unpack_thd(_replaced(shards, [h.loss_mask for h in handed], "MTP loss mask"), x, spec)
            rotary = packer.unpack_thd(_replaced(shards, [h.positions for h in handed], "MTP positions"), x,
                                       spec)
        _targets_checked(labels, masks, handed, x, full, "THD", spec, where)
        _same(rotary, positions, f"THD MTP positions [{spec}]")
        for rank, h in enumerate(handed):
            if h.factor != factor:
                fail(f"THD MTP [{spec}] rank {rank}: loss normalization factor {h.factor!r} on packed_seq_params, "
                     f"the step's {factor!r}")
    for spec in _sampled(_specs(ctx, bshd=True), ctx.case.seed, 1):
        with _at(spec):
            handed = [packer.mtp_targets(x, response, spec, rank, packed=False, dense_mask=dense)
                      for rank in range(spec.cp)]
            shards = [packer.pack_bshd(x, spec, rank) for rank in range(spec.cp)]
            labels = packer.unpack_bshd([(_like(h.labels, r, f"BSHD MTP labels [{spec}]", rank), m, p)
                                         for rank, (h, (r, m, p)) in enumerate(zip(handed, shards))], x, spec)
            masks = packer.unpack_bshd([(_like(h.loss_mask, r, f"BSHD MTP loss mask [{spec}]", rank), m, p)
                                        for rank, (h, (r, m, p)) in enumerate(zip(handed, shards))], x, spec)
        _targets_checked(labels, masks, handed, x, full, "BSHD", spec, where)
