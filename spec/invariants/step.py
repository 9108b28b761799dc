"""The training step (contract clause 15, docs/contract.md (The training step)): from the mini-batch to the loss and its
gradient, over every cut the engine's step layer allows.

Each check draws a :class:`spec.cases.step.StepCase` (lengths, DP size, the cut, the loss, its aggregation mode and
horizon, a seed) within the engine's :class:`~spec.protocol.step.StepLayer` and runs one step
(:func:`spec.execute.step.run_step`): the cut over ranks and micro-batches, each micro-batch through the engine's
preparation and the stand-in model with a trainable head, its loss backpropagated, the gradients averaged over the
ranks. What a check reads is what a consumer of the step reads: each sample's outputs at the positions a consumer
reads (:func:`spec.truth.rules.read_positions`), each micro-batch's keys for its samples, the losses every micro-batch
backpropagates (summed over a rank's micro-batches, averaged over the ranks) and the gradient the optimizer steps on.
Loss and gradient are compared with the float64 oracle of the uncut mini-batch (spec/truth/step_oracle.py) within its
bound; a mode a library documents as local is compared with that documented normalisation. Every aggregation mode of
every loss the layer offers is pinned (a two-micro-batch case each), so every run draws each one.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch

from ..cases.materialize import draws
from ..cases.step import StepCase, step_cases, step_inputs
from ..execute.harness import model_for
from ..execute.step import StepRun, cut_step, run_step, step_layer_of
from ..protocol.engine import OutputSpan
from ..protocol.profile import profile_of
from ..protocol.step import PROMPT_KEY, STEP_KEYS, Cut, Divisor, Scope
from ..truth.oracle import expected
from ..truth.rules import read_positions
from ..truth.step_model import StepModel
from ..truth.step_oracle import step_truth
from .core import CATALOGUE, Ctx, InvariantInfo, close, fail

__all__ = ["StepInfo", "pinned_steps"]

CONTRACT = 15  # the training step's clause in docs/contract.md


@dataclass(frozen=True)
class StepInfo(InvariantInfo):
    """An invariant of the whole training step: its cases are :class:`StepCase` within the engine's step layer."""

    #: the share of a profile's examples each step invariant draws (a step runs every micro-batch of every rank)
    example_share: float = 0.15

    def cases(self, mode, engine):  # noqa: ARG002 - the preparation's mode is drawn within the engine's profile
        return step_cases(step_layer_of(engine), modes=tuple(profile_of(engine).modes))

    def skip_reason_for(self, engine) -> str | None:
        layer = step_layer_of(engine)
        if layer is None:
            return f"engine {engine.name} declares no training step (EngineUnderTest.step_layer)"
        return layer.lacks()

    def pinned(self, mode: str, engine=None) -> list[StepCase]:  # noqa: ARG002
        return pinned_steps(step_layer_of(engine), tuple(profile_of(engine).modes)) if engine is not None else []


def pinned_steps(layer, modes: tuple[str, ...]) -> list[StepCase]:
    """Every aggregation mode of every loss the layer offers (each horizon), on two samples per rank whose responses
    differ in length, cut into two micro-batches per rank (over two ranks where the layer has them), with holes in the
    loss mask, each its own seed (a mode that reads prompt groups: an unequal two, the first straddling the ranks
    where there are two); and, where the layer cuts by a token budget over ranks, one case whose ranks need
    different micro-batch counts (rank 0's samples of 3 and 5 tokens under a budget of 5, rank 1's of 2 and 2)."""
    cut = Cut.COUNT if Cut.COUNT in layer.cuts else Cut.TOKENS
    dp = 2 if 2 in layer.dp_sizes else 1
    prompts, responses = (2, 1) * dp, (1, 4) * dp
    packed = modes[0] == "packed"
    cases = []
    for loss in layer.losses:
        for agg in loss.modes:
            groups = (len(prompts) - 1, 1) if agg.reads_prompts else ()
            for horizon in (loss.horizons if Divisor.HORIZON in agg.divisors else (None,)):
                cases.append(StepCase(prompts, responses, dp=dp, cut=cut.value, micro_batch_size=1,
                                      max_token_len=5 if cut is Cut.TOKENS else 0, loss=loss.name, mode=agg.name,
                                      horizon=horizon, use_remove_padding=packed, holes=0.3, topk=loss.topk,
                                      prompt_groups=groups, seed=1 + len(cases)))
    if Cut.TOKENS in layer.cuts and dp == 2:
        first = layer.losses[0]
        cases.append(StepCase((2, 2, 1, 1), (1, 3, 1, 1), dp=2, cut=Cut.TOKENS.value, max_token_len=5, loss=first.name,
                              mode=first.modes[0].name, horizon=first.horizons[0] if Divisor.HORIZON in
                              first.modes[0].divisors else None, use_remove_padding=packed, topk=first.topk, seed=0))
    return cases


def step_invariant(id: str, title: str, *, protects: str):
    def register(check):
        if id in CATALOGUE:
            raise ValueError(f"duplicate invariant id {id}")
        CATALOGUE[id] = StepInfo(id=id, title=title, contract=CONTRACT, check=check, modes=("any",), needs=(),
                                 kind="step", protects=protects)
        return check
    return register


def _step(ctx: Ctx) -> StepRun:
    return run_step(ctx.engine, ctx.case)


def _cut_text(run: StepRun) -> str:
    return "; ".join(f"rank {r}: {rows}" for r, rows in enumerate(run.rows))


def _truth(ctx: Ctx, run: StepRun):
    case, layer = ctx.case, step_layer_of(ctx.engine)
    loss = layer.loss(case.loss)
    agg = loss.mode(case.mode)
    groups = [rows for rank in run.rows for rows in rank if rows] if agg.scope is Scope.MICRO_BATCH else None
    model = StepModel(case.vocab, seed=case.seed, out_dim=1 if loss.head == "value" else None)
    return agg, step_truth(step_inputs(case), model.weight, loss.per_token, agg, case.horizon, groups, loss.parameters)


@step_invariant(
    "INV-STEP-001", "the step's per-sample outputs (log-probs, or a critic's values) restored to mini-batch order equal "
    "the per-sequence oracle's at every position a consumer reads, whatever the DP size, cut and loss",
    protects="each sample's log-probs and values after a training step are its own, in its place, on every rank")
def outputs_do_not_depend_on_the_cut(ctx: Ctx) -> None:
    case = ctx.case
    run = _step(ctx)
    whole = case.engine_case()
    want = expected(whole, model_for(whole, "cpu"), draws(whole))
    keys = ["values"] if whole.head == "value" else ["log_probs", *whole.distillation_keys]
    read = read_positions(whole.prompt_lens, whole.response_lens, getattr(ctx.engine, "output_span",
                                                                          OutputSpan.SEQUENCE))
    for rank, outputs in enumerate(run.outputs):
        for key in keys:
            _restored(ctx, run, rank, outputs, key, want, read)


def _restored(ctx: Ctx, run: StepRun, rank: int, outputs: dict, key: str, want, read) -> None:
    """Rank ``rank``'s restored output ``key``: nested over its samples, each the oracle's where a consumer reads."""
    case = ctx.case
    if key not in outputs:
        fail(f"rank {rank}: output {key!r} missing after the step's restore (keys {sorted(outputs)})", key=key)
    got = outputs[key]
    rows = case.rank_rows(rank)
    if not isinstance(got, torch.Tensor) or not got.is_nested or int(got.size(0)) != len(rows):
        fail(f"rank {rank}: {key!r} after the restore is {getattr(got, 'shape', type(got).__name__)}, expected "
             f"nested over its {len(rows)} samples", key=key)
    for sample, seq in zip(rows, got.unbind()):
        if seq.shape[0] != case.seq_lens[sample]:
            fail(f"rank {rank}: {key!r} of sample {sample}: {seq.shape[0]} tokens, expected "
                 f"{case.seq_lens[sample]} (another sample's? micro-batches {_cut_text(run)})", key=key)
        at = read[sample]
        close(seq[at], want.of(key)[sample][at], f"rank {rank}: {key!r} of sample {sample} (micro-batches "
              f"{_cut_text(run)})", atol=want.tolerance[key][sample][at])


@step_invariant(
    "INV-STEP-002", "the step's cut: every rank runs the same number of micro-batches, each rank's micro-batches "
    "partition its samples, and every micro-batch (a padding one included) carries every key of the mini-batch "
    "(the preparation's and the step's: response mask, old log-probs, advantages, old values, returns, and the prompt "
    "ids where handed) for its samples",
    protects="every rank joins every collective of the step, no sample is dropped or counted twice, and no "
             "micro-batch's loss reads a key it lacks or another sample's")
def the_cut(ctx: Ctx) -> None:
    run = cut_step(ctx.engine, ctx.case)
    counts = [len(micro) for micro in run.micro_batches]
    whole = run.error is None  # a step that raised on a rank handed its loss only some micro-batches: check those
    if whole and len(set(counts)) > 1:
        fail(f"ranks run {counts} micro-batches: every rank must run the same number (micro-batches {_cut_text(run)})")
    for rank, (micro, rows, mini) in enumerate(zip(run.micro_batches, run.rows, run.minis)):
        own = ctx.case.rank_rows(rank)
        # each step key's samples, unbound once per rank (torch 2.4's jagged tensors have no select())
        samples = {key: mini.get(key).unbind() for key in (*STEP_KEYS, PROMPT_KEY) if key in mini.keys()}
        for k, (mb, part) in enumerate(zip(micro, rows)):
            missing = sorted(key for key in (*STEP_KEYS, PROMPT_KEY, "input_ids")
                             if key in mini.keys() and key not in mb.keys())
            if missing:
                fail(f"rank {rank}, micro-batch {k} (samples {part}): keys {missing} missing (has {sorted(mb.keys())})",
                     key=missing[0])
            for key, want in (samples.items() if part else ()):  # a padding micro-batch holds no sample
                got = mb.get(key)
                local = [i - own[0] for i in part]
                if int(got.size(0)) != len(part) or not all(
                        torch.equal(g, want[i]) for g, i in zip(got.unbind(), local)):
                    fail(f"rank {rank}, micro-batch {k}: {key!r} is not its samples {part}'s", key=key)
        flat = sorted(i for part in rows for i in part)
        if whole and flat != own:
            fail(f"rank {rank}: micro-batches hold samples {rows}, no partition of its samples {own}")
    run.finish()  # on real ranks: what the framework's step raised after its cut, now the cut passed


@step_invariant(
    "INV-STEP-003", "the losses every micro-batch backpropagates, summed over a rank's micro-batches and averaged over "
    "the ranks, equal the float64 oracle's loss of the uncut mini-batch in the aggregation mode (or, for a mode the "
    "library documents as local, that documented normalisation) within the oracle's bound",
    protects="the logged and optimised loss does not depend on the DP size, the micro-batch count or the token budget")
def the_loss(ctx: Ctx) -> None:
    run = _step(ctx)
    agg, truth = _truth(ctx, run)
    if abs(run.loss - truth.loss) > truth.loss_bound:
        scope = "the uncut mini-batch's" if agg.scope is Scope.GLOBAL else f"the documented per-micro-batch ({agg.documented})"
        fail(f"{ctx.case.loss} loss in {agg.name}: the micro-batches' losses {run.losses} give {run.loss:.8g}, expected "
             f"{scope} {truth.loss:.8g} (|diff| {abs(run.loss - truth.loss):.3g} > allowed {truth.loss_bound:.3g}; "
             f"micro-batches {_cut_text(run)})", key="loss")


@step_invariant(
    "INV-STEP-004", "the gradient accumulated over a rank's micro-batches and averaged over the ranks (DDP/FSDP) equals "
    "the float64 oracle's gradient of the uncut mini-batch's loss in the aggregation mode (or the documented local "
    "normalisation) within the oracle's bound, element by element",
    protects="the optimizer's step does not depend on how the mini-batch was cut: no micro-batch or rank weighs more "
             "than its tokens")
def the_gradient(ctx: Ctx) -> None:
    run = _step(ctx)
    agg, truth = _truth(ctx, run)
    grad = run.grad.to(torch.float64)
    bad = (grad - truth.grad).abs() > truth.grad_bound
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        ratio = float(grad.norm() / truth.grad.norm().clamp(min=1e-300))
        fail(f"{ctx.case.loss} loss in {agg.name}: gradient at {idx} got {grad[idx].item():.8g}, expected "
             f"{truth.grad[idx].item():.8g} (allowed {truth.grad_bound[idx].item():.3g}; {int(bad.sum())} of "
             f"{bad.numel()} elements differ; |got| / |expected| = {ratio:.4g}; micro-batches {_cut_text(run)})",
             key="gradient")

