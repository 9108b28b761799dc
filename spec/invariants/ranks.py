"""Invariants on real ranks: sequence parallelism run in separate processes over ``torch.distributed``.

Each check runs its case on ``sp_size`` real ranks (:mod:`spec.execute.ranks`: gloo on CPU, nccl on CUDA),
whatever seam the engine offers for simulated ranks: impl gathers through
``TorchDistributedAllGather`` on the real group, verl through its own Ulysses path. ``adjust``
forces ``sp`` into 2..4 (a case drawn with ``sp = 1`` gets ``2 + seed % 3``, so failures shrink
to ``sp = 2``). All need ``sp`` and ``real_ranks``: an engine without them is skipped with the reason.

Every one also draws a process topology (:mod:`spec.cases.topology`, printed as ``sp_groups=``): one SP group
``[0, sp)`` (the simplest, where failures shrink to), or in a third to a half of the cases one group elsewhere in
the pool or ``dp`` groups contiguous or interleaved (then ``sp`` is the topology's group size), so a group may
start at a global rank other than 0 and a rank's group rank may differ from its global one. Every group runs its
own micro-batch (the case with the seed ``seed + g``) and the check runs on each group's run in turn
(:func:`_on_every_group`); a failure names the group and its global ranks.
"""

from __future__ import annotations

from functools import wraps
from typing import Callable

import torch
from hypothesis import strategies as st

from ..cases.structure import EngineCase
from ..cases.topology_draws import topologies
from ..execute.harness import Run
from ..execute.ranks import MAX_WORLD
from ..protocol.profile import Feature, tail_multiple_of
from ..truth import rank_checks as checks
from ..truth.rank_checks import restarts as _restarts
from ..truth.rules import padded_length, token_temperatures
from .core import VALUE_FACTS, Ctx, fail, invariant, match_oracle, match_runs
from .outputs import leaked
from .reproduction import Plan

PACKED = ("packed",)
NEEDS = ("sp", "real_ranks")


def _with_topology(case: EngineCase) -> st.SearchStrategy:
    """The adjusted case with a drawn process topology within the pool, its ``sp`` the topology's group size
    (None, where it shrinks to: one group [0, sp) of the case's own ``sp``)."""
    return topologies(None, MAX_WORLD).map(
        lambda topology: case if topology is None else case.with_(topology=topology, sp_size=topology.sp))


def _on_every_group(check: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
    """``check`` on every SP group of the case's topology: group 0 on ``ctx`` (its run executes the whole
    topology once), then each further group on a context of its own case and run. A failed check names the
    group, its global ranks and its seed."""
    @wraps(check)
    def every_group(ctx: Ctx) -> None:
        topology = ctx.case.topology
        if topology is None:
            check(ctx)
            return
        _in_group(check, ctx, 0)
        key = "_real_run" if "_real_run" in ctx.__dict__ else "_real_inputs"
        run = ctx.__dict__.get(key)
        for g in range(1, topology.dp if run is not None else 1):
            sub = Ctx(ctx.engine, run.groups[g].case, ctx.device, ctx.mode)
            sub.__dict__[key] = run.groups[g]
            _in_group(check, sub, g)
            ctx.vacuous = ctx.vacuous or sub.vacuous
    return every_group


def _in_group(check: Callable[[Ctx], None], ctx: Ctx, g: int) -> None:
    topology = ctx.case.topology
    try:
        check(ctx)
    except AssertionError as exc:
        raise AssertionError(f"SP group {g} of sp_groups={topology!r} (global ranks {list(topology.groups[g])}, "
                             f"seed {ctx.case.seed}): {exc}") from exc


def rank_invariant(id: str, title: str, **kwargs) -> Callable:
    """:func:`spec.invariants.core.invariant` with a drawn topology, the check run on every SP group."""
    def register(check: Callable[[Ctx], None]) -> Callable[[Ctx], None]:
        invariant(id, title, draw_after=_with_topology, **kwargs)(_on_every_group(check))
        return check
    return register


def _sp(case: EngineCase) -> int:
    return case.sp_size if case.sp_size > 1 else 2 + case.seed % 3


def _on_ranks(case: EngineCase) -> EngineCase:
    """sp in 2..4, packed; top-K distillation only where an invariant asks for it."""
    return case.with_(sp_size=_sp(case), use_remove_padding=True, distillation_keys=(), distillation_only=False)


def _real(ctx: Ctx, *, inputs_only: bool = False) -> Run:
    """The case on real ranks (cached on the context, and made once per example: :class:`~spec.execute.memo.Runs`)."""
    key = "_real_inputs" if inputs_only else "_real_run"
    if "_real_run" in ctx.__dict__:
        return ctx.__dict__["_real_run"]
    if key not in ctx.__dict__:  # made once per example for every check that asks it (:class:`Ctx`'s ``runs``)
        ctx.__dict__[key] = ctx.runs.on_ranks(ctx.engine, ctx.case, ctx.device, stop_after_inputs=inputs_only)
    return ctx.__dict__[key]


def _padded_len(case: EngineCase, engine) -> int:
    """The packed row's length: the bucket, the engine's tail rule on the case (its profile's ``tail_multiple``, or a
    drawn switch's), sp."""
    return padded_length(case.total_nnz, case.pad_to_length, case.sp_size, tail_multiple_of(engine, case))


def _field(run: Run, name: str) -> list:
    """What every rank's view of the hand-off carries under ``name``, in rank order."""
    return [getattr(view, name) for view in run.views]


def _handed_temperatures(ctx: Ctx, run: Run) -> list | None:
    """Every rank's per-token temperature hand-off, or None for an engine that hands its output step none (it
    lacks :attr:`Feature.TEMPERATURE_HANDOFF`: one float per forward, SkyRL's)."""
    return None if ctx.engine.lacks(Feature.TEMPERATURE_HANDOFF) else _field(run, "temperature")


def _replicated(run: Run) -> bool:
    """Every rank was handed the whole padded row rather than its slice (:func:`spec.truth.rank_checks.replicated`)."""
    return checks.replicated(_field(run, "input_ids"), _field(run, "labels"))


def _rows(run: Run, key: str) -> torch.Tensor:
    """Model input ``key`` over the whole padded row: the ranks' slices joined (or the replicated row)."""
    return checks.joined_row(_field(run, key), _replicated(run))


def _token_temperature(case: EngineCase, rank: int, view) -> torch.Tensor:
    """The per-token temperature one rank hands its output step, flat on the CPU."""
    if not isinstance(view.temperature, torch.Tensor):
        fail(f"sp={case.sp_size} rank {rank}: the hand-off carries temperature {view.temperature!r}, expected one "
             "per token")
    return view.temperature.reshape(-1).cpu()


def _check_outputs_equal_across_ranks(run: Run) -> None:
    base = run.rank_outputs[0]
    for r, outputs in enumerate(run.rank_outputs[1:], start=1):
        if set(outputs) != set(base):
            fail(f"rank {r} returns keys {sorted(outputs)}, rank 0 {sorted(base)}")
        for key in base:
            a, b = outputs[key], base[key]
            if a.is_nested != b.is_nested or not _identical(a.values() if a.is_nested else a,
                                                            b.values() if b.is_nested else b):
                fail(f"rank {r}'s {key!r} differs from rank 0's (every rank must hold the gathered row)")


def _identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape, dtype and values, NaN equal to NaN at the same place (two ranks holding one gathered row
    agree on a NaN; whether it should be there is the value invariants' finding, reported once)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    same = a == b
    if a.is_floating_point():
        same |= a.isnan() & b.isnan()
    return bool(same.all())


@rank_invariant("INV-RANK-001", "on real ranks (gloo/nccl) every output key of every rank equals the single-rank run",
                contract=7, facts=VALUE_FACTS, modes=PACKED, needs=NEEDS, adjust=_on_ranks,
                protects="a trainer's log-probs, entropy and sum_pi_squared do not depend on the Ulysses world size",
                repro=Plan(("keys", "values"), real_ranks=True))
def ranks_match_single(ctx: Ctx) -> None:
    """Every rank returns the same gathered outputs, key for key, equal to the ``sp = 1`` run."""
    run = _real(ctx)
    single = ctx.rerun(ctx.case.with_(sp_size=1)).outputs
    for r, outputs in enumerate(run.rank_outputs):
        if set(outputs) != set(single):
            fail(f"sp={ctx.case.sp_size} rank {r} keys {sorted(outputs)}, sp=1 keys {sorted(single)}")
        match_runs(ctx, outputs, single, f"sp={ctx.case.sp_size} rank {r} vs sp=1")
    _check_outputs_equal_across_ranks(run)


@rank_invariant("INV-RANK-009", "on real ranks (gloo/nccl) a value head's values on every rank equal the single-rank "
                "run", contract=7, modes=PACKED, needs=(*NEEDS, "value"), adjust=_on_ranks, head="value",
                facts=VALUE_FACTS,
                protects="a PPO critic's values do not depend on the Ulysses world size (a critic under SP is an "
                         "ordinary configuration)", repro=Plan(("keys", "values"), real_ranks=True))
def critic_ranks_match_single(ctx: Ctx) -> None:
    """INV-RANK-001 for the value head: every rank returns the gathered values, equal to the ``sp = 1`` run."""
    ranks_match_single(ctx)  # the plain check (rank_invariant returns it unwrapped): this one runs on every group


def _rank_labels(ctx: Ctx, *, exact: bool) -> None:
    """Each rank's labels (and fused shift_labels) against its slice of the global row rolled by one: at the
    positions whose label is read, or (``exact``) everywhere, the unread wrap and the zero tail included."""
    run = _real(ctx, inputs_only=True)
    case = ctx.case
    checks.rank_labels(_field(run, "labels"), _field(run, "model_labels"), run.micro_batch["input_ids"].values(),
                       case.seq_lens, _padded_len(case, ctx.engine), case.sp_size, case.use_fused_kernels, exact)


@rank_invariant("INV-RANK-002", "on real ranks each rank's rolled labels (and fused shift_labels) hold, at every position "
           "whose label is read, its slice of the global packed row rolled left by one", contract=5, modes=PACKED,
           needs=NEEDS, adjust=_on_ranks,
           protects="no label is read across a shard edge: the token after each shard's last one is the next "
                    "rank's first", repro=Plan(("shard_labels", "keys", "values"), real_ranks=True))
def ranks_global_roll(ctx: Ctx) -> None:
    """Positions whose label no response slice reads (each sequence's last token: the wrap; the tail padding) are
    the layout check INV-RANK-008's."""
    _rank_labels(ctx, exact=False)


@rank_invariant("INV-RANK-008", "on real ranks each rank's rolled labels are exactly its slice of the global packed row "
           "rolled left by one (the wrap at each sequence end included), then padded with 0", contract=5,
           modes=PACKED, needs=NEEDS, adjust=_on_ranks, layout=True,
           protects="verl's exact rolled row on every rank: the wrap at each sequence end and the zero tail, which "
                    "no response slice reads", repro=Plan(("rank_roll_exact",), real_ranks=True))
def ranks_global_roll_exact(ctx: Ctx) -> None:
    _rank_labels(ctx, exact=True)


@rank_invariant("INV-RANK-003", "on real ranks pad_size = bucket pad + sequence-parallel pad (0 when the token count "
           "divides the world size), each rank holds (total + pad) / sp tokens, the tail's positions restart at 0 "
           "with temperature 1 (its ids are the engine's: nothing reads them), and the outputs hold exactly the "
           "unpadded tokens", contract=7, modes=PACKED,
           needs=NEEDS, adjust=_on_ranks,
           protects="the padding a rank adds is exactly what the gather removes: no real token is lost or added",
                repro=Plan(("rank_pad",), real_ranks=True))
def ranks_pad_and_tail(ctx: Ctx) -> None:
    run = _real(ctx)
    case = ctx.case
    checks.rank_pad_and_tail(_field(run, "input_ids"), _field(run, "position_ids"), _field(run, "labels"),
                             _handed_temperatures(ctx, run), _field(run, "pad_size"), run.rank_outputs, case.seq_lens,
                             _padded_len(case, ctx.engine), case.sp_size, case.pad_to_length, case.mrope,
                             lambda key, value: leaked(ctx, key, value))


def _mrope_temperatures(case: EngineCase) -> EngineCase:
    return _on_ranks(case).with_(mrope=True, use_fused_kernels=False,
                                 temperature=tuple(0.5 + 0.75 * ((i * 5) % 4) for i in range(case.batch_size)))


@rank_invariant("INV-RANK-004", "on real ranks with mRoPE positions and per-sample temperatures: each rank's (4, 1, n) "
           "positions (its slice, or the whole row on every rank) and temperatures (its slice) follow the global "
           "row, outputs equal the oracle", contract=6, facts=VALUE_FACTS,
           modes=PACKED, needs=NEEDS, adjust=_mrope_temperatures,
           protects="multi-axis positions and each sample's temperature follow its tokens onto whichever rank "
                    "holds them", repro=Plan(("packed_inputs", "keys", "values"), real_ranks=True))
def ranks_mrope_temperature(ctx: Ctx) -> None:
    if not ctx.case.mrope:  # the adjusted case moved into the profile (spec.invariants.core.within_profile)
        ctx.not_exercised("the engine takes no mRoPE positions in the packed mode (its profile)")
        return
    run = _real(ctx)
    case = ctx.case
    total, padded = case.total_nnz, _padded_len(case, ctx.engine)
    local = padded // case.sp_size
    pos = run.micro_batch["position_ids"].values().cpu()  # (4, total)
    row = _rows(run, "position_ids")  # (4, 1, padded): the slices joined, or the row every rank got
    if tuple(row.shape) != (pos.shape[0], 1, padded) or not torch.equal(row[:, 0, :total], pos) \
            or not _restarts(row[:, 0, total:]):
        fail(f"sp={case.sp_size}: the ranks' position_ids make {tuple(row.shape)} {row.tolist()}, expected "
             f"({pos.shape[0]}, 1, {padded}) starting {pos.tolist()} with a tail from 0")
    want_temp = torch.cat([token_temperatures(case), torch.ones(padded - total)])
    for r, view in enumerate(run.views):
        got = view.position_ids.cpu()
        mine = row if _replicated(run) else row[..., r * local:(r + 1) * local]
        if tuple(got.shape) != tuple(mine.shape) or not torch.equal(got, mine):
            fail(f"sp={case.sp_size} rank {r}: position_ids {tuple(got.shape)} {got.tolist()}, expected "
                 f"{tuple(mine.shape)} {mine.tolist()}")
        temps = _token_temperature(case, r, view).float()
        if temps.shape[0] != local or not torch.allclose(temps, want_temp[r * local:(r + 1) * local]):
            fail(f"sp={case.sp_size} rank {r}: per-token temperature {temps.tolist()}, expected "
                 f"{want_temp[r * local:(r + 1) * local].tolist()}")
    for r, outputs in enumerate(run.rank_outputs):
        match_oracle(ctx, "log_probs", outputs["log_probs"], f"at T={list(case.temperatures())} (sp={case.sp_size} "
                     f"rank {r})")


def _distillation(case: EngineCase) -> EngineCase:
    keys = case.distillation_keys or ("distillation_losses", "student_mass", "overlap_count")
    return case.with_(sp_size=_sp(case), use_remove_padding=True, distillation_keys=keys, use_fused_kernels=False,
                      pad_to_length=None)


@rank_invariant("INV-RANK-005", "on real ranks with top-K distillation every distillation key equals the oracle (the "
           "processor gets each rank's shard of the scaled logits and aligns the teacher tensors with it)",
           contract=3, facts=VALUE_FACTS, modes=PACKED, needs=NEEDS + ("distillation",), adjust=_distillation,
           protects="distillation losses and masses are computed against the teacher's top-K of the same token "
                    "on every rank", repro=Plan(("keys", "values"), real_ranks=True))
def ranks_distillation(ctx: Ctx) -> None:
    run = _real(ctx)
    for r, outputs in enumerate(run.rank_outputs):
        for key in ctx.case.distillation_keys:
            if key not in outputs:
                fail(f"sp={ctx.case.sp_size} rank {r}: outputs lack distillation key {key!r} ({sorted(outputs)})")
            match_oracle(ctx, key, outputs[key], f"(sp={ctx.case.sp_size} rank {r})")


@rank_invariant("INV-RANK-006", "on real ranks each rank's model inputs are (1, n) ids and (1, n) or (4, 1, n) "
           "positions (n = its n_local slice, or the whole row on every rank), the labels and temperature it hands "
           "its output step (whatever their private shape) and fused shift_labels have the n_local tokens the model "
           "returns, and n_local * sp = total_nnz + pad_size on every rank",
           contract=2, modes=PACKED, needs=NEEDS, adjust=_on_ranks,
           protects="what a rank hands the model and what it reads back from the model's output describe the "
                    "same tokens", repro=Plan(("rank_shapes",), real_ranks=True))
def ranks_shape_contract(ctx: Ctx) -> None:
    run = _real(ctx, inputs_only=True)
    case = ctx.case
    checks.rank_shapes(_field(run, "input_ids"), _field(run, "position_ids"), _field(run, "labels"),
                       _handed_temperatures(ctx, run), _field(run, "model_labels"), _field(run, "pad_size"),
                       case.total_nnz, case.sp_size, 4 if case.mrope else None, case.use_fused_kernels)


def _bucket_fused(case: EngineCase) -> EngineCase:
    return _on_ranks(case).with_(pad_to_length=case.pad_to_length or (4, 7, 8)[case.seed % 3],
                                 use_fused_kernels=True, temperature=case.temperatures()[0],
                                 calculate_sum_pi_squared=False)


@rank_invariant("INV-RANK-007", "on real ranks with a static bucket and fused kernels: log_probs (and entropy) equal "
           "the oracle on every rank", contract=7, facts=VALUE_FACTS, modes=PACKED, needs=NEEDS + ("bucket", "fused"),
           adjust=_bucket_fused,
           protects="a fused-kernel model scores the global next token even when the row is bucket-padded and "
                    "sharded", repro=Plan(("keys", "values"), real_ranks=True))
def ranks_bucket_fused(ctx: Ctx) -> None:
    run = _real(ctx)
    for r, outputs in enumerate(run.rank_outputs):
        what = f"(sp={ctx.case.sp_size} bucket={ctx.case.pad_to_length} rank {r})"
        match_oracle(ctx, "log_probs", outputs["log_probs"], what)
        if ctx.case.calculate_entropy:
            match_oracle(ctx, "entropy", outputs["entropy"], what)
