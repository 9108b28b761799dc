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
    KNOWN: dict[str, dict[str, str]] = {}

    def make(self, head: str = "lm", **settings: Any) -> AutomodelObject:
        cu_seqlens = bool(settings.get("pass_cu_seqlens"))
        obj = super().make(head, **settings)
        obj.verl_engine.engine_config.attn_implementation = "te" if cu_seqlens else "sdpa"
        return obj

    def wrap(self, eng: Any) -> AutomodelObject:
        return AutomodelObject(eng)
