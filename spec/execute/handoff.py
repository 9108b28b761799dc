"""What one run of a case holds, and the hand-off around the model: the engine's settings per rank, the
stand-in model for a case, and its outputs handed to each rank with every padded slot poisoned. Shared by
the in-process harness (:mod:`.harness`) and the real ranks (:mod:`.ranks`, :mod:`.rank_worker`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable

import torch
from tensordict import TensorDict

from ..cases.structure import EngineCase
from ..protocol.engine import EngineUnderTest, HeadInput, InputsView, OutputsView, PaddedLayout
from ..protocol.profile import drawn_config
from ..truth.audio import AUDIO_KEYS, AUDIO_STRIDE, N_MELS, audio_token_id
from ..truth.rules import layout_mask
from ..truth.state_checks import batch_entry, held as held_value, nested_parts
from ..truth.toy_model import HEAD_WEIGHT, POSITION_AXES, ToyCausalLM
from ..truth.vision import MEDIA_KEYS, PATCH_DIM, media_token_ids, media_tokens
from .attribution import EngineFault, check_outputs, note_fault, read_engine

__all__ = ["Run", "ThreadedAllGather", "POISONS", "model_for", "attach_views", "nested_parts", "snapshot",
           "check_model_inputs", "check_media_inputs",
           "execution_context", "rank_outputs", "view_outputs", "attach_outputs"]

#: what fills every padded logit slot and the packed tail: nothing of it may reach an output
POISONS = {"nan": float("nan"), "huge": 3.0e38, "neg": -3.0e38}


class ThreadedAllGather:
    """An in-process all-gather among ``world`` ranks running in threads."""

    def __init__(self, world: int, timeout: float = 60.0):
        self.world = world
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)

    def member(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def all_gather(local: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = local
            self.barrier.wait()
            gathered = torch.cat([s for s in self.slots], dim=0)  # type: ignore[misc]
            self.barrier.wait()
            return gathered
        return all_gather


def snapshot(micro_batch: TensorDict) -> dict[str, Any]:
    """A copy of what the caller holds in ``micro_batch``, per key: a nested tensor as its cloned
    :func:`nested_parts`, a dense tensor cloned, a flag by its value, a per-sample stack (``multi_modal_inputs``) as
    its samples' values, their tensors cloned (an engine that edits a sample's dict in place is seen). (Cheaper than
    ``TensorDict.clone``, which rebuilds every nested tensor, and as exact for the comparison: values and offsets.)"""
    held: dict[str, Any] = {}
    for key in micro_batch.keys():
        value = micro_batch.get(key)
        if isinstance(value, torch.Tensor):
            parts = nested_parts(value)
            held[key] = value.clone() if parts is value else (parts[0], parts[1].clone(), parts[2].clone())
        else:  # a flag by its value; a per-sample stack (multi_modal_inputs) as its samples' values, cloned
            held[key] = held_value(batch_entry(value))
    return held


def execution_context(case: EngineCase, device: str = "cpu") -> contextlib.AbstractContextManager:
    """The execution context a case's engine calls and model run in (``EngineCase.context``): ``grad`` (grad
    enabled, as a policy update runs; the model's outputs then require grad), ``no_grad`` (``torch.no_grad()``)
    or ``inference_mode`` (``torch.inference_mode()``), as the old-policy and reference log-prob passes run; or a
    caller's autocast, ``autocast_bf16`` (grad enabled inside ``torch.autocast(<device type>,
    dtype=torch.bfloat16)``: the engine's lower-precision ops compute in bfloat16; the stand-in model computes
    as without it, :func:`_call_model`)."""
    context = getattr(case, "context", "grad")
    if context == "no_grad":
        return torch.no_grad()
    if context == "inference_mode":
        return torch.inference_mode()
    if context == "grad":
        return torch.enable_grad()
    if context == "autocast_bf16":
        stack = contextlib.ExitStack()
        stack.enter_context(torch.enable_grad())
        stack.enter_context(torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
        return stack
    raise ValueError(f"unknown execution context {context!r}")


def _tracked(out: Any) -> Any:
    """The model's floating outputs made to require grad when grad is enabled (a policy update's logits are part
    of the autograd graph: an engine's in-place write on them, or a detach, behaves as it does in training). As a
    real model's, they are computed from the weights, not leaves: an in-place scaling of a view of them (verl
    0.7.1's ``logits.squeeze(0).div_``) is what autograd allows in training, not a leaf's error."""
    if torch.is_grad_enabled():
        for key, value in _fields(out).items():
            if value.is_floating_point():
                setattr(out, key, value.detach().requires_grad_(True).clone())
    return out


def model_for(case: EngineCase, device: str, engine: EngineUnderTest | None = None) -> ToyCausalLM:
    """The stand-in model of ``case``; for an engine of the fused-head protocol (``head_input`` hidden, LM head)
    it hands hidden states and the LM-head weight instead of logits (its logits, for the oracle, are their
    exact float32 product)."""
    hidden = engine is not None and case.head == "lm" and \
        getattr(engine, "head_input", HeadInput.LOGITS) == HeadInput.HIDDEN
    return ToyCausalLM(case.vocab, seed=case.seed, out_dim=1 if case.head == "value" else None, device=device,
                       head_input="hidden" if hidden else "logits")


@dataclass
class Run:
    case: EngineCase
    device: str
    micro_batch: TensorDict
    #: the micro-batch as it was handed to the engine (:func:`snapshot`)
    snapshot: dict[str, Any]
    model: ToyCausalLM
    inputs: list[dict[str, Any]] = field(default_factory=list)  # one per rank, as the engine returned them
    output_args: list[dict[str, Any]] = field(default_factory=list)
    #: what invariants read: each rank's hand-off through the engine's own :meth:`EngineUnderTest.view_inputs`
    views: list[InputsView] = field(default_factory=list)
    model_outputs: list[Any] = field(default_factory=list)  # what each rank was handed
    model_output_snapshots: list[dict[str, torch.Tensor]] = field(default_factory=list)
    output_args_snapshots: list[dict[str, Any]] = field(default_factory=list)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0's result
    rank_outputs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    #: each rank's routes recorded under router replay's R2 (``OutputsView.routes``: per sample), None where none
    rank_routes: list[list[torch.Tensor] | None] = field(default_factory=list)
    #: on real ranks, every SP group's run in the case's topology order (this one first; spec.cases.topology)
    groups: list["Run"] = field(default_factory=list)


def attach_views(run: Run, engine: EngineUnderTest) -> None:
    """Fill ``run.views`` from the hand-off as ``prepare_model_inputs`` returned it (before the output step
    could touch ``output_args``)."""
    run.views = [read_engine(lambda mi=mi, args=args: engine.view_inputs(mi, args),
                             "the engine's model inputs and output_args (view_inputs)", r)
                 for r, (mi, args) in enumerate(zip(run.inputs, run.output_args))]


def attach_outputs(run: Run, engine: EngineUnderTest, raw: list[Any]) -> None:
    """Fill ``run.rank_outputs`` (and ``run.outputs``, rank 0's) and ``run.rank_routes`` from each rank's
    ``prepare_model_outputs`` result ``raw`` (:func:`view_outputs`)."""
    views = [view_outputs(engine, outputs, r) for r, outputs in enumerate(raw)]
    run.rank_outputs = [view.per_sequence for view in views]
    run.rank_routes = [view.routes for view in views]
    run.outputs = run.rank_outputs[0]


def view_outputs(engine: EngineUnderTest, outputs: Any, rank: int) -> OutputsView:
    """One rank's outputs through the engine's own view, validated where the suite first touches them
    (:func:`.attribution.check_outputs`): a malformed one is noted for the running example
    (:func:`.attribution.note_fault`), so that an exception the suite raises reading it is the engine's failed check
    naming the key, the rank and the shape."""
    viewed = read_engine(lambda: engine.view_outputs(outputs), "the engine's outputs (view_outputs)", rank)
    try:
        check_outputs(viewed.per_sequence, rank)
    except EngineFault as fault:  # kept for the runner: a check that then crashes reading it failed the engine
        note_fault(fault)
    return viewed


def _settings(case: EngineCase, rank: int, gather: ThreadedAllGather | None) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if case.sp_size > 1:
        settings.update(sp_size=case.sp_size, sp_rank=rank, all_gather=gather.member(rank))
    if case.pad_to_length:
        settings["pad_to_length"] = case.pad_to_length
    if case.pass_cu_seqlens:
        settings["pass_cu_seqlens"] = True
    if case.entropy_chunk_size:
        settings["entropy_chunk_size"] = case.entropy_chunk_size
    settings.update(drawn_config(case))  # the engine's own switches (its config_space)
    return settings


def _poison_padded(tensor: torch.Tensor, case: EngineCase, value: float,
                   layout: PaddedLayout | str = PaddedLayout.RIGHT) -> torch.Tensor:
    """``value`` in every slot of a padded ``(B, L, ...)`` model output that the engine's declared layout marks as
    padding (the layout's meaning, not the mask the engine handed the model: a wrong mask must not move it)."""
    real = layout_mask(case.prompt_lens, case.response_lens, layout, width=tensor.shape[1]).to(tensor.device)
    pad = (real == 0)
    pad = pad.view(*pad.shape, *([1] * (tensor.dim() - 2)))
    return tensor.masked_fill(pad, value)


def _poison_tail(tensor: torch.Tensor, total: int, value: float) -> torch.Tensor:
    out = tensor.clone()
    out[:, total:] = value
    return out


def _fields(out: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in vars(out).items() if isinstance(v, torch.Tensor)}


def _per_token(out: Any) -> dict[str, torch.Tensor]:
    """The model output's per-token fields (poisoned and split across ranks); the LM-head weight is neither."""
    return {k: v for k, v in _fields(out).items() if k != HEAD_WEIGHT}


def _shared(out: Any) -> dict[str, torch.Tensor]:
    return {k: v for k, v in _fields(out).items() if k == HEAD_WEIGHT}


def check_model_inputs(model_inputs: dict[str, Any], rank: int = 0) -> None:
    """The model's input contract, as a model reads it: ``position_ids`` of the ids' shape, or ``(C, *ids)`` for C
    rope axes (mRoPE). An engine handing anything else fails here (an AssertionError: the verdict on its model
    inputs), not by an index error deep in the model."""
    ids, pos = model_inputs.get("input_ids"), model_inputs.get("position_ids")
    if not isinstance(ids, torch.Tensor) or not isinstance(pos, torch.Tensor):
        return
    shape, got = tuple(ids.shape), tuple(pos.shape)
    if got == shape or (len(got) == len(shape) + 1 and got[1:] == shape and 1 <= got[0] <= POSITION_AXES):
        return
    raise AssertionError(
        f"the engine's model inputs (rank {rank}): position_ids of shape {got} for input_ids of shape {shape}; a "
        f"model takes positions of the ids' shape or (C, {', '.join(map(str, shape))}) with C <= {POSITION_AXES} "
        "rope axes")


def check_media_inputs(model_inputs: dict[str, Any], case: EngineCase) -> None:
    """A media case's model inputs as a Qwen2-VL model reads them (it raises "Image features and image tokens do not
    match" otherwise): per kind, features of ``(patches, PATCH_DIM)`` whose rows are the patches the grids ``(k, 3)``
    name, merged into as many groups as the ids ``(R, n)`` (the whole row: every rank's joined) hold media tokens. An
    engine handing anything else fails here (an AssertionError naming the keys and shapes: the verdict on its model
    inputs)."""
    if not getattr(case, "media", ()):  # a reproducer's case of text-only samples may not name it
        return
    ids = model_inputs["input_ids"]
    for token_id, (kind, (features, grids)) in zip(media_token_ids(case.vocab), MEDIA_KEYS.items()):
        tokens = int((ids == token_id).sum())
        pixels, grid = model_inputs.get(features), model_inputs.get(grids)
        if pixels is None and grid is None and tokens == 0:
            continue
        shapes = (f"input_ids {tuple(ids.shape)} with {tokens} {kind} tokens, {features} "
                  f"{None if pixels is None else tuple(pixels.shape)}, {grids} {None if grid is None else tuple(grid.shape)}")
        if pixels is None or grid is None:
            raise AssertionError(f"the engine's model inputs: {kind} tokens without their features and grids ({shapes})")
        if pixels.dim() != 2 or pixels.shape[1] != PATCH_DIM or grid.dim() != 2 or grid.shape[1] != 3:
            raise AssertionError(f"the engine's model inputs: {features} must be (patches, {PATCH_DIM}) and {grids} "
                                 f"(k, 3) ({shapes})")
        patches = int(grid.to("cpu", torch.int64).prod(-1).sum())
        groups = int(media_tokens(grid.cpu()).sum())
        if patches != pixels.shape[0] or groups != tokens:
            raise AssertionError(f"the engine's model inputs: {kind} features and {kind} tokens do not match: the grids "
                                 f"name {patches} patches ({groups} tokens after merging) ({shapes})")
    if getattr(case, "has_audio", False):  # elsewhere the audio id is a text token like any other
        _check_audio_inputs(model_inputs, ids, audio_token_id(case.vocab))


def _check_audio_inputs(model_inputs: dict[str, Any], ids: torch.Tensor, token_id: int) -> None:
    """An audio model's inputs as Qwen2-Audio reads them (it raises where the audio tokens and the clips' frames do
    not match): ``input_features`` ``(clips, N_MELS, F)`` and ``feature_attention_mask`` ``(clips, F)``, whose clips
    take as many tokens (``frames // AUDIO_STRIDE`` each) as the ids hold audio tokens."""
    tokens = int((ids == token_id).sum())
    features, mask = (model_inputs.get(key) for key in AUDIO_KEYS)
    if features is None and mask is None and tokens == 0:
        return
    shapes = (f"input_ids {tuple(ids.shape)} with {tokens} audio tokens, {AUDIO_KEYS[0]} "
              f"{None if features is None else tuple(features.shape)}, {AUDIO_KEYS[1]} "
              f"{None if mask is None else tuple(mask.shape)}")
    if features is None or mask is None:
        raise AssertionError(f"the engine's model inputs: audio tokens without the clips' features and mask ({shapes})")
    if features.dim() != 3 or features.shape[1] != N_MELS or mask.shape != (features.shape[0], features.shape[2]):
        raise AssertionError(f"the engine's model inputs: {AUDIO_KEYS[0]} must be (clips, {N_MELS}, frames) and "
                             f"{AUDIO_KEYS[1]} (clips, frames) ({shapes})")
    taken = int((mask.to("cpu", torch.int64).sum(-1) // AUDIO_STRIDE).sum())
    if taken != tokens:
        raise AssertionError(f"the engine's model inputs: audio features and audio tokens do not match: the masks "
                             f"name {taken} tokens ({shapes})")


def _call_model(model: ToyCausalLM, inputs: list[dict[str, Any]], case: EngineCase,
                poison: float, layout: PaddedLayout | str = PaddedLayout.RIGHT) -> list[SimpleNamespace]:
    """Run the model once over the whole batch; hand each rank its slice with the padding poisoned (padded: by
    the engine's declared ``layout``)."""
    for rank, mi in enumerate(inputs):
        check_model_inputs(mi, rank)
    # the stand-in model's logits are the suite's truth: computed as without a caller's autocast (a model under
    # autocast hands lower-precision logits, which the logits dtype draws cover)
    plain = torch.autocast(inputs[0]["input_ids"].device.type, enabled=False)
    if not case.use_remove_padding:
        (mi,) = inputs
        check_media_inputs(mi, case)
        with plain:
            out = _tracked(model(**mi))
        return [SimpleNamespace(**{k: _poison_padded(v, case, poison, layout) for k, v in _per_token(out).items()},
                                **_shared(out))]
    joined = dict(inputs[0])
    for key in ("input_ids", "position_ids", "shift_labels"):
        if key in joined:
            joined[key] = torch.cat([mi[key] for mi in inputs], dim=-1)
    check_media_inputs(joined, case)
    with plain:
        out = _tracked(model(**joined))
    return rank_outputs(out, case, poison, [mi["input_ids"].shape[-1] for mi in inputs])


def rank_outputs(out: Any, case: EngineCase, poison: float, widths: list[int]) -> list[SimpleNamespace]:
    """The model's output over the whole packed row, tail poisoned, as each rank's own: rank ``r`` its
    ``widths[r]`` rows of every per-token field, a tensor of its own (each rank's model computes its own logits;
    one view of a multi-view split is what autograd refuses an in-place write on, which a real rank's allow)."""
    fields = {k: _poison_tail(v, case.total_nnz, poison) for k, v in _per_token(out).items()}
    per_rank = {k: [part.clone() for part in v.split(widths, dim=1)] for k, v in fields.items()}
    return [SimpleNamespace(**{k: parts[r] for k, parts in per_rank.items()}, **_shared(out))
            for r in range(len(widths))]


