"""One data-parallel rank of a collective training step: the framework's own step function on a real rank.

A step layer that offers ``forward_backward`` (spec/protocol/step.py: verl's ``FSDPEngine.forward_backward_batch``,
``impl.step.forward_backward_batch``) runs its DP > 1 steps on real ranks joined by ``torch.distributed`` (gloo, the
pools of :mod:`spec.execute.ranks`): the suite computes no fact and simulates no collective there. Rank ``r``
materialises the whole mini-batch from the case's seed, keeps its own share (``StepCase.rank_rows(r)``) tagged with each
sample's global index (:data:`SAMPLE_INDEX`, a key the framework carries through its cut like any other), builds its
engine object, the stand-in model with a trainable head and (distillation) the top-K processor, and calls the
framework's ``forward_backward`` with the DP group and a loss function of the suite's, :class:`LossWatch`: it keeps what
each micro-batch's loss was handed (the samples, by the index key; the tensors; the global facts, the micro-batch's
non-tensor entries of the layer's :class:`~spec.protocol.step.Fact` names) and computes the layer's ``loss`` with those
facts (``measure``), or a zero loss when only the cut is checked (INV-STEP-002: a micro-batch that lacks a key the
loss would read is seen before any loss reads it). The rank replies with the records, its restored outputs and its
head's gradient (what :func:`spec.execute.step.run_step` averages as DDP does).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from tensordict import TensorDict

from ..cases.step import StepCase, materialize_step, select_rows
from ..protocol.step import StepLayer
from ..truth.oracle import TopKProcessor
from ..truth.step_model import StepModel

__all__ = ["SAMPLE_INDEX", "STEP_TASK", "LossWatch", "RankStep", "step_processor", "tagged_mini"]

#: the suite's tag of each sample's global index in a rank's mini-batch (int64, one per sample)
SAMPLE_INDEX = "sample_index"
#: the task kind a rank dispatches to :class:`RankStep` (spec.execute.rank_worker)
STEP_TASK = "step"


def step_processor(engine: Any, case: StepCase) -> Callable | None:
    """A distillation step's top-K processor: the engine's own (its companion), else the suite's stand-in."""
    if not case.topk:
        return None
    whole = case.engine_case()
    own = engine.logits_processor(whole) if hasattr(engine, "logits_processor") else None
    return own if own is not None else TopKProcessor(whole.distillation_keys)


def tagged_mini(case: StepCase, rank: int) -> TensorDict:
    """Rank ``rank``'s share of the case's mini-batch, each sample tagged with its global index."""
    rows = case.rank_rows(rank)
    mini = select_rows(materialize_step(case), rows)
    mini.set(SAMPLE_INDEX, torch.tensor(rows, dtype=torch.int64))
    return mini


def _plain(value: Any) -> Any:
    value = getattr(value, "data", value)  # a TensorDict's non-tensor entry
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


class LossWatch:
    """The loss function the suite hands a framework's step: records what each micro-batch's loss was handed, then
    (``measure``) returns the layer's loss of it, else a zero leaf (the cut alone)."""

    def __init__(self, layer: StepLayer, engine: Any, case: StepCase, measure: bool):
        self.layer, self.engine, self.case, self.measure = layer, engine, case, measure
        self.handed: list[dict[str, Any]] = []

    def __call__(self, model_output: dict, micro_batch: TensorDict) -> torch.Tensor:
        keys = set(micro_batch.keys())
        facts = {f.value: _plain(micro_batch.get(f.value)) for f in self.layer.facts if f.value in keys}
        tensors = {k: micro_batch.get(k).detach() for k in keys
                   if k != SAMPLE_INDEX and isinstance(micro_batch.get(k), torch.Tensor)}
        rows = [int(i) for i in micro_batch.get(SAMPLE_INDEX).tolist()] if SAMPLE_INDEX in keys else []
        record: dict[str, Any] = {"rows": rows, "tensors": tensors, "facts": facts,
                                  "size": int(micro_batch.batch_size[0]) if micro_batch.batch_size else 0}
        self.handed.append(record)
        if not self.measure:
            return torch.zeros((), requires_grad=True)
        outputs = self.engine.view_outputs(model_output).per_sequence
        loss = self.layer.get("loss")(outputs, micro_batch, facts, self.case.setting)
        record["loss"] = float(loss.detach())
        return loss


class RankStep:
    """Rank ``rank``'s step of ``case`` through ``engine``'s own ``forward_backward`` (see the module docstring)."""

    def __init__(self, engine: Any, case: StepCase, rank: int, measure: bool):
        self.engine, self.case, self.rank = engine, case, rank
        self.layer: StepLayer = engine.step_layer()
        self.watch = LossWatch(self.layer, engine, case, measure)

    @property
    def handed(self) -> list[dict[str, Any]]:
        return self.watch.handed

    def run(self, group: Any) -> dict[str, Any]:
        """The rank's restored outputs and its head's accumulated gradient (``group``: the DP group)."""
        case = self.case
        head = self.layer.loss(case.loss).head
        model = StepModel(case.vocab, seed=case.seed, out_dim=1 if head == "value" else None)
        mini = tagged_mini(case, self.rank)
        restored = self.layer.get("forward_backward")(self.engine.make(head), model, mini, case.plan, case.setting,
                                                      group, self.watch, step_processor(self.engine, case))
        grad = model.weight.grad
        return {"outputs": {k: v.detach() for k, v in dict(restored).items()},
                "grad": torch.zeros_like(model.weight.detach()) if grad is None else grad.detach().clone()}
