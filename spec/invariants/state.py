"""Invariants of an engine object kept across micro-batches, as a trainer keeps it: what a call returns
must not depend on the calls before it, and must not change what they returned.

Every other invariant builds a fresh engine object per run, so a cache keyed on a shape, a flag
read once, or an output buffer reused between calls never shows there. Here one engine object
first prepares a *sibling* micro-batch (:func:`sibling`: the same ``(B, L)`` with other rows, other
tokens, logits and temperatures, entropy asked the other way round), then the drawn case.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any


from ..cases.structure import EngineCase
from ..execute.harness import Run, execute
from .batch import two_or_more
from ..truth import state_checks as checks
from .core import VALUE_FACTS, Ctx, held, invariant, match_runs
from .reproduction import Plan

__all__ = ["sibling"]


def _other_rows(case: EngineCase) -> tuple[tuple[int, ...], tuple[int, ...], list[int]]:
    """Prompt and response lengths for the same ``(B, L)`` in another arrangement, and the row order used."""
    b = case.batch_size
    for order in (list(range(b))[::-1], list(range(1, b)) + [0]):
        prompts, responses = (tuple(case.prompt_lens[i] for i in order),
                              tuple(case.response_lens[i] for i in order))
        if (prompts, responses) != (case.prompt_lens, case.response_lens):
            return prompts, responses, order
    # every row alike: the rows after the first give up a token where they have one to spare
    prompts, responses = list(case.prompt_lens), list(case.response_lens)
    for i in range(1, b):
        if responses[i] > 1:
            responses[i] -= 1
        elif prompts[i] > 1:
            prompts[i] -= 1
    return tuple(prompts), tuple(responses), list(range(b))


def sibling(case: EngineCase) -> EngineCase:
    """The micro-batch a reused engine object prepares before ``case``: the same ``(B, L)`` (the rows reordered,
    or shortened when they are all alike), other tokens and logits (the next seed), other temperatures and
    entropy asked the other way round."""
    prompts, responses, order = _other_rows(case)
    if isinstance(case.temperature, tuple):
        temperature: float | tuple[float, ...] = tuple(case.temperature[i] for i in order)
        if temperature == case.temperature:
            temperature = tuple(0.7 * t for t in case.temperature)
    else:
        temperature = 0.7 if case.temperature == 1.0 else 1.0
    return case.with_(prompt_lens=prompts, response_lens=responses, temperature=temperature,
                      calculate_entropy=not case.calculate_entropy, seed=int(case.seed) + 1)


def sibling_first(case: EngineCase) -> list[tuple[str, EngineCase]]:
    """The runs of a reproducer of a reused engine object: its :func:`sibling` first, then the case."""
    return [("the micro-batch before it (the same (B, L), other rows, tokens and temperatures)", sibling(case)),
            ("the case", case)]


def _one_rank(case: EngineCase) -> EngineCase:
    """One rank (engine objects are reused per rank) and two samples or more (rows to rearrange)."""
    return two_or_more(case).with_(sp_size=1)


def _view_fields(run: Run) -> dict[str, Any]:
    """The normalized hand-off of the run's one rank (``extra``, an engine's own objects, left out)."""
    view = run.views[0]
    return {f.name: getattr(view, f.name) for f in fields(view) if f.name != "extra"}


def _after_sibling(ctx: Ctx) -> tuple[Run, dict[str, Any], Run]:
    """The sibling's run, a copy of what it returned, and the case's run, through one engine object: made once per
    example for the checks that read it (INV-BATCH-003 the second run, INV-MUT-005 the first)."""
    return ctx.runs.sequence("after sibling", ctx.engine, ctx.case, ctx.device, lambda: _sibling_then_case(ctx))


def _sibling_then_case(ctx: Ctx) -> tuple[Run, dict[str, Any], Run]:
    engines: list[Any] = []
    first = execute(ctx.engine, sibling(ctx.case), ctx.device, reuse=engines)
    kept = {"outputs": held(first.outputs), "inputs": held(_view_fields(first))}
    second = execute(ctx.engine, ctx.case, ctx.device, reuse=engines)
    return first, kept, second


@invariant("INV-BATCH-003", "an engine object reused across micro-batches hands the model and returns exactly what "
           "a fresh one does", contract=8, facts=VALUE_FACTS,
           protects="a micro-batch's inputs and outputs do not depend on the micro-batches the engine saw before",
           adjust=_one_rank, repro=Plan(("reused",), sibling_first))
def reused_engine_is_fresh(ctx: Ctx) -> None:
    _, _, second = _after_sibling(ctx)
    checks.handoff_as_fresh(_view_fields(second), _view_fields(ctx.run), second.outputs, ctx.run.outputs)
    match_runs(ctx, second.outputs, ctx.run.outputs, "after another micro-batch through the same engine object "
               "vs a fresh engine")


@invariant("INV-MUT-005", "a later micro-batch through the same engine object leaves what an earlier call returned "
           "unchanged", contract=10,
           protects="outputs and model inputs the trainer holds stay valid after the engine's next call",
           adjust=_one_rank, repro=Plan(("earlier_kept",), sibling_first))
def earlier_results_kept(ctx: Ctx) -> None:
    first, kept, _ = _after_sibling(ctx)
    checks.earlier_kept(first.outputs, kept["outputs"], _view_fields(first), kept["inputs"])
