"""The micro-batch layer protocol: what an engine's layer between the trainer's mini-batch and
``prepare_model_inputs`` provides, by verl 0.9.1's names and signatures.

Every verl engine (FSDP, VeOmni, TorchTitan, Automodel, Megatron) cuts its mini-batch with
``verl.workers.engine.utils.prepare_micro_batches`` and puts the per-micro-batch outputs back with
``postprocess_batch_func``; underneath sit ``verl.utils.seqlen_balancing`` and
``verl.utils.tensordict_utils``. A :class:`MicroBatchLayer` holds the functions one engine offers,
looked up on its adapter's sources (modules or namespaces), each by exactly this name:

=================================== ==========================================================================
``prepare_micro_batches``           ``(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                                    min_num_micro_batch=None, use_dynamic_bsz_balance=True) -> (micro_batches,
                                    batch_idx_list | None)``; reads ``use_dynamic_bsz``, ``sp_size``,
                                    ``force_group_size``, ``max_token_len_per_gpu``, ``micro_batch_size_per_gpu``
                                    off ``data``
``rearrange_micro_batches``         ``(batch, max_token_len, dp_group=None, num_batches_divided_by=None,
                                    same_micro_num_in_dp=True, min_num_micro_batch=None,
                                    use_dynamic_bsz_balance=True, force_group_size=1)``
``restore_dynamic_batch``           ``(data, batch_idx_list) -> data`` in the original sample order
``get_seqlen_balanced_partitions``  ``(seqlen_list, k_partitions, equal_size) -> list[list[int]]``
``postprocess_batch_func``          ``(output_lst, indices, data) -> {"model_output", "loss", "metrics"}``
``chunk_tensordict``                ``(td, chunks) -> list[TensorDict]``
``concat_tensordict``               ``(data: list[TensorDict]) -> TensorDict``
``index_select_tensor_dict``        ``(batch, indices) -> TensorDict``
``concat_nested_tensors``           ``(tensors: list[Tensor]) -> Tensor``
``nested_tensor_from_tensor_list``  ``(tensors, ragged_idx=None) -> Tensor``
``list_of_dict_to_tensordict``      ``(list_of_dicts) -> TensorDict``
``maybe_fix_3d_position_ids``       ``(data) -> None`` (in place)
=================================== ==========================================================================

This module imports nothing from ``spec`` (it is part of the protocol layer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

__all__ = ["MICROBATCH_FUNCTIONS", "MicroBatchLayer", "layer_from"]

#: every function a micro-batch layer may offer (verl 0.9.1's names)
MICROBATCH_FUNCTIONS = (
    "prepare_micro_batches", "rearrange_micro_batches", "restore_dynamic_batch", "get_seqlen_balanced_partitions",
    "postprocess_batch_func", "chunk_tensordict", "concat_tensordict", "index_select_tensor_dict",
    "concat_nested_tensors", "nested_tensor_from_tensor_list", "list_of_dict_to_tensordict",
    "maybe_fix_3d_position_ids",
)


@dataclass(frozen=True)
class MicroBatchLayer:
    """One engine's micro-batch layer: ``functions`` maps each offered name to its callable; ``missing``
    maps each name it lacks to why."""

    name: str
    functions: Mapping[str, Callable[..., Any]]
    missing: Mapping[str, str] = field(default_factory=dict)

    def get(self, name: str) -> Callable[..., Any] | None:
        if name not in MICROBATCH_FUNCTIONS:
            raise ValueError(f"unknown micro-batch function {name!r}; known: {MICROBATCH_FUNCTIONS}")
        return self.functions.get(name)

    def lacks(self, names: Iterable[str]) -> str | None:
        """Why the layer cannot run something that calls ``names`` (None when it has them all)."""
        absent = [n for n in names if self.get(n) is None]
        if not absent:
            return None
        return f"{self.name}'s micro-batch layer has no " + ", ".join(
            f"{n} ({self.missing.get(n, 'not found')})" for n in absent)

    def with_functions(self, name: str, **replaced: Callable[..., Any]) -> "MicroBatchLayer":
        """The same layer with some functions replaced (planted bugs, wrappers)."""
        for key in replaced:
            self.get(key)
        return MicroBatchLayer(name, {**self.functions, **replaced}, dict(self.missing))


def layer_from(name: str, sources: Iterable[Any]) -> MicroBatchLayer:
    """A layer whose every function is looked up, by its exact name, on the first of ``sources`` (modules,
    namespaces or objects) that has it callable."""
    sources = list(sources)
    functions, missing = {}, {}
    for fn in MICROBATCH_FUNCTIONS:
        found = next((getattr(src, fn) for src in sources if callable(getattr(src, fn, None))), None)
        if found is None:
            where = ", ".join(getattr(src, "__name__", type(src).__name__) for src in sources) or "no source"
            missing[fn] = f"not in {where}"
        else:
            functions[fn] = found
    return MicroBatchLayer(name, functions, missing)
