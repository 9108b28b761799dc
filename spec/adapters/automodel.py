"""verl's Automodel (NeMo) engine as an engine under test (``--engine verl-automodel``).

``AutomodelEngineWithLMHead`` has its own ``prepare_model_inputs(mb) -> (model_inputs, output_args)``
(verl's FSDP convention, keys included) and ``prepare_model_outputs(output, output_args, mb)`` without
``logits_processor_func``: no top-K distillation, no value head, no bucket, no sequence parallelism.
The suite's ``pass_cu_seqlens`` setting maps onto its TransformerEngine attention backend
(``engine_config.attn_implementation == "te"``), the one under which it passes ``cu_seqlens``.

``nemo_automodel`` is stubbed where verl imports it at module level and it does not import here.
"""

from __future__ import annotations

from typing import Any

from .native import NativeVerlEngine

__all__ = ["AutomodelEngine"]

MASK = ("the padded attention mask is built from the response-only loss_mask (r_i ones per row, not n_i): the model "
        "sees only the first r_i tokens of each sequence; engine bug, verl issue #6278, fixed for FSDP by PR #6345")
FUSED_PADDED = ("padded fused kernels return dense response slices output.log_probs[:, -L-1:-1] (L = the "
                "max_response_length flag, default 1024) instead of nested full sequences; engine bug (FSDP's "
                "engine re-packs them by the full lengths)")
NO_SUM_PI = ("calculate_sum_pi_squared is ignored (no sum_pi_squared output); contract difference (feature not "
             "offered; the suite has no capability for it yet)")


class AutomodelObject:
    def __init__(self, eng: Any):
        self.verl_engine = eng

    def prepare_model_inputs(self, micro_batch):
        return self.verl_engine.prepare_model_inputs(micro_batch)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        return self.verl_engine.prepare_model_outputs(output, output_args, micro_batch)


class AutomodelEngine(NativeVerlEngine):
    name = "verl-automodel"
    module = "verl.workers.engine.automodel.transformer_impl"
    packages = ("nemo_automodel",)
    lm_class = "AutomodelEngineWithLMHead"
    sp_reason = "context parallelism goes through the engine's device mesh, not run here"
    #: docs/engines/verl-automodel.md classifies each (keys: ``ID`` or ``ID/mode``, today's format)
    KNOWN: dict[str, dict[str, str]] = {"*": {
        **{f"{key}/padded": MASK for key in ("INV-MASK-001", "INV-MASK-003", "INV-VAL-001", "INV-VAL-002",
                                             "INV-TEMP-001", "INV-TEMP-003")},
        **{f"{key}/padded": FUSED_PADDED for key in ("INV-BATCH-001", "INV-BATCH-002", "INV-CHUNK-001",
                                                     "INV-LAYOUT-001", "INV-LEAK-001", "INV-LEAK-002")},
        "INV-KEYS-003": FUSED_PADDED + "; and " + MASK,
        "INV-KEYS-001": NO_SUM_PI,
        "INV-VAL-003": NO_SUM_PI,
        "INV-CU-001/packed": ("passes cu_seqlens as (1, B+1) int32 with qkv_format='thd' and max_seqlen (TransformerEngine's "
                              "convention), no cu_seqlens_cpu; contract difference"),
        "INV-FUSED-001/packed": ("fused kernels get no shift_labels: the model rolls its own ids (the same labels without "
                                 "sequence parallelism); contract difference"),
    }}

    def make(self, head: str = "lm", **settings: Any) -> AutomodelObject:
        cu_seqlens = bool(settings.get("pass_cu_seqlens"))
        obj = super().make(head, **settings)
        obj.verl_engine.engine_config.attn_implementation = "te" if cu_seqlens else "sdpa"
        return obj

    def wrap(self, eng: Any) -> AutomodelObject:
        return AutomodelObject(eng)
