"""verl's TorchTitan engine as an engine under test (``--engine verl-torchtitan``).

``TorchTitanEngineWithLMHead`` has its own preparation with another calling convention:
``prepare_model_inputs(mb) -> (input_ids, extra_inputs, extra_kwargs, output_args)`` where
``extra_inputs["positions"]`` are the position ids and ``extra_kwargs["attention_masks"]`` is the
attention metadata (packed: ``torchtitan/utils.py``'s varlen metadata, boundaries found where the
positions restart; padded: a dense mask), ``output_args["labels"]`` the rolled ids; and
``prepare_model_outputs(logits, output_args, mb)``, which reads the temperature from the micro-batch.

The engine object hands the suite's model what TorchTitan hands its own: ``input_ids``, ``position_ids``
(TorchTitan's ``positions``), ``attention_mask`` (padded: TorchTitan's mask; packed: None),
``cu_seqlens`` (the varlen metadata's ``cu_seq_q``) and the images' and videos' features and grids
(the rest of ``extra_inputs``: ``extract_multi_modal_inputs``' keys, under their names); TorchTitan's own
``output_args`` go back to it untouched. The varlen metadata always reaches the model (the suite's
``pass_cu_seqlens`` setting changes nothing), so INV-CU-001 checks its ``cu_seq_q`` on every packed case.
:meth:`TorchTitanEngine.view_inputs` reads the labels from ``output_args["labels"]``; the temperature
is not handed over (the output step reads ``micro_batch["temperature"]``), so the engine lacks
:attr:`Feature.TEMPERATURE_HANDOFF`.

``torchtitan`` is stubbed where verl imports it at module level and it does not import (the
TorchTitan on the package index does not match verl 0.9.1's imports); ``VarlenMetadata`` is given a
stand-in record with TorchTitan's fields (``cu_seq_q, cu_seq_k, max_q, max_k``) so verl's own
``_create_varlen_metadata_for_document`` runs. Context parallelism (``prepare_context_parallel_input``,
a TorchTitan function) is not run.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

import torch

from ...protocol.known import KnownFailure, When
from ...protocol.profile import Convention
from ...protocol.engine import CONTRACT_PRECISION, Feature, InputsView, Precision, media_view
from ...truth.rules import TEMPERATURE_FLOOR
from ..kit.records import SAMPLE_MISMATCH, UNCLAMPED, VALUE_MISMATCH
from ..verl.native import NATIVE_LOGITS_HELPERS, NativeVerlEngine, native_profile
from ..verl.mutants import ENTROPY_CHECKPOINT, INT64_ZEROS_LIKE
from ..verl.records import (
    FP16_WIDE_VOCAB,
    FP16_WIDE_VOCAB_REASON,
    LOW_PRECISION_RECORDS,
    PER_SAMPLE_ON_VOCAB,
    SETTINGS_UNCHECKED,
    entropy_cancellation,
    flag_types,
    fp16_records,
    loss_mask_attention,
)

__all__ = ["TorchTitanEngine", "VarlenMetadata"]

TEMPERATURE = ("prepare_model_outputs divides the (n, V) / (B, L, V) logits by micro_batch['temperature'] as is: a "
               "per-sample (B,) tensor broadcasts against the vocab axis, RuntimeError when B != V and silently "
               "wrong (vocab column j scaled by sample j's temperature) when B == V; engine bug")
NO_CLAMP = ("prepare_model_outputs divides by the temperature without the 1e-8 clamp every other verl engine applies: "
            "at T = 5e-9 log-probs are twice the clamped ones; engine bug")
MASK = ("the padded attention mask is built from the response-only loss_mask (r_i ones per row, not n_i): the model "
        "sees only the first r_i tokens of each sequence; engine bug, verl issue #6278, fixed for FSDP by PR #6345")
#: the invariants whose cases force per-sample temperatures (the strategy limit keeps them out of the others)
PER_SAMPLE_INVARIANTS = ("INV-BATCH-001", "INV-BATCH-002", "INV-TEMP-001", "INV-TEMP-006")
#: INV-TEMP-002 runs every case's temperature also as a (B,) tensor: B != V raises (equal values on B = V are right)
AS_TENSOR_ON_VOCAB = When("B >= 2 samples with B != V (the check also hands the temperature as a (B,) tensor)",
                          lambda case: case.batch_size >= 2 and case.batch_size != case.vocab)

MROPE_VARLEN = ("get_attention_masks -> _create_varlen_metadata_for_document is written for (batch, seq) positions: with "
                "the packed mRoPE positions (4, 1, nnz), positions[:, :1] keeps the whole tensor and boundary_mask[0] is "
                "a (1, 2 nnz) row whose nonzero(as_tuple=True)[0] holds row indices (all 0), so cu_seq_q = [0, nnz]: "
                "one document over every sample of the micro-batch (a real varlen attention lets each sample see those "
                "packed before it); engine bug")
#: packed mRoPE positions over two or more samples (one sample's [0, nnz] is right)
MROPE_SAMPLES = When("mRoPE positions, packed, over B >= 2 samples", lambda case: case.mrope and case.batch_size >= 2)
#: the checks that compare a packed output with the per-sequence oracle (or a run of other samples), where the one
#: varlen document shows: the stand-in model attends within the cu_seqlens it is handed, as a varlen kernel does, so
#: every sample after the first sees the samples packed before it (the micro-batch layer's end-to-end check names
#: samples, its own pattern)
MROPE_VARLEN_VALUES = {inv: VALUE_MISMATCH for inv in (
    "INV-VAL-001", "INV-VAL-002", "INV-VAL-003", "INV-VAL-004", "INV-VAL-005", "INV-TEMP-001", "INV-TEMP-003",
    "INV-TEMP-006", "INV-SLICE-002", "INV-SLICE-006", "INV-BATCH-001", "INV-BATCH-002", "INV-EDGE-001", "INV-MM-001",
    "INV-MM-002", "INV-KEYS-003")} | {"INV-MB-015": SAMPLE_MISMATCH}

#: the packed path divides by the temperature out of place: a (B,) float32 tensor promotes bf16/fp16 logits to float32
PROMOTED = When("packed with a per-sample (B,) temperature (logits / a float32 tensor: float32 outputs)",
                lambda case: case.use_remove_padding and case.per_sample_temperature and not case.use_fused_kernels)
FP16_OVERFLOW = ("divides float16 logits by the raw temperature (no clamp, no cast): at T <= 1e-8 any |logit| above "
                 "6.6e-4 scales past float16's 65,504 to inf, and the log-softmax of inf is NaN; engine bug (the "
                 "contract clamps at 1e-8 and scales in float32)")
#: float16 logits at a temperature at or below the 1e-8 clamp (a float temperature keeps the logits' dtype)
FP16_TINY_TEMPERATURE = When("float16 logits and a temperature at or below 1e-8 (logits / T overflows float16)",
                             lambda case: case.logits_dtype == "float16" and min(case.temperatures()) <= TEMPERATURE_FLOOR)

KNOWN_RECORDS: tuple[KnownFailure, ...] = (
    SETTINGS_UNCHECKED,
    *(KnownFailure(inv, TEMPERATURE, raises=(RuntimeError, AssertionError),
                   matches=r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)|" + VALUE_MISMATCH,
                   when=PER_SAMPLE_ON_VOCAB) for inv in PER_SAMPLE_INVARIANTS),
    KnownFailure("INV-TEMP-002", TEMPERATURE, raises=RuntimeError,
                 matches=r"The size of tensor a \(\d+\) must match the size of tensor b \(\d+\)", when=AS_TENSOR_ON_VOCAB),
    *(KnownFailure(inv, NO_CLAMP, matches=VALUE_MISMATCH, when=UNCLAMPED & ~PER_SAMPLE_ON_VOCAB, modes=modes)
      for inv, modes in (("INV-TEMP-006", ()), ("INV-VAL-001", ()), ("INV-SLICE-006", ()))),
    # every padded case fails for the mask (records above excuse the cases they cover first)
    *loss_mask_attention(reason=MASK),
    KnownFailure("INV-CU-001", MROPE_VARLEN, raises=AssertionError, modes=("packed",), when=MROPE_SAMPLES,
                 matches=r"cu_seqlens \[0, (\d+)\], expected \[0, (\d+, )+\1\]"),
    # (certain=False: a cut or a sub-batch of one sample per micro-batch has the right single document)
    *(KnownFailure(inv, MROPE_VARLEN + " (seen in the outputs)", raises=AssertionError,
                   modes=() if inv == "INV-KEYS-003" else ("packed",),  # (packed against padded: its mode is both)
                   when=MROPE_SAMPLES, matches=pattern, certain=False)
      for inv, pattern in MROPE_VARLEN_VALUES.items()),
    entropy_cancellation(),  # both modes: the padded path takes the same entropy_from_logits
    flag_types(),
    # the FSDP engine's low-precision records (the same functions in the logits' dtype), INV-DEV-001 but where a
    # (B,) temperature promotes the outputs to float32
    *(replace(r, when=r.when & ~PROMOTED) if r.invariant == "INV-DEV-001" else r for r in LOW_PRECISION_RECORDS),
    *fp16_records(FP16_TINY_TEMPERATURE, FP16_OVERFLOW),
    *fp16_records(FP16_WIDE_VOCAB, FP16_WIDE_VOCAB_REASON),
)


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
        # extra_inputs beyond the positions are extract_multi_modal_inputs' keys: handed under their own names
        model_inputs = {**{k: v for k, v in extra_inputs.items() if k != "positions"}, "input_ids": input_ids,
                        "position_ids": extra_inputs["positions"], "attention_mask": None if packed else masks}
        if packed:
            model_inputs["cu_seqlens"] = masks.cu_seq_q
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None):
        return self.verl_engine.prepare_model_outputs(output.logits, output_args, micro_batch)


#: survivors of ``spec mutate --engine verl-torchtitan`` no check can tell from TorchTitan's code, each with why
_TORCHTITAN = "verl.workers.engine.torchtitan.transformer_impl:TorchTitanEngineWithLMHead.prepare_model_outputs"
TORCHTITAN_EQUIVALENT_MUTANTS: dict[str, str] = {
    f"{_TORCHTITAN}:819 branch: condition negated": ENTROPY_CHECKPOINT,
    f"{_TORCHTITAN}:836 branch: condition negated": ENTROPY_CHECKPOINT,
    f"{_TORCHTITAN}:842 dtype: dtype= dropped": INT64_ZEROS_LIKE,
}


class TorchTitanEngine(NativeVerlEngine):
    name = "verl-torchtitan"
    module = "verl.workers.engine.torchtitan.transformer_impl"
    packages = ("torchtitan",)
    lm_class = "TorchTitanEngineWithLMHead"
    #: its own prepare_model_inputs / prepare_model_outputs, verl's helpers and micro-batch layer
    # one float temperature drawn: the per-sample temperature bug (TEMPERATURE) would fail every invariant that draws
    # one; those that force per-sample temperatures carry its record
    # its padded path builds the attention mask as int32 (torch.ones_like(..., dtype=torch.int32)): verl's convention
    profile = native_profile(replace(NativeVerlEngine.profile, per_sample_temperature=False,
                                     conventions=frozenset({Convention.INT32_ATTENTION_MASK})), module, lm_class, {
        "776->777": "needs context parallelism: a CP device mesh (parallel_dims.cp_enabled; "
                    "prepare_context_parallel_input shards over it)"},
        helpers=tuple(h for h in NATIVE_LOGITS_HELPERS if not h.endswith(":expand_as_nested")),  # one temperature
        equivalents=TORCHTITAN_EQUIVALENT_MUTANTS)
    records = {"torchtitan.models.common.attention": {"VarlenMetadata": VarlenMetadata},
               # a base class of verl's NoOpDataLoader (torchtitan/utils.py) must be a class
               "torchtitan.components.dataloader": {"BaseDataLoader": type("BaseDataLoader", (), {
                   "Config": type("Config", (), {})})}}
    sp_reason = ("context parallelism goes through torchtitan's prepare_context_parallel_input and a device "
                 "mesh, not run here")
    #: precise records (KNOWN_RECORDS above); spec/engines/torchtitan/README.md classifies each
    KNOWN = {"*": KNOWN_RECORDS}

    def precision(self, key: str, case: Any) -> Precision:  # type: ignore[override]
        """``prepare_model_outputs`` divides the logits by ``micro_batch["temperature"]`` as it is: a float keeps
        their dtype (log_probs and the unchunked entropy in it, the packed chunked entropy in float32, as verl's
        FSDP engine), but on the packed path a per-sample ``(B,)`` float32 tensor promotes the out-of-place
        division and everything after it to float32 (the padded path's ``logits.div_`` keeps the logits' dtype)."""
        if PROMOTED(case):
            return CONTRACT_PRECISION
        return super().precision(key, case)

    def view_inputs(self, model_inputs, output_args) -> InputsView:
        labels = output_args.get("labels")
        return InputsView(input_ids=model_inputs["input_ids"], position_ids=model_inputs["position_ids"],
                          attention_mask=model_inputs["attention_mask"], cu_seqlens=model_inputs.get("cu_seqlens"),
                          labels=None if labels is None else labels.reshape(-1), media=media_view(model_inputs))

    def lacks(self, feature: str | Feature) -> str | None:  # type: ignore[override]
        if Feature.parse(feature) is Feature.TEMPERATURE_HANDOFF:
            return self._no("prepare_model_outputs reads micro_batch['temperature'] itself; the input step hands "
                            "no temperature over")
        return super().lacks(feature)

    def wrap(self, eng: Any) -> TorchTitanObject:
        eng.parallel_dims = _NoCP()
        return TorchTitanObject(eng)


class _NoCP:
    cp_enabled = False
