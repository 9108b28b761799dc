"""A standalone, vectorised implementation of an RL engine's model input/output preparation.

See ``docs/contract.md`` for the contract; ``LMHeadEngine`` and ``ValueHeadEngine`` are
drop-ins for verl's FSDP engines' ``prepare_model_inputs``/``prepare_model_outputs``.
"""

from .engines import LMHeadEngine, ValueHeadEngine
from .errors import (BatchMismatchError, FlagTypeError, LayoutWarning, NestedLayoutError, PrepError, ShapeError,
                     TemperatureError, UnsupportedConfigError)
from .flags import BatchFlags
from .inputs import prepare_model_inputs
from .multimodal import extract_multi_modal_inputs
from .logits import entropy_from_logits, logprobs_from_logits, sum_pi_squared_from_logits
from .microbatch import (calculate_workload, ceildiv, chunk_tensordict, concat_nested_tensors, concat_tensordict,
                         get_reverse_idx, get_seqlen_balanced_partitions, index_select_tensor_dict,
                         list_of_dict_to_tensordict, maybe_fix_3d_position_ids, nested_tensor_from_tensor_list,
                         postprocess_batch_func, prepare_micro_batches, rearrange_micro_batches,
                         restore_dynamic_batch, roundup_divisible)
from .outputs import prepare_model_outputs, prepare_value_outputs
from .padding import (build_attention_mask_from_nested, left_right_2_no_padding, no_padding_2_padding,
                      response_from_nested, response_to_nested)
from .settings import EngineSettings

__all__ = [
    "LMHeadEngine", "ValueHeadEngine", "EngineSettings", "BatchFlags",
    "prepare_model_inputs", "prepare_model_outputs", "prepare_value_outputs",
    "build_attention_mask_from_nested", "no_padding_2_padding", "left_right_2_no_padding",
    "response_from_nested", "response_to_nested",
    "logprobs_from_logits", "entropy_from_logits", "sum_pi_squared_from_logits", "extract_multi_modal_inputs",
    "PrepError", "NestedLayoutError", "BatchMismatchError", "ShapeError", "TemperatureError",
    "UnsupportedConfigError", "FlagTypeError", "LayoutWarning",
    # the micro-batch layer (impl.microbatch)
    "prepare_micro_batches", "postprocess_batch_func", "rearrange_micro_batches", "restore_dynamic_batch",
    "get_seqlen_balanced_partitions", "get_reverse_idx", "calculate_workload", "ceildiv", "roundup_divisible",
    "chunk_tensordict", "concat_tensordict", "index_select_tensor_dict", "concat_nested_tensors",
    "nested_tensor_from_tensor_list", "list_of_dict_to_tensordict", "maybe_fix_3d_position_ids",
]
