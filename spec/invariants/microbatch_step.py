"""The micro-batch checks through a framework's own step layer, where the framework has no verl-named micro-batch layer.

A framework that declares its training step (:class:`~spec.protocol.step.StepLayer`) with its own ``cut`` and
``restore`` cuts and restores its micro-batches in functions of its own, under other names than verl's. The checks of
the micro-batch layer that read only a cut and a restore apply to them as they are (:data:`BRIDGED`): every sample in
exactly one micro-batch (INV-MB-001, a token budget), consecutive chunks in order (INV-MB-006, a sample count), the
outputs restored to mini-batch order (INV-MB-007), each micro-batch keeping every key for its samples (INV-MB-008).
They run through :func:`step_microbatch_layer`: ``prepare_micro_batches`` is the step's ``cut`` of one rank's
mini-batch (the plan read off the mini-batch's flags, as verl's reads them), ``restore_dynamic_batch`` its ``restore``
of the per-micro-batch results. Each case is first fitted to what the step allows (:func:`fit`: its cuts, one rank,
no count rules or groups, equal micro-batches where it asks them), so no example asks the framework a cut it never
makes. A function the layer only restates in the suite's code (``StepLayer.restated``: the library's own is not
callable on the suite's batches) is not the library's: the checks that would read it are skipped with that reason.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from ..cases.microbatch import MiniBatchCase
from ..protocol.microbatch import MicroBatchLayer
from ..protocol.step import Cut, CutPlan, StepLayer

__all__ = ["BRIDGED", "step_microbatch_layer", "bridge_skip_reason", "fit"]

#: the micro-batch invariants a step layer's own cut and restore answer, and which of its functions each reads
BRIDGED = {"INV-MB-001": ("cut",), "INV-MB-006": ("cut",), "INV-MB-007": ("cut", "restore"),
           "INV-MB-008": ("cut",)}
#: the path each bridged invariant draws (None: either)
_PATH = {"INV-MB-001": Cut.TOKENS, "INV-MB-006": Cut.COUNT, "INV-MB-007": Cut.TOKENS, "INV-MB-008": None}


def bridge_skip_reason(invariant: str, step: StepLayer) -> str | None:
    """Why ``invariant`` cannot run through ``step`` (None when it can)."""
    if invariant not in BRIDGED:
        return "not a check of a cut and a restore alone"
    restated = [f"{name} ({step.restated[name]})" for name in BRIDGED[invariant] if name in step.restated]
    if restated:
        return f"{step.name}'s step layer restates its " + "; ".join(restated) + " in the suite's code"
    path = _PATH[invariant]
    if path is not None and path not in step.cuts:
        return f"{step.name}'s step cuts by {', '.join(c.value for c in step.cuts)} only, never by {path.value}"
    return None


def fit(case: MiniBatchCase, step: StepLayer) -> MiniBatchCase:
    """``case`` as ``step`` may cut it: one rank, no groups, no count rules, no sequence parallelism, a path the step
    has, and (equal micro-batches) a sample count that divides the mini-batch."""
    case = case.with_(force_group_size=1, sp_size=1, num_batches_divided_by=None, min_num_micro_batch=None,
                      other_ranks=())
    if case.use_dynamic_bsz and Cut.TOKENS not in step.cuts:
        case = case.with_(use_dynamic_bsz=False)
    elif not case.use_dynamic_bsz and Cut.COUNT not in step.cuts:
        case = case.with_(use_dynamic_bsz=True)
    if not case.use_dynamic_bsz and step.equal_micro_batches and case.batch_size % case.micro_batch_size:
        divisors = [m for m in range(1, case.batch_size + 1) if case.batch_size % m == 0]
        case = case.with_(micro_batch_size=max(m for m in divisors if m <= case.micro_batch_size))
    return case


def _flag(data: TensorDict, key: str, default: Any) -> Any:
    if key not in data.keys():
        return default
    value = data.get(key)
    return getattr(value, "data", value)


def _plan(data: TensorDict) -> CutPlan:
    """The cut a mini-batch's flags ask (verl's names: ``use_dynamic_bsz``, ``max_token_len_per_gpu`` x ``sp_size``,
    ``micro_batch_size_per_gpu``)."""
    if _flag(data, "use_dynamic_bsz", True):
        return CutPlan(1, Cut.TOKENS, max_token_len=int(_flag(data, "max_token_len_per_gpu", 0)) *
                       int(_flag(data, "sp_size", 1)), global_batch_size=int(data.batch_size[0]))
    return CutPlan(1, Cut.COUNT, micro_batch_size=int(_flag(data, "micro_batch_size_per_gpu", 1)),
                   global_batch_size=int(data.batch_size[0]))


def _parts(data: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Per-micro-batch results ``data`` (concatenated in micro-batch order) split back into micro-batches."""
    if not data.is_nested:
        return list(torch.split(data, sizes))
    offsets, values, out, start = data.offsets(), data.values(), [], 0
    for size in sizes:
        local = offsets[start:start + size + 1]
        out.append(torch.nested.nested_tensor_from_jagged(values[int(local[0]):int(local[-1])], local - local[0]))
        start += size
    return out


def step_microbatch_layer(step: StepLayer) -> MicroBatchLayer:
    """A micro-batch layer whose ``prepare_micro_batches`` is ``step``'s cut of one rank and whose
    ``restore_dynamic_batch`` is its restore (see the module docstring)."""
    cut, restore = step.get("cut"), step.get("restore")

    def prepare_micro_batches(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                              min_num_micro_batch=None, use_dynamic_bsz_balance=True):  # noqa: ARG001 - fitted away
        ((micro, indices),) = cut([data], _plan(data))
        return list(micro), indices

    def restore_dynamic_batch(data, batch_idx_list):
        sizes = [len(part) for part in batch_idx_list]
        mini = TensorDict({}, batch_size=[sum(sizes)])
        output_lst = [{"model_output": {"out": part}, "loss": 0.0} for part in _parts(data, sizes)]
        return restore(output_lst, batch_idx_list, mini)["out"]

    return MicroBatchLayer(f"{step.name} (its step layer's cut and restore)",
                           {"prepare_micro_batches": prepare_micro_batches,
                            "restore_dynamic_batch": restore_dynamic_batch})
