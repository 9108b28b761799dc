"""A case's micro-batch as data a standalone file rebuilds with plain torch and tensordict.

Each nested tensor becomes its values (flat list, dtype, shape), its offsets and its ragged dim; a micro-batch
split from a mini-batch (``case.split_view``) is rebuilt as the same view into a bigger buffer. Flags become
plain values (``pad_mode`` its string; the file wraps it in a ``str`` Enum as verl's ``DatasetPadMode`` is).
The case's structure (lengths, temperatures, flags, settings) goes with it: what the file's reference and
hand-off read.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

import torch
from tensordict import NonTensorStack

from ..cases.materialize import materialize
from ..cases.structure import EngineCase
from ..protocol.engine import EngineUnderTest, OutputSpan, PaddedLayout
from ..protocol.profile import Convention, Feature, HeadInput, padded_layout_of, profile_of, tail_multiple_of
from ..protocol.vendor import assignments
from ..truth.settings_checks import offered_settings

__all__ = ["batch_data", "case_data", "declarations", "declared_precision", "INLINE_LIMIT"]

#: up to this many tensor elements per run the values are written into the file; beyond, into a .pt beside it
INLINE_LIMIT = 4096


def case_data(case: EngineCase) -> dict[str, Any]:
    """What the file's hand-off and reference read of the case (plain Python values)."""
    return {
        "prompt_lens": list(case.prompt_lens), "response_lens": list(case.response_lens),
        "seq_lens": list(case.seq_lens), "total_nnz": case.total_nnz, "batch_size": case.batch_size,
        "vocab": case.vocab, "seed": int(case.seed), "logits_dtype": case.logits_dtype, "head": case.head,
        "temperatures": [float(t) for t in case.temperatures()], "use_remove_padding": case.use_remove_padding,
        "calculate_entropy": case.calculate_entropy, "calculate_sum_pi_squared": case.calculate_sum_pi_squared,
        "distillation_keys": list(case.distillation_keys), "distillation_use_topk": case.distillation_use_topk,
        "distillation_only": case.distillation_only, "use_fused_kernels": case.use_fused_kernels,
        "topk": case.topk, "sp_size": case.sp_size, "pad_to_length": case.pad_to_length,
        "pass_cu_seqlens": case.pass_cu_seqlens, "entropy_chunk_size": case.entropy_chunk_size,
        "response_width": case.response_width, "split_view": case.split_view,
        # the autograd context the engine runs in and the engine's own switches (spec/execute/handoff.py)
        "context": case.context, "engine_config": [list(item) for item in case.engine_config],
        # each sample's images and videos as structure (INV-MM-001 counts their merged groups per kind)
        "media": [[{"kind": m.kind, "grid": list(m.grid), "gap": m.gap, "tokens": m.tokens} for m in items]
                  for items in case.media],
        # whether its media are audio clips (the harness's audio input check and INV-MM-003 read it)
        "has_audio": case.has_audio,
    }


def declared_precision(engine: EngineUnderTest, case: EngineCase) -> dict[str, tuple[str, str]]:
    """Output key -> ``(returns, scaled_in)`` where the engine declares a precision other than the contract's for
    ``case``'s path (:meth:`EngineUnderTest.precision`): the file compares that key at it, as the suite does
    (``spec.invariants.core.Ctx.oracle``)."""
    keys = ("log_probs", "entropy", "sum_pi_squared", "values", *case.distillation_keys)
    declared = {key: engine.precision(key, case) for key in keys}
    return {key: (p.returns, p.scaled_in) for key, p in declared.items()
            if p is not None and (p.returns, p.scaled_in) != ("float32", "float32")}


def declarations(engine: EngineUnderTest, case: Any = None) -> str:
    """What the file's checks read of the engine's declarations, as its assignment lines: its padded layout (on
    ``case``, where given: a drawn switch may change it) and output span, whether its profile promises verl's int32
    attention mask, its tail multiple, the settings it refuses, what its model hands it, whether it hands over a
    per-token temperature (the invariants read the same)."""
    return assignments({
        "PADDED_LAYOUT": (padded_layout_of(engine, case) if case is not None
                          else PaddedLayout(getattr(engine, "padded_layout", PaddedLayout.RIGHT))).value,
        "OUTPUT_SPAN": OutputSpan(getattr(engine, "output_span", OutputSpan.SEQUENCE)).value,
        "INT32_ATTENTION_MASK": profile_of(engine).promises(Convention.INT32_ATTENTION_MASK),
        "TAIL_MULTIPLE": tail_multiple_of(engine, case) if case is not None else profile_of(engine).tail_multiple,
        "REFUSES": sorted(profile_of(engine).refuses),
        "HEAD_INPUT": HeadInput(getattr(engine, "head_input", HeadInput.LOGITS)).value,
        "HANDS_TEMPERATURE": engine.lacks(Feature.TEMPERATURE_HANDOFF) is None,
        "SETTINGS_OFFERED": offered_settings(engine),
        "MEDIA_MARKS": list(profile_of(engine).media_marks)}, {
        "PADDED_LAYOUT": "where the engine puts each sequence in its padded (B, L) model input",
        "OUTPUT_SPAN": "which positions of each sequence its per-token outputs cover",
        "INT32_ATTENTION_MASK": "its profile declares verl's int32 attention mask",
        "TAIL_MULTIPLE": "its packed row is padded at its tail to a multiple of this on the case (None: no rule)",
        "REFUSES": "the settings its profile declares unsupported (INV-FLAG-004/005: each call must refuse them)",
        "HEAD_INPUT": "what the stand-in model hands its lm head's output step: logits, or (a fused head) hidden "
                      "states and the LM-head weight",
        "HANDS_TEMPERATURE": "its input step hands its output step a per-token temperature (the rank checks read "
                             "it; an engine lacking the hand-off takes one float)",
        "SETTINGS_OFFERED": "the engine settings it takes of sp, bucket and chunking (INV-SET-001 hands it only "
                            "impossible values of those)",
        "MEDIA_MARKS": "the marks of the media tokens its model places the features at (handed with media)"})


def _plain(value: Any) -> Any:
    value = getattr(value, "data", value)
    return value.value if isinstance(value, Enum) else value


def _entry(name: str, item: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """A per-sample stack's entry as data: a dict's tensors by name (``<key>/<sample>/<dict key>``, their values put
    in ``tensors``) with their dtype and shape, ``None`` and plain values as they are."""
    if not isinstance(item, dict):
        return _plain(item)
    out = {}
    for key, value in item.items():
        if isinstance(value, torch.Tensor):
            tensors[f"{name}/{key}"] = value.detach().cpu().contiguous()
            out[key] = {"tensor": f"{name}/{key}", "dtype": str(value.dtype).removeprefix("torch."),
                        "shape": list(value.shape)}
        else:
            out[key] = _plain(value)
    return out


def batch_data(case: EngineCase) -> tuple[dict[str, Any], dict[str, torch.Tensor], int]:
    """``(data, tensors, elements)``: ``data`` describes every key of the case's micro-batch (nested: dtype,
    shape of the values, offsets, ragged dim; dense: dtype and shape; a per-sample stack: its entries; flags: the
    value), ``tensors`` holds the
    values by key, ``elements`` counts them (the writer inlines them below :data:`INLINE_LIMIT`)."""
    td = materialize(case, "cpu")
    data: dict[str, Any] = {"nested": {}, "dense": {}, "stacks": {}, "flags": {}}
    tensors: dict[str, torch.Tensor] = {}
    for key in td.keys():
        value = td.get(key)
        if isinstance(value, NonTensorStack):
            data["stacks"][key] = [_entry(f"{key}/{i}", item, tensors) for i, item in enumerate(value.tolist())]
        elif isinstance(value, torch.Tensor) and value.is_nested:
            values = value.values().contiguous()
            data["nested"][key] = {"dtype": str(values.dtype).removeprefix("torch."), "shape": list(values.shape),
                                   "offsets": value.offsets().tolist(),
                                   "ragged_dim": int(getattr(value, "_ragged_idx", 1))}
            tensors[key] = values
        elif isinstance(value, torch.Tensor):
            data["dense"][key] = {"dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}
            tensors[key] = value.contiguous()
        else:
            data["flags"][key] = _plain(value)
    return data, tensors, sum(t.numel() for t in tensors.values())
