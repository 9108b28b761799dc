"""The micro-batch layer: verl 0.9.1's functions that cut a mini-batch into micro-batches and put the
per-micro-batch outputs back in order, as drop-ins with verl's names, signatures and return values.

=================================  =========================================================
verl                               here
=================================  =========================================================
``verl.workers.engine.utils``      :func:`prepare_micro_batches`, :func:`postprocess_batch_func`
``verl.utils.seqlen_balancing``    :func:`rearrange_micro_batches`, :func:`restore_dynamic_batch`,
                                   :func:`get_seqlen_balanced_partitions`, :func:`get_reverse_idx`,
                                   :func:`calculate_workload`, :func:`ceildiv`,
                                   :func:`roundup_divisible`
``verl.utils.tensordict_utils``    :func:`chunk_tensordict`, :func:`concat_tensordict`,
                                   :func:`index_select_tensor_dict`, :func:`concat_nested_tensors`,
                                   :func:`nested_tensor_from_tensor_list`,
                                   :func:`list_of_dict_to_tensordict`, :func:`maybe_fix_3d_position_ids`
=================================  =========================================================

Where verl is wrong (docs/verl-differences.md, "The micro-batch layer") these are not.
"""

from .batches import (get_reverse_idx, postprocess_batch_func, prepare_micro_batches, rearrange_micro_batches,
                      restore_dynamic_batch)
from .nested import concat_nested_tensors, nested_tensor_from_tensor_list
from .partition import (balanced_bins, calculate_workload, ceildiv, get_seqlen_balanced_partitions,
                        roundup_divisible)
from .tensordicts import (chunk_tensordict, concat_tensordict, index_select_tensor_dict, list_of_dict_to_tensordict,
                          maybe_fix_3d_position_ids)

__all__ = [
    "prepare_micro_batches", "postprocess_batch_func", "rearrange_micro_batches", "restore_dynamic_batch",
    "get_seqlen_balanced_partitions", "get_reverse_idx", "calculate_workload", "ceildiv", "roundup_divisible",
    "balanced_bins", "chunk_tensordict", "concat_tensordict", "index_select_tensor_dict", "concat_nested_tensors",
    "nested_tensor_from_tensor_list", "list_of_dict_to_tensordict", "maybe_fix_3d_position_ids",
]
