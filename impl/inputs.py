"""``prepare_model_inputs``: a jagged micro-batch to the model's packed or padded inputs."""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDictBase

from .batch import MicroBatchView
from .errors import TemperatureError, UnsupportedConfigError
from .layout import dense_from_jagged
from .multimodal import multi_modal_model_inputs
from .sequence_parallel import RowPlan
from .settings import EngineSettings

__all__ = ["prepare_model_inputs", "rolled_labels"]


def rolled_labels(ids: torch.Tensor) -> torch.Tensor:
    """The packed ids ``(total_nnz,)`` rolled left by one over the whole row: position k holds token k+1."""
    return torch.roll(ids, shifts=-1, dims=0)


def _check_config(view: MicroBatchView, settings: EngineSettings) -> None:
    if view.flags.use_fused_kernels and view.scalar_temperature is None:
        raise TemperatureError(
            "use_fused_kernels needs one float 'temperature'; got a per-sample tensor of shape "
            f"{tuple(view.temperature.shape)}")
    if settings.pad_to_length is not None and view.flags.distillation_use_topk:
        raise UnsupportedConfigError(
            f"static bucket pad_to_length={settings.pad_to_length} cannot be combined with "
            "distillation_use_topk (the teacher top-K tensors would misalign)")


def prepare_model_inputs(micro_batch: TensorDictBase,
                         settings: EngineSettings = EngineSettings()) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(model_inputs, output_args)`` for one micro-batch, following the engine contract."""
    view = MicroBatchView.of(micro_batch)
    _check_config(view, settings)
    positions = view.position_values(micro_batch)  # (total,) or (C, total)
    layout = view.layout
    rolled = rolled_labels(layout.values)
    output_args: dict[str, Any] = {}

    if view.flags.use_remove_padding:
        plan = RowPlan.make(layout.total_nnz, bucket=settings.pad_to_length,
                            sp_size=settings.sp_size, sp_rank=settings.sp_rank)
        ids = plan.shard(layout.values, 0).unsqueeze(0)
        pos = plan.shard(positions, "arange").unsqueeze(-2)  # (1, n) or (C, 1, n)
        local_rolled = plan.shard(rolled, 0)
        token_temperature = (
            torch.full((layout.total_nnz,), view.scalar_temperature, dtype=torch.float32, device=rolled.device)
            if view.scalar_temperature is not None
            else layout.per_token(view.temperature))
        model_inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": None, "position_ids": pos}
        if settings.pass_cu_seqlens:
            cu = layout.offsets
            if plan.pad_size:
                cu = torch.cat([cu, cu.new_tensor([plan.padded_len])])
            model_inputs["cu_seqlens"] = cu.to(torch.int32)
            model_inputs["cu_seqlens_cpu"] = model_inputs["cu_seqlens"].cpu()
        output_args["input_ids_rmpad_rolled"] = local_rolled
        output_args["temperature_rmpad"] = plan.shard(token_temperature, 1.0)
        output_args["pad_size"] = plan.pad_size
        if view.flags.use_fused_kernels:
            model_inputs["shift_labels"] = local_rolled.unsqueeze(0)
    else:
        model_inputs = {
            "input_ids": dense_from_jagged(layout.values, layout, view.flags.pad_token_id),
            "attention_mask": layout.mask(),
            "position_ids": dense_from_jagged(positions, layout, 0, token_dim=positions.dim() - 1),
        }
        output_args["input_ids_rmpad_rolled"] = rolled
        output_args["temperature"] = view.temperature

    # images and videos: the whole micro-batch's, on every rank (the model embeds them before any slicing)
    model_inputs.update(multi_modal_model_inputs(micro_batch, layout.batch_size, layout.values.device))
    if view.flags.use_fused_kernels:
        model_inputs["temperature"] = view.scalar_temperature
        model_inputs["return_dict"] = True
    return model_inputs, output_args
