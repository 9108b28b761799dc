"""One training step end to end, as a trainer runs it: the mini-batch cut over data-parallel ranks and micro-batches by
the engine's step layer, each micro-batch through the engine's preparation and the stand-in model with a trainable
head, its loss backpropagated, the gradients accumulated per rank and averaged over the ranks (DDP/FSDP), the outputs
restored to the mini-batch's order.

Where the layer offers the framework's own step function (``forward_backward``: its cut and global facts need a process
group) and the case has DP > 1, every rank runs on a real rank process (:mod:`spec.execute.step_rank`, gloo): the cut,
the facts and their collectives are the framework's, and the suite reads what each micro-batch's loss was handed.
Otherwise the ranks run one after the other in this process (a framework without collectives in its step: TRL, SkyRL;
any DP = 1 step): the model's parameters are replicated (one head weight), each rank's gradient is accumulated from zero
over its micro-batches and kept, and the step's gradient is their mean, as DDP's all-reduce averages them. What the
step layer's functions and the engine object raise is the engine's (``spec.execute.attribution``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from ..cases.step import StepCase, materialize_step, select_rows
from ..protocol.engine import HeadInput
from ..protocol.step import StepLayer
from ..truth.step_model import StepModel
from . import probe, ranks
from .attribution import ENGINE, engine_side, tag
from .step_rank import STEP_TASK, step_processor

__all__ = ["StepRun", "cut_step", "run_step", "step_layer_of", "on_real_ranks"]


@dataclass
class StepRun:
    """What one step gave: per rank its micro-batches, the samples each holds (global indices), their losses; the
    outputs restored (per rank, then concatenated over the ranks in sample order); the ranks' gradients and their
    mean; the facts each rank was handed."""

    micro_batches: list[list[TensorDict]] = field(default_factory=list)
    indices: list[Any] = field(default_factory=list)
    rows: list[list[list[int]]] = field(default_factory=list)
    losses: list[list[float]] = field(default_factory=list)
    outputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    rank_grads: list[torch.Tensor] = field(default_factory=list)
    facts: list[dict[str, Any]] = field(default_factory=list)
    minis: list[TensorDict] = field(default_factory=list)
    #: on real ranks: each micro-batch's facts as its loss was handed them, per rank
    handed_facts: list[list[dict[str, Any]]] = field(default_factory=list)
    #: on real ranks, a step cut only: what the framework's step raised after the cut (re-raised by :meth:`finish`)
    error: tuple | None = None

    def finish(self) -> None:
        """Re-raise what the framework's step raised on a rank after its cut was read (the engine's)."""
        if self.error is not None:
            try:
                ranks.raise_rank_error(*self.error)
            except Exception as exc:  # noqa: BLE001 - raised by the framework's step on a rank
                raise tag(exc, ENGINE)

    @property
    def grad(self) -> torch.Tensor:
        """The step's gradient: the ranks' accumulated gradients averaged (DDP/FSDP)."""
        return torch.stack(self.rank_grads).mean(0)

    @property
    def loss(self) -> float:
        """The step's loss: each rank's micro-batch losses summed, averaged over the ranks (what the gradient is of)."""
        return sum(sum(rank) for rank in self.losses) / max(1, len(self.losses))


def step_layer_of(engine: Any) -> StepLayer | None:
    layer = getattr(engine, "step_layer", None)
    return layer() if layer is not None else None


def _rows(micro: list[TensorDict], indices, offset: int) -> list[list[int]]:
    if indices is not None:
        return [[offset + int(i) for i in part] for part in indices]
    rows, start = [], offset
    for mb in micro:
        size = int(mb.batch_size[0]) if mb.batch_size else 0
        rows.append(list(range(start, start + size)))
        start += size
    return rows


def on_real_ranks(layer: StepLayer, case: StepCase) -> bool:
    """Whether the step runs on real ranks: the framework's own step function, DP > 1."""
    return layer.collective and case.dp > 1


#: the latest real-rank steps of this process, by engine, case and measurement (INV-STEP-001/003/004 draw the same
#: pinned cases: each runs once); a step that raised is not kept
_RANK_RUNS: OrderedDict[tuple, StepRun] = OrderedDict()
_KEPT = 64


def _rank_step(engine: Any, case: StepCase, layer: StepLayer, measure: bool) -> StepRun:
    """The step of ``case`` on ``case.dp`` real ranks (the framework's ``forward_backward``; ``measure``: its losses
    and gradient too, else only what each micro-batch's loss was handed), made once per engine, case and mutant
    (:data:`_RANK_RUNS`). Each rank rebuilds the engine from its recipe and runs that engine's own step layer
    (``layer`` decides only where the step runs)."""
    key = (engine.name, case, measure, repr(probe.current()))
    if key in _RANK_RUNS:
        _RANK_RUNS.move_to_end(key)
        return _RANK_RUNS[key]
    run = _rank_step_made(engine, case, layer, measure)
    if run.error is None:
        _RANK_RUNS[key] = run
        while len(_RANK_RUNS) > _KEPT:
            _RANK_RUNS.popitem(last=False)
    return run


def _rank_step_made(engine: Any, case: StepCase, layer: StepLayer, measure: bool) -> StepRun:
    if not 2 <= case.dp <= ranks.MAX_WORLD:
        raise ValueError(f"real ranks run dp 2..{ranks.MAX_WORLD}, the case has dp={case.dp}")
    reason = ranks.unavailable("cpu", case.dp)
    if reason:
        raise ranks.RankFailure(f"real ranks cannot run here: {reason}")
    task = {"engine": engine.name, "recipe": engine.recipe(), "case": case, "device": "cpu", "kind": STEP_TASK,
            "world_is_dp": layer.world_is_dp, "measure": measure}
    replies = ranks.pool("cpu", case.dp if layer.world_is_dp else ranks.MAX_WORLD).submit(task, case.dp)
    errors = sorted((body["error"] for body in replies.values() if "error" in body), key=lambda e: e[0])
    if errors and (measure or any("handed" not in replies.get(r, {}) for r in range(case.dp))):
        run = StepRun(error=errors[0])
        run.finish()
    whole = materialize_step(case)
    run = StepRun(minis=[select_rows(whole, case.rank_rows(r)) for r in range(case.dp)],
                  error=errors[0] if errors else None)
    for rank in range(case.dp):
        body = replies[rank]
        handed = body["handed"]
        run.micro_batches.append([TensorDict(h["tensors"], batch_size=[h["size"]]) for h in handed])
        run.indices.append(None)
        run.rows.append([list(h["rows"]) for h in handed])
        run.handed_facts.append([dict(h["facts"]) for h in handed])
        run.facts.append(dict(handed[0]["facts"]) if handed else {})
        if measure:
            run.losses.append([float(h["loss"]) for h in handed])
            run.outputs.append(engine.view_outputs(body["outputs"]).per_sequence)
            run.rank_grads.append(body["grad"])
    return run


def cut_step(engine: Any, case: StepCase, layer: StepLayer | None = None) -> StepRun:
    """The step of ``case`` up to its cut: every rank's mini-batch, micro-batches and the samples each holds, and the
    facts each rank is handed (no engine run, no loss; on real ranks, the framework's step run with a zero loss, its
    error kept for :meth:`StepRun.finish`)."""
    layer = layer or step_layer_of(engine)
    if on_real_ranks(layer, case):
        return _rank_step(engine, case, layer, measure=False)
    fns = {name: engine_side(fn, f"step {name}") for name, fn in layer.functions.items()}
    whole = materialize_step(case)
    run = StepRun(minis=[select_rows(whole, case.rank_rows(r)) for r in range(case.dp)])
    cuts = fns["cut"](run.minis, case.plan)
    if len(cuts) != case.dp:
        raise AssertionError(f"the step's cut returned {len(cuts)} ranks' micro-batches for dp={case.dp}")
    for rank, (micro, indices) in enumerate(cuts):
        micro = list(micro)
        run.micro_batches.append(micro)
        run.indices.append(indices)
        run.rows.append(_rows(micro, indices, rank * case.per_rank))
    run.facts = list(fns["facts"](run.minis, case.plan))
    return run


def run_step(engine: Any, case: StepCase, layer: StepLayer | None = None) -> StepRun:
    """The step of ``case`` through ``engine``'s step layer (default: the engine's own)."""
    layer = layer or step_layer_of(engine)
    if on_real_ranks(layer, case):
        return _rank_step(engine, case, layer, measure=True)
    fns = {name: engine_side(fn, f"step {name}") for name, fn in layer.functions.items()}
    head = layer.loss(case.loss).head
    run = cut_step(engine, case, layer)
    model = StepModel(case.vocab, seed=case.seed, out_dim=1 if head == "value" else None,
                      hidden=getattr(engine, "head_input", HeadInput.LOGITS) == HeadInput.HIDDEN)
    processor = step_processor(engine, case)
    for rank, (micro, indices) in enumerate(zip(run.micro_batches, run.indices)):
        model.zero_grad()
        obj = engine.make(head)  # one engine object per rank, kept across its micro-batches as a trainer keeps it
        output_lst, losses = [], []
        for mb in micro:
            inputs, output_args = engine_side(obj.prepare_model_inputs, "prepare_model_inputs")(mb)
            raw = engine_side(obj.prepare_model_outputs, "prepare_model_outputs")(model(**inputs), output_args, mb,
                                                                                processor)
            outputs = engine.view_outputs(raw).per_sequence
            loss = fns["loss"](outputs, mb, run.facts[rank], case.setting)
            loss.backward()
            losses.append(float(loss.detach()))
            output_lst.append({"model_output": {k: v.detach() for k, v in raw.items()}, "loss": losses[-1]})
        run.losses.append(losses)
        restored = fns["restore"](output_lst, indices, run.minis[rank])
        run.outputs.append(engine.view_outputs(restored).per_sequence)
        grad = model.weight.grad
        run.rank_grads.append(torch.zeros_like(model.weight) if grad is None else grad.detach().clone())
    return run
