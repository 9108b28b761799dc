"""Packed-row tail padding (static bucket, sequence-parallel) and the gather seam.

The packed row is padded at its tail once, by the sum of the bucket pad and the
sequence-parallel pad, and then each rank keeps its contiguous ``1/sp`` slice.
Every per-token tensor of the row goes through the same :class:`RowPlan`, so ids,
positions, rolled labels and temperature cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from .errors import ShapeError, UnsupportedConfigError

__all__ = ["RowPlan", "AllGather", "TorchDistributedAllGather"]


class AllGather(Protocol):
    """Concatenate every rank's local tensor along dim 0, in rank order."""

    def __call__(self, local: torch.Tensor) -> torch.Tensor: ...


class TorchDistributedAllGather:
    """An :class:`AllGather` over a ``torch.distributed`` process group."""

    def __init__(self, group: object = None) -> None:
        self.group = group

    def __call__(self, local: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        # the buffers the collective writes are normal tensors even under torch.inference_mode(): gloo writes them
        # on its own thread, where torch 2.4 refuses an in-place update of an inference tensor (the concatenation
        # below is one again)
        with torch.inference_mode(False):
            parts = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=0)


def _ceil_to(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class RowPlan:
    """How a packed row of ``total_nnz`` tokens is padded and sharded."""

    total_nnz: int
    bucket_pad: int
    sp_pad: int
    sp_size: int
    sp_rank: int

    @classmethod
    def make(cls, total_nnz: int, *, bucket: int | None, sp_size: int, sp_rank: int) -> "RowPlan":
        if sp_size < 1 or not 0 <= sp_rank < sp_size:
            raise UnsupportedConfigError(f"sequence-parallel rank {sp_rank} is not in [0, {sp_size})")
        if bucket is not None and bucket < 1:
            raise UnsupportedConfigError(f"static bucket pad_to_length must be >= 1, got {bucket}")
        bucketed = total_nnz if bucket is None else _ceil_to(total_nnz, bucket)
        sharded = _ceil_to(bucketed, sp_size)
        return cls(total_nnz, bucketed - total_nnz, sharded - bucketed, sp_size, sp_rank)

    @property
    def pad_size(self) -> int:
        return self.bucket_pad + self.sp_pad

    @property
    def padded_len(self) -> int:
        return self.total_nnz + self.pad_size

    @property
    def local_len(self) -> int:
        return self.padded_len // self.sp_size

    def shard(self, row: torch.Tensor, fill: float | int | str, *, dim: int = -1) -> torch.Tensor:
        """Pad ``row`` (token axis ``dim``) at its tail, then keep this rank's slice.

        ``fill`` is a value, or ``"arange"`` for positions restarting at 0.
        """
        dim = dim % row.dim()
        if self.pad_size:
            shape = list(row.shape)
            shape[dim] = self.pad_size
            if fill == "arange":
                steps = torch.arange(self.pad_size, device=row.device, dtype=row.dtype)
                view = [1] * row.dim()
                view[dim] = self.pad_size
                tail = steps.view(view).expand(shape)
            else:
                tail = row.new_full(shape, fill)
            row = torch.cat([row, tail], dim=dim)
        return row.narrow(dim, self.sp_rank * self.local_len, self.local_len)

    def unshard(self, local: torch.Tensor, all_gather: Callable[[torch.Tensor], torch.Tensor] | None,
                key: str) -> torch.Tensor:
        """Gather ranks' ``(local_len, *)`` tensors and drop the tail pad: ``(total_nnz, *)``."""
        if local.shape[0] != self.local_len:
            raise ShapeError(
                f"{key!r} has {local.shape[0]} tokens on this rank (shape {tuple(local.shape)}), "
                f"expected {self.local_len}")
        full = local
        if self.sp_size > 1:
            if all_gather is None:
                raise UnsupportedConfigError("sp_size > 1 needs an all_gather (see TorchDistributedAllGather)")
            full = all_gather(local)
            if full.shape[0] != self.padded_len:
                raise ShapeError(
                    f"all_gather of {key!r} returned {full.shape[0]} tokens, expected {self.padded_len}")
        return full[: self.total_nnz]
