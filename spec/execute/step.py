"""One training step end to end, as a trainer runs it: the mini-batch cut over data-parallel ranks and micro-batches by
the engine's step layer, each micro-batch through the engine's preparation and the stand-in model with a trainable
head, its loss backpropagated, the gradients accumulated per rank and averaged over the ranks (DDP/FSDP), the outputs
restored to the mini-batch's order.

The ranks run one after the other in this process: the model's parameters are replicated (one head weight), each
rank's gradient is accumulated from zero over its micro-batches and kept, and the step's gradient is their mean, as
DDP's all-reduce averages them. What the step layer's functions and the engine object raise is the engine's
(``spec.execute.attribution``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from ..cases.step import StepCase, materialize_step, select_rows
from ..protocol.step import StepLayer
from ..truth.oracle import TopKProcessor
from ..truth.step_model import StepModel
from .attribution import engine_side

__all__ = ["StepRun", "cut_step", "run_step", "step_layer_of"]


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


def _processor(engine: Any, case: StepCase):
    """A distillation step's top-K processor: the engine's own (its companion), else the suite's stand-in."""
    if not case.topk:
        return None
    whole = case.engine_case()
    own = engine.logits_processor(whole) if hasattr(engine, "logits_processor") else None
    return own if own is not None else TopKProcessor(whole.distillation_keys)


def cut_step(engine: Any, case: StepCase, layer: StepLayer | None = None) -> StepRun:
    """The step of ``case`` up to its cut: every rank's mini-batch, micro-batches and the samples each holds, and the
    facts each rank is handed (no engine run, no loss)."""
    layer = layer or step_layer_of(engine)
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
    fns = {name: engine_side(fn, f"step {name}") for name, fn in layer.functions.items()}
    head = layer.loss(case.loss).head
    run = cut_step(engine, case, layer)
    model = StepModel(case.vocab, seed=case.seed, out_dim=1 if head == "value" else None)
    processor = _processor(engine, case)
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
