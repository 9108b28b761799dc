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

from ...protocol.known import KnownFailure
from ...protocol.engine import InputsView, verl_fsdp_view
from ...protocol.profile import ConfigSwitch
from ..kit.hf_batch import BatchFlags
from ..verl.native import NativeVerlEngine, native_profile
from ..verl.mutants import ENTROPY_CHECKPOINT, INT64_ZEROS_LIKE
from ..verl.records import (LOW_PRECISION_RECORDS, SETTINGS_UNCHECKED, entropy_cancellation, flag_types,
                            fp16_clamp_cast_records, fused_padded_dense_slices, loss_mask_attention)
from ..verl.profile import NO_DTENSOR

__all__ = ["AutomodelEngine"]

MASK = ("the padded attention mask is built from the response-only loss_mask (r_i ones per row, not n_i): the model "
        "sees only the first r_i tokens of each sequence; engine bug, verl issue #6278, fixed for FSDP by PR #6345")
NO_SHIFT_LABELS = ("fused kernels get no shift_labels: the model rolls its own ids (the same labels without sequence "
                   "parallelism, which this engine does not offer); contract difference")

KNOWN_RECORDS: tuple[KnownFailure, ...] = (
    *fused_padded_dense_slices("engine bug (FSDP's engine re-packs them by the full lengths)"),
    *loss_mask_attention(reason=MASK),
    KnownFailure("INV-FUSED-001", NO_SHIFT_LABELS, matches=r"the model's labels \(shift_labels\) None", modes=("packed",)),
    entropy_cancellation(),  # both modes: the padded path takes the same entropy_from_logits
    flag_types(),
    SETTINGS_UNCHECKED,
    # the same scaling and functions in the logits' dtype as verl's FSDP engine: its low-precision records
    *LOW_PRECISION_RECORDS,
    *fp16_clamp_cast_records(),
)


#: survivors of ``spec mutate --engine verl-automodel`` no check can tell from Automodel's code, each with why
_DENSE_SLICES = ("masked by a recorded engine bug, not a behaviour the contract tells apart: the padded fused path "
                 "returns dense response slices output.log_probs / output.entropy[:, -L-1:-1] instead of nested full "
                 "sequences (fused_padded_dense_slices' records), so every check of that path fails on the layout "
                 "first; a slice one column off is another wrong layout of the same recorded failure")
_AUTOMODEL = "verl.workers.engine.automodel.transformer_impl:AutomodelEngineWithLMHead.prepare_model_outputs"
AUTOMODEL_EQUIVALENT_MUTANTS: dict[str, str] = {
    **{f"{_AUTOMODEL}:{mutant}": _DENSE_SLICES for mutant in (
        "649 slice: slice lower + 1", "648 slice: slice upper + 1", "649 slice: slice upper + 1",
        "648 arith: Sub -> Add", "649 slice: slice upper sign", "648 slice: slice upper sign",
        "648 slice: slice lower + 1", "649 arith: Sub -> Add")},
    f"{_AUTOMODEL}:624 branch: condition negated": ENTROPY_CHECKPOINT,
    f"{_AUTOMODEL}:660 branch: condition negated": ENTROPY_CHECKPOINT,
    f"{_AUTOMODEL}:615 branch: condition negated":
        "no effect without flash-attn: inplace_backward is read only by flash-attn's Triton cross-entropy "
        "(logprobs_from_logits' CUDA branch, declared unreachable here); the pure-torch path ignores it",
    f"{_AUTOMODEL}:668 dtype: dtype= dropped": INT64_ZEROS_LIKE,
}


#: NeMo AutoModel's own model classes return the logits tensor itself, a Hugging Face model an output with ``.logits``
#: (the engine wraps a tensor: ``if isinstance(output, torch.Tensor)``); fused kernels return an output either way
LOGITS_TENSOR = ConfigSwitch("model_returns_logits_tensor", (False, True),
                             "the model's forward returns the logits tensor itself (NeMo AutoModel's own model classes), "
                             "not an output with .logits (fused kernels: an output either way)")


class AutomodelObject:
    def __init__(self, eng: Any):
        #: the model returns the logits tensor itself (:data:`LOGITS_TENSOR`, set by :meth:`AutomodelEngine.make`)
        self.verl_engine, self.logits_tensor = eng, False

    def prepare_model_inputs(self, micro_batch):
        return self.verl_engine.prepare_model_inputs(micro_batch)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        if self.logits_tensor and not BatchFlags.from_batch(micro_batch).use_fused_kernels:
            output = output.logits  # what NeMo AutoModel's own model returns
        return self.verl_engine.prepare_model_outputs(output, output_args, micro_batch)


class AutomodelEngine(NativeVerlEngine):
    """verl's FSDP convention (:func:`verl_fsdp_view`), but the TransformerEngine backend is handed
    ``cu_seqlens`` as ``(1, B + 1)``: the view flattens it."""

    name = "verl-automodel"
    module = "verl.workers.engine.automodel.transformer_impl"
    packages = ("nemo_automodel",)
    lm_class = "AutomodelEngineWithLMHead"
    #: its own prepare_model_inputs / prepare_model_outputs, verl's helpers and micro-batch layer
    profile = native_profile(NativeVerlEngine.profile, module, lm_class,
                             {"610->611": NO_DTENSOR, "653->654": NO_DTENSOR}, (LOGITS_TENSOR,),
                             equivalents=AUTOMODEL_EQUIVALENT_MUTANTS)
    sp_reason = "context parallelism goes through the engine's device mesh, not run here"
    #: precise records (KNOWN_RECORDS above); spec/engines/automodel/README.md classifies each
    KNOWN = {"*": KNOWN_RECORDS}

    def view_inputs(self, model_inputs, output_args) -> InputsView:
        view = verl_fsdp_view(model_inputs, output_args)
        if view.cu_seqlens is not None:
            view.cu_seqlens = view.cu_seqlens.reshape(-1)
        return view

    def make(self, head: str = "lm", **settings: Any) -> AutomodelObject:
        cu_seqlens = bool(settings.get("pass_cu_seqlens"))
        obj = super().make(head, **settings)
        obj.verl_engine.engine_config.attn_implementation = "te" if cu_seqlens else "sdpa"
        obj.logits_tensor = bool(settings.get(LOGITS_TENSOR.name))
        return obj

    def wrap(self, eng: Any) -> AutomodelObject:
        return AutomodelObject(eng)
