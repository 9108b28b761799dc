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

TEMPERATURE = ("prepare_model_outputs divides the (n, V) / (B, L, V) logits by micro_batch['temperature'] as is: a "
               "per-sample (B,) tensor broadcasts against the vocab axis, RuntimeError when B != V and silently "
               "wrong (vocab column j scaled by sample j's temperature) when B == V; engine bug")
MASK = ("the padded attention mask is built from the response-only loss_mask (r_i ones per row, not n_i): the model "
        "sees only the first r_i tokens of each sequence; engine bug, verl issue #6278, fixed for FSDP by PR #6345")
NO_SUM_PI = ("calculate_sum_pi_squared is ignored (no sum_pi_squared output); contract difference (feature not "
             "offered; the suite has no capability for it yet)")


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
    #: docs/engines/verl-torchtitan.md classifies each (keys: ``ID`` or ``ID/mode``, today's format)
    KNOWN: dict[str, dict[str, str]] = {"*": {
        **{key: TEMPERATURE for key in ("INV-BATCH-001", "INV-BATCH-002", "INV-CHUNK-001", "INV-DEV-001",
                                        "INV-KEYS-002", "INV-LAYOUT-001", "INV-LEAK-001", "INV-LEAK-002",
                                        "INV-MUT-001", "INV-MUT-004", "INV-TEMP-002", "INV-TEMP-001",
                                        "INV-VAL-001/packed", "INV-VAL-002/packed", "INV-MUT-002/packed")},
        **{key: MASK for key in ("INV-MASK-001/padded", "INV-MASK-003/padded", "INV-TEMP-003/padded",
                                 "INV-VAL-001/padded", "INV-VAL-002/padded", "INV-KEYS-003")},
        "INV-MUT-002/padded": ("the padded branch divides the model's logits by temperature in place (logits.div_); "
                               "engine bug (verl 0.7.1's FSDP had it, later FSDP scales out of place)"),
        "INV-KEYS-001": NO_SUM_PI,
        "INV-VAL-003": NO_SUM_PI,
        "INV-TEMP-004/packed": ("hands no per-token temperature to the output step (it divides by "
                                "micro_batch['temperature']); suite defect: INV-TEMP-004 reads verl's private "
                                "output_args['temperature_rmpad'] instead of the normalized view"),
    }}

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
