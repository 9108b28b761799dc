"""Engine classes with verl's two-method interface, settings in the constructor."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
from tensordict import TensorDictBase

from .inputs import prepare_model_inputs
from .outputs import LogitsProcessor, prepare_model_outputs, prepare_value_outputs
from .settings import EngineSettings

__all__ = ["LMHeadEngine", "ValueHeadEngine"]


class LMHeadEngine:
    """Prepares micro-batches for a causal LM and turns its logits into per-token outputs.

    Drop-in for verl's ``FSDPEngineWithLMHead`` input/output preparation.
    """

    def __init__(self, *, sp_size: int = 1, sp_rank: int = 0, pad_to_length: int | None = None,
                 pass_cu_seqlens: bool = False, entropy_chunk_size: int | None = None,
                 all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        self.settings = EngineSettings(sp_size=sp_size, sp_rank=sp_rank, pad_to_length=pad_to_length,
                                       pass_cu_seqlens=pass_cu_seqlens, entropy_chunk_size=entropy_chunk_size,
                                       all_gather=all_gather)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.settings})"

    def prepare_model_inputs(self, micro_batch: TensorDictBase) -> tuple[dict[str, Any], dict[str, Any]]:
        return prepare_model_inputs(micro_batch, self.settings)

    def prepare_model_outputs(self, output: Any, output_args: Mapping[str, Any], micro_batch: TensorDictBase,
                              logits_processor_func: LogitsProcessor | None = None,
                              **verl_only: Any) -> dict[str, torch.Tensor]:
        """``verl_only`` takes verl's extra keywords (``logits_processor_func_requires_grad``,
        ``loss_function``) so call sites written for verl work unchanged; they do not affect
        the outputs."""
        return prepare_model_outputs(output, output_args, micro_batch, logits_processor_func, self.settings)


class ValueHeadEngine(LMHeadEngine):
    """Same inputs as :class:`LMHeadEngine`; outputs one key, ``values``."""

    def prepare_model_outputs(self, output: Any, output_args: Mapping[str, Any], micro_batch: TensorDictBase,
                              logits_processor_func: LogitsProcessor | None = None,
                              **verl_only: Any) -> dict[str, torch.Tensor]:
        return prepare_value_outputs(output, output_args, micro_batch, self.settings)
