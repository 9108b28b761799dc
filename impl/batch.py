"""Reading and checking the tensors of a micro-batch, once, for both directions."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDictBase

from .errors import BatchMismatchError, NestedLayoutError, ShapeError
from .flags import BatchFlags, read_flag
from .layout import SequenceLayout, is_nested
from .logits import sample_temperature, scalar_temperature

__all__ = ["MicroBatchView", "get_key"]


def get_key(micro_batch: TensorDictBase, key: str) -> torch.Tensor:
    if not isinstance(micro_batch, TensorDictBase):
        raise NestedLayoutError(f"micro_batch must be a TensorDict, got {type(micro_batch).__name__}")
    if key not in micro_batch.keys():
        raise KeyError(f"micro-batch has no {key!r}; keys: {sorted(micro_batch.keys())}")
    return micro_batch.get(key)


@dataclass(frozen=True)
class MicroBatchView:
    """The checked geometry, flags and temperature of one micro-batch."""

    flags: BatchFlags
    layout: SequenceLayout
    input_ids: torch.Tensor  # jagged (B, j)
    temperature: torch.Tensor  # (B,) float32 on the ids' device
    scalar_temperature: float | None

    @classmethod
    def of(cls, micro_batch: TensorDictBase) -> "MicroBatchView":
        input_ids = get_key(micro_batch, "input_ids")
        layout = SequenceLayout.of(input_ids, "input_ids")
        if input_ids.dim() != 2:
            raise NestedLayoutError(f"'input_ids' must be (B, j), got shape {tuple(input_ids.shape)}")
        if layout.values.is_floating_point() or layout.values.is_complex():
            raise NestedLayoutError(f"'input_ids' must hold integer ids, got {input_ids.dtype}")
        declared = tuple(micro_batch.batch_size)
        if declared and declared[0] != layout.batch_size:
            raise BatchMismatchError(
                f"micro-batch batch_size {list(declared)} but 'input_ids' holds {layout.batch_size} sequences")
        if layout.min_seq_len < 1:
            raise ShapeError(f"'input_ids' has an empty sequence (lengths {layout.lengths.tolist()})")
        raw_temperature = read_flag(micro_batch, "temperature", None)
        device = layout.values.device
        temperature = sample_temperature(raw_temperature, layout.batch_size, device)
        return cls(BatchFlags.from_batch(micro_batch), layout, input_ids, temperature,
                   scalar_temperature(raw_temperature))

    def position_values(self, micro_batch: TensorDictBase) -> torch.Tensor:
        """Packed positions: ``(total_nnz,)``, or ``(C, total_nnz)`` for mRoPE ``(B, C, j)``."""
        positions = get_key(micro_batch, "position_ids")
        if is_nested(positions) and positions.dim() == 3:
            layout = SequenceLayout.of(positions, "position_ids", ragged_dim=2, like=self.layout)
        else:
            layout = SequenceLayout.of(positions, "position_ids", like=self.layout)
            if positions.dim() != 2:
                raise NestedLayoutError(
                    f"'position_ids' must be (B, j) or (B, C, j), got shape {tuple(positions.shape)}")
        self.layout.expect_same_lengths(layout, "position_ids")
        return layout.values
