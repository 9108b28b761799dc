"""verl's TorchTitan engine as an engine under test (``--engine verl-torchtitan``).

``TorchTitanEngineWithLMHead`` has its own preparation with another calling convention:
``prepare_model_inputs(mb) -> (input_ids, extra_inputs, extra_kwargs, output_args)`` where
``extra_inputs["positions"]`` are the position ids and ``extra_kwargs["attention_masks"]`` is the
attention metadata (packed: ``torchtitan/utils.py``'s varlen metadata, boundaries found where the
positions restart; padded: a dense mask), ``output_args["labels"]`` the rolled ids; and
``prepare_model_outputs(logits, output_args, mb)``, which reads the temperature from the micro-batch.

The engine object here maps that onto the suite's convention (the normalized hand-off): model inputs
``input_ids``, ``position_ids``, ``attention_mask`` (padded: TorchTitan's mask; packed: None) and
``cu_seqlens`` (the varlen metadata's ``cu_seq_q``), and an ``input_ids_rmpad_rolled`` alias of the
labels (a view of the same tensor) in TorchTitan's own ``output_args`` dict, which is handed back to
TorchTitan unchanged otherwise.

``torchtitan`` is stubbed where verl imports it at module level and it does not import (the
TorchTitan on the package index does not match verl 0.9.1's imports); ``VarlenMetadata`` is given a
stand-in record with TorchTitan's fields (``cu_seq_q, cu_seq_k, max_q, max_k``) so verl's own
``_create_varlen_metadata_for_document`` runs. Context parallelism (``prepare_context_parallel_input``,
a TorchTitan function) is not run.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..protocol import Feature
from .native import NativeVerlEngine

__all__ = ["TorchTitanEngine", "VarlenMetadata"]


class VarlenMetadata(NamedTuple):
    """Stand-in for ``torchtitan.models.common.attention.VarlenMetadata`` (same fields)."""

    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int


class TorchTitanObject:
    def __init__(self, eng: Any):
        self.verl_engine = eng

    def prepare_model_inputs(self, micro_batch):
        input_ids, extra_inputs, extra_kwargs, output_args = self.verl_engine.prepare_model_inputs(micro_batch)
        masks = extra_kwargs["attention_masks"]
        packed = not isinstance(masks, torch.Tensor)
        model_inputs = {"input_ids": input_ids, "position_ids": extra_inputs["positions"],
                        "attention_mask": None if packed else masks}
        if packed:
            model_inputs["cu_seqlens"] = masks.cu_seq_q
        output_args["input_ids_rmpad_rolled"] = output_args["labels"].reshape(-1)
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        return self.verl_engine.prepare_model_outputs(output.logits, output_args, micro_batch)


class TorchTitanEngine(NativeVerlEngine):
    name = "verl-torchtitan"
    module = "verl.workers.engine.torchtitan.transformer_impl"
    packages = ("torchtitan",)
    lm_class = "TorchTitanEngineWithLMHead"
    records = {"torchtitan.models.common.attention": {"VarlenMetadata": VarlenMetadata},
               # a base class of verl's NoOpDataLoader (torchtitan/utils.py) must be a class
               "torchtitan.components.dataloader": {"BaseDataLoader": type("BaseDataLoader", (), {
                   "Config": type("Config", (), {})})}}
    sp_reason = ("context parallelism goes through torchtitan's prepare_context_parallel_input and a device "
                 "mesh, not run here")
    KNOWN: dict[str, dict[str, str]] = {}

    def lacks(self, feature: str | Feature) -> str | None:  # type: ignore[override]
        if Feature.parse(feature) is Feature.CU_SEQLENS:
            return self._no("the packed boundaries always reach the model as varlen metadata "
                            "(extra_kwargs['attention_masks']); there is no cu_seqlens setting to switch")
        return super().lacks(feature)

    def wrap(self, eng: Any) -> TorchTitanObject:
        eng.parallel_dims = _NoCP()
        return TorchTitanObject(eng)


class _NoCP:
    cp_enabled = False
