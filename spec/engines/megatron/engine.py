"""verl 0.9.1's Megatron engine object: ``MegatronEngineWithLMHead.forward_step`` as a whole, on one rank (TP = CP = 1).

Megatron's ``prepare_model_inputs`` / ``prepare_model_outputs`` are pass-throughs: its preparation runs inside
``forward_step`` around the model call (transformer_impl.py): ``prepare_model_inputs`` (the loss mask, the media),
the labels (the ids cloned), the temperature expanded per token (``verl_F.expand_as_nested``), then
``gptmodel_forward_model_engine`` (model_forward.py): ``preprocess_thd_engine`` packs the ids (BSHD:
``preprocess_bshd_engine`` pads them, with a mask and positions), the model runs, and its logits go through
``_lm_head_logits_processor`` with the labels and temperatures packed the same way (the labels rolled,
``need_roll=True``): the logits divided by the temperature in place, ``vocab_parallel_entropy`` (chunked:
``vocab_parallel_entropy_with_chunking``), ``vocab_parallel_sum_pi_squared``, the top-K processor, and
``vocab_parallel_log_probs_from_logits`` (megatron-core's ``vocab_parallel_cross_entropy``); each output is
re-assembled per sample by ``postprocess_thd_engine`` / ``postprocess_bshd_engine``.

The model runs between the suite's two steps, so ``forward_step`` runs twice (the kit, :mod:`spec.engines.kit`):
once with a model that records what it is handed and stops (the input step), once with a model that returns the
harness's logits (the output step). Megatron's THD model is handed no positions: it applies its rotary embedding to
each sequence of ``packed_seq_params`` from 0 (``cu_seqlens_q_padded``), so the view hands the stand-in model those.

The seams, each what a real run's setup fills: the engine object's configuration (:func:`engine_namespace`: what
``forward_step`` reads; MTP and R3 router replay drawn, R3 on THD micro-batches: spec/engines/megatron/routing.py;
no fused kernels or dynamic CP), megatron's parallel state for one rank (the packer's fake; the vocab-parallel
kernels' tensor-parallel group of one rank, whose all-reduces are then the identity) and ``get_device_id`` (the
CPU). ``torch.compile`` is off inside (``_VocabParallelEntropy``'s compiled
``(a * b).sum(-1)`` runs eagerly: the same function, without a compile per new shape).
"""

from __future__ import annotations

import importlib
from contextlib import ExitStack, nullcontext
from functools import lru_cache, partial
from types import SimpleNamespace
from typing import Any, Callable
from unittest import mock

import torch

from ...protocol.engine import CONTRACT_PRECISION, InputsView, Precision, ShardLayout, media_view, read_flags
from ...protocol.profile import ROUTES_SWITCH, ConfigSwitch, drawn_config
from ...truth.routes import ROUTE_DTYPES
from ...truth.oracle import LOG_PROB_MIN_CLAMP
from ...cases.structure import DISTILLATION_KEYS
from ...truth.megatron_packing import PackSpec
from ..kit import calls_seen_by_model
from ..kit.stubs import import_verl_module

__all__ = ["MegatronEngineObject", "MegatronModel", "ONE_RANK", "one_rank", "engine_modules", "packed_rows", "zero_logits",
           "no_terms", "no_loss", "engine_namespace", "megatron_view", "megatron_precision",
           "megatron_processor", "ENGINE_SURFACE", "ENGINE_UNREACHABLE", "MEGATRON_REFUSES", "MEGATRON_CONFIG_SPACE"]

IMPL = "verl.workers.engine.megatron.transformer_impl"
_TP = "verl.utils.megatron.tensor_parallel"
_FORWARD = "verl.models.mcore.model_forward"
_KL = "verl.trainer.distillation.megatron.losses"
#: what the engine object runs of verl beyond the packing: the step around the model call and its log-prob kernels
ENGINE_SURFACE = (f"{IMPL}:MegatronEngineWithLMHead.forward_step", f"{IMPL}:MegatronEngineWithLMHead._lm_head_logits_processor",
                  f"{IMPL}:MegatronEngineWithLMHead.prepare_model_outputs", f"{IMPL}:MegatronEngineWithValueHead.forward_step",
                  f"{IMPL}:MegatronEngineWithValueHead.prepare_model_outputs", f"{_FORWARD}:gptmodel_forward_model_engine",
                  f"{_TP}:_VocabParallelEntropy.forward", f"{_TP}:_VocabParallelEntropy.backward",
                  f"{_TP}:vocab_parallel_entropy_with_chunking", f"{_TP}:vocab_parallel_sum_pi_squared",
                  f"{_TP}:vocab_parallel_log_probs_from_logits", f"{_KL}:compute_forward_kl_topk",
                  f"{_KL}:vocab_parallel_log_softmax", f"{_KL}:_VocabParallelKLDivergence.forward",
                  f"{_KL}:_VocabParallelKLDivergence.backward", f"{IMPL}:MegatronEngine._get_context_parallel_layout",
                  f"{_FORWARD}:_build_mtp_loss_mask_nested", f"{_FORWARD}:_convert_to_nested_tensor",
                  "verl.utils.torch_functional:expand_as_nested")
_MTP_NORMALIZATION = ("gap: the MTP loss normalization factor forward_step hands on (routed_num_tokens / "
                      "batch_num_tokens, with tf_config.calculate_per_token_loss) reads counts forward_backward_batch "
                      "assigns for the whole mini-batch (its all-reduced loss-mask and routed-token counts), which the "
                      "engine object (one micro-batch's forward_step) does not run; INV-MEG-008 checks that "
                      "gptmodel_forward_model_engine hands a factor on to the MTP loss")
_MTP_LABELS_NESTED = ("dead code in verl 0.9.1: forward_step's MTP label is the micro-batch's nested ids cloned "
                      "(transformer_impl.py:1326, the only pad_mode it packs), so _convert_to_nested_tensor returns it "
                      "at once")
_FUSED = ("needs a real kernel: fused kernels (get_mcore_forward_fused_model_engine_fn) patch megatron's GPTModel "
          "output layer with verl's fused linear cross-entropy")
_DENSE_MASK = ("gap: a dense (B, R) loss_mask beside a dense attention_mask, as verl's trainer path hands them after "
               "left_right_2_no_padding (the response_mask as loss_mask; the MTP padded alignment's "
               "response_attention_mask); the engine object's micro-batches are no_padding's, with a nested loss_mask "
               "(INV-MEG-008 hands gptmodel_forward_model_engine a padded loss mask with its response_attention_mask)")
_FWD, _TI = _FORWARD, IMPL
#: branches of :data:`ENGINE_SURFACE` (and the packing's) the engine object never takes, each with its reason
ENGINE_UNREACHABLE: dict[str, str] = {
    **{f"{_FWD}:{line}": _MTP_LABELS_NESTED for line in ("191->194", "200", "203", "205")},
    f"{_TI}:1334->1335": _FUSED, f"{_TI}:1337->1338": _FUSED,
    f"{_TI}:1378->1379": _DENSE_MASK,
    **{f"{_TI}:{line}": _MTP_NORMALIZATION for line in ("1388->1393", "1395")},
    f"{_TI}:174->175": "needs another model family's configuration: DeepSeek-V4's hybrid attention "
                       "(experimental_attention_variant 'dsv4_hybrid') packs CP contiguous",
}
#: the engine object's MTP switch (:data:`MEGATRON_CONFIG_SPACE`)
MTP_SWITCH = "mtp_enable_train"
#: one rank: tensor-parallel world of one (its all-reduces are the identity)
ONE_RANK = PackSpec(1, 1, ShardLayout.ZIGZAG)


def engine_namespace(impl: Any, micro_batch: Any, *, packed: bool, chunk: int | None = None, bucket: int | None = None,
                     vision: bool = False, mtp: bool = False, replay: str | None = None,
                     dynamic: bool = False) -> SimpleNamespace:
    """What ``forward_step`` reads of its engine object (the module docstring): a Qwen2 config, or with ``vision`` a
    Qwen2.5-VL one with a ``vision_config``; the tokenizer's pad id the micro-batch's; ``mtp``: a model with MTP
    layers trained (``model_config.mtp``), the loss not per token (``tf_config.calculate_per_token_loss`` off); ``replay``:
    router replay's mode (``router_replay.mode``, R2 or R3; the routers' model and ``tf_config`` are the caller's);
    ``dynamic``: dynamic context parallelism (the micro-batch carries its CP size and router padding mask)."""
    cls = impl.MegatronEngineWithLMHead
    hf_config = SimpleNamespace(architectures=["Qwen2_5_VLForConditionalGeneration" if vision else "Qwen2ForCausalLM"])
    if vision:
        hf_config.vision_config = {}
    engine = SimpleNamespace(
        engine_config=SimpleNamespace(use_fused_kernels=False, pad_to_length=bucket is not None,
                                      pad_to_length_bucket=None if bucket is None else int(bucket),
                                      use_remove_padding=packed, dynamic_context_parallel=dynamic,
                                      router_replay=SimpleNamespace(mode=replay or "disabled"),
                                      entropy_from_logits_with_chunking=chunk is not None,
                                      entropy_from_logits_chunk_size=2048 if chunk is None else int(chunk)),
        enable_routing_replay=replay is not None, _get_context_parallel_layout=cls._get_context_parallel_layout,
        model_config=SimpleNamespace(hf_config=hf_config,
                                     tokenizer=SimpleNamespace(pad_token_id=read_flags(micro_batch)["pad_token_id"]),
                                     mtp=SimpleNamespace(enable=mtp, enable_train=mtp)),
        tf_config=SimpleNamespace(calculate_per_token_loss=False))
    engine.prepare_model_inputs = partial(cls.prepare_model_inputs, engine)  # (the value head's inherits it)
    engine._lm_head_logits_processor = partial(cls._lm_head_logits_processor, engine)
    return engine


class MegatronModel:
    """The model ``gptmodel_forward_model_engine`` is handed: what ``unwrap_model`` reads, and the call."""

    def __init__(self, call: Callable[..., Any], spec: PackSpec):
        self.call, self.pre_process, self.post_process = call, True, True
        self.config = SimpleNamespace(fp8="e4m3" if spec.fp8 else None)

    def __call__(self, **kwargs: Any) -> Any:
        return self.call(**kwargs)


def _all_reduce(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False) -> None:
    """An all-reduce over a tensor-parallel group of one rank: the tensor as it is."""
    if group != "tp-group(1)":
        raise AssertionError(f"an all-reduce over {group!r}: only the tensor-parallel group of one rank is simulated")


def engine_modules() -> tuple[Any, Any, Any, Any]:
    """verl's Megatron engine and vocab-parallel kernels (imported with their stubs), megatron-core's cross entropy
    and parallel state."""
    return (import_verl_module("verl-megatron", IMPL, ("megatron",))[1].module,
            import_verl_module("verl-megatron", _TP, ("megatron",))[1].module,
            importlib.import_module("megatron.core.tensor_parallel.cross_entropy"),
            importlib.import_module("megatron.core.parallel_state"))


def _all_gather(output_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False) -> None:
    """An all-gather over a tensor-parallel group of one rank: the tensor itself."""
    if group != "tp-group(1)" or len(output_list) != 1:
        raise AssertionError(f"an all-gather over {group!r} into {len(output_list)} tensors: only the tensor-parallel "
                             "group of one rank is simulated")
    output_list[0].copy_(tensor)


def one_rank(rank_context: Callable[..., Any], modules: tuple[Any, Any, Any, Any]) -> ExitStack:
    """The seams of ``forward_step`` run to its end on one rank (TP = CP = 1; ``rank_context``: the packer's fake
    parallel state; ``modules``: :func:`engine_modules`): the CPU for the device, the vocab-parallel kernels'
    tensor-parallel group of one rank (whose all-reduces and all-gathers are then the identity), ``torch.compile``
    off."""
    impl, tp, cross_entropy, parallel_state = modules
    tp_state = dict(get_tensor_model_parallel_group=lambda *a, **k: "tp-group(1)",
                    get_tensor_model_parallel_rank=lambda *a, **k: 0,
                    get_tensor_model_parallel_world_size=lambda *a, **k: 1)
    stack = ExitStack()
    stack.enter_context(rank_context(PackSpec(1, 1, ShardLayout.ZIGZAG), 0))
    stack.enter_context(mock.patch.object(impl, "get_device_id", lambda: "cpu"))
    stack.enter_context(mock.patch.object(tp, "mpu", SimpleNamespace(**tp_state)))
    stack.enter_context(mock.patch.multiple(cross_entropy, **tp_state))  # imported by name there
    stack.enter_context(mock.patch.multiple(parallel_state, **tp_state))  # verl's top-K KL imports them late
    stack.enter_context(mock.patch.object(torch.distributed, "all_reduce", _all_reduce))
    stack.enter_context(mock.patch.object(torch.distributed, "all_gather", _all_gather))
    # _VocabParallelEntropy.forward's torch.compile(dynamic=True) mul_reduce ((a * b).sum(-1)) runs eagerly: the same
    # function, without inductor's compile of seconds per new shape and dtype on CPU
    stack.enter_context(mock.patch.object(torch._dynamo.config, "disable", True))
    return stack


#: :func:`engine_modules`, imported once for every engine object
_cached_modules = lru_cache(maxsize=None)(engine_modules)


class MegatronEngineObject:
    """``MegatronEngineWithLMHead.forward_step`` on one rank (the module docstring); ``rank_context`` is the packer's
    fake parallel state (:meth:`spec.engines.megatron.adapter.VerlMegatronPacker._rank`)."""

    def __init__(self, rank_context: Callable[..., Any], *, head: str = "lm", chunk: int | None = None,
                 bucket: int | None = None, mtp: bool = False, replay: Any = None):
        self.impl, self.tp, self.cross_entropy, self.parallel_state = _cached_modules()
        self.rank_context, self.chunk, self.bucket, self.mtp = rank_context, chunk, bucket, mtp
        #: R3 router replay (spec/engines/megatron/routing.py ``EngineReplay``): None where the switch is off
        self.replay = replay
        #: the LM head's engine, or the value head's (MegatronEngineWithValueHead: forward_fn(value_model=True), the
        #: model's (.., 1) output squeezed, no logits processor)
        self.cls = self.impl.MegatronEngineWithValueHead if head == "value" else self.impl.MegatronEngineWithLMHead

    def _one_rank(self) -> ExitStack:
        return one_rank(self.rank_context, (self.impl, self.tp, self.cross_entropy, self.parallel_state))

    def _step(self, micro_batch: Any, call: Callable[..., Any], logits_processor_func: Callable | None = None,
              labels: list | None = None):
        flags = read_flags(micro_batch)
        engine = engine_namespace(self.impl, micro_batch, packed=bool(flags["use_remove_padding"]), chunk=self.chunk,
                                  bucket=self.bucket, vision=_vision(micro_batch), mtp=self.mtp)
        if labels is not None:  # record the labels the logits processor scores
            processor = engine._lm_head_logits_processor
            engine._lm_head_logits_processor = lambda logits, label, *a, **k: (labels.append(label),
                                                                                processor(logits, label, *a, **k))[1]
        replay = self._replay_for(micro_batch)
        with self._one_rank(), (replay.active() if replay is not None else nullcontext()):
            model = replay.armed(engine, call, ONE_RANK) if replay is not None else MegatronModel(call, ONE_RANK)
            output, _ = self.cls.forward_step(engine, iter([micro_batch]), model, logits_processor_func, no_loss)
        return output

    def _replay_for(self, micro_batch: Any) -> Any:
        """The R3 replay this micro-batch runs: the switch's, on THD micro-batches (BSHD only for F28's reproduction,
        ``EngineReplay.bshd``); None where it runs none."""
        if self.replay is None or not (read_flags(micro_batch)["use_remove_padding"] or self.replay.bshd):
            return None
        return self.replay

    def prepare_model_inputs(self, micro_batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The model's inputs as ``forward_step`` hands them (THD: the positions the model takes from its boundaries;
        a VL model's: the sample's own, which it computes from the ids and grids), and as ``output_args`` the
        boundaries, the rows' mask and the labels the logits processor scores: one run of ``forward_step`` to its
        end with a model that records what it is handed and returns zero logits (the output step packs the labels
        itself, the same way)."""
        labels: list[torch.Tensor] = []
        lm = self.cls is self.impl.MegatronEngineWithLMHead
        handed = calls_seen_by_model(lambda model: self._step(micro_batch, model, no_terms, labels if lm else None),
                                     zero_logits)[0]
        params = handed.pop("packed_seq_params", None)
        rows = handed.get("attention_mask")
        if _vision(micro_batch):
            handed["position_ids"] = _own_rows(micro_batch, rows.shape[1])
        elif params is not None:
            handed["cu_seqlens"] = params.cu_seqlens_q_padded.to(torch.int64)
            handed["position_ids"] = _restarting(handed["cu_seqlens"]).unsqueeze(0)
        replay = self._replay_for(micro_batch)
        routes = None if replay is None else replay.per_sample(handed, params,
                                                               micro_batch["input_ids"].offsets().diff().tolist())
        return handed, {"params": params, "rows": rows if params is not None else None,
                        "labels": labels[0] if labels else None, "routes": routes,
                        "total": int(micro_batch["input_ids"].offsets()[-1])}

    def prepare_model_outputs(self, output: Any, output_args: dict[str, Any], micro_batch: Any,
                              logits_processor_func: Callable | None = None) -> dict[str, torch.Tensor]:
        logits = output.logits
        if output_args.get("rows") is not None:  # a VL model packs its rows' outputs with the handed boundaries
            logits = packed_rows(logits, output_args["rows"], output_args["params"].cu_seqlens_q_padded.to(torch.int64))
        return self.cls.prepare_model_outputs(None, self._step(micro_batch, lambda **_: logits, logits_processor_func),
                                              micro_batch)


def _vision(micro_batch: Any) -> bool:
    """A vision-language micro-batch: media, or mRoPE positions ``(B, 4, j)``; verl's config is then a VL model's
    (``vision_config``: ``gptmodel_forward_model_engine`` hands it rows and a mask)."""
    return "multi_modal_inputs" in micro_batch.keys() or micro_batch["position_ids"].dim() == 3


def _own_rows(micro_batch: Any, width: int) -> torch.Tensor:
    """Each sample's own positions right-padded to ``width`` columns: ``(B, width)``, mRoPE ``(4, B, width)``."""
    samples = micro_batch["position_ids"].unbind()
    rows = samples[0].new_zeros((*samples[0].shape[:-1], len(samples), width))
    for i, positions in enumerate(samples):  # B rows, once per micro-batch (the model's own computation)
        rows[..., i, :positions.shape[-1]] = positions
    return rows


def packed_rows(logits: torch.Tensor, rows: torch.Tensor, bounds: torch.Tensor) -> torch.Tensor:
    """Row logits ``(B, L, V)`` packed as THD ``(1, bounds[-1], V)``: row i's real tokens from ``bounds[i]``."""
    index = (bounds[:-1].unsqueeze(1) + torch.arange(rows.shape[1]).unsqueeze(0))[rows]
    packed = logits.new_zeros((1, int(bounds[-1]), logits.shape[-1]))
    packed[0, index] = logits[rows]
    return packed


def zero_logits(handed: dict[str, Any]) -> torch.Tensor:
    """The recording run's model output: zero logits over a vocabulary of one, THD ``(1, T, 1)`` (a VL model's rows
    packed at its boundaries), BSHD ``(B, L, 1)``: enough for ``forward_step`` to reach its logits processor."""
    params = handed.get("packed_seq_params")
    ids = handed["input_ids"]
    return torch.zeros((1, int(params.cu_seqlens_q_padded[-1]), 1) if params is not None else (*ids.shape, 1))


def no_terms(**kwargs: Any) -> dict[str, torch.Tensor]:
    """The recording run's top-K processor: no terms (the run records the model's inputs and the labels only)."""
    return {}


def no_loss(*args: Any, **kwargs: Any) -> None:
    """``forward_step``'s ``postprocess_micro_batch_func``: bound, never called here (the step's loss is the step
    layer's)."""


def _restarting(bounds: torch.Tensor) -> torch.Tensor:
    """``arange`` restarting at each boundary of ``bounds`` (``(B + 1,)``): each packed sequence's positions."""
    lengths = bounds.diff()
    starts = torch.repeat_interleave(bounds[:-1], lengths)
    return torch.arange(int(bounds[-1]), dtype=torch.int64) - starts


def megatron_view(model_inputs: dict[str, Any], output_args: dict[str, Any]) -> InputsView:
    """What one rank hands the model, normalized: THD as the packed row the model attends (the ids, the rotary
    positions, ``cu_seqlens_q`` with a final boundary where padding follows the last sequence's real tokens in
    ``cu_seqlens_q_padded``; the row's tokens beyond the micro-batch's as ``pad_size``); a VL model's rows and mask in THD as the packed row it builds from them with the handed
    boundaries; BSHD as handed. ``labels``: the ids the logits processor scores, at the real tokens."""
    params, ids, positions = output_args["params"], model_inputs["input_ids"], model_inputs.get("position_ids")
    labels, mask = output_args["labels"], model_inputs.get("attention_mask")
    if params is None:  # BSHD
        if labels is not None:
            labels = labels[mask.bool()] if mask is not None else labels.reshape(-1)
        return InputsView(ids, positions, mask, labels=labels, media=media_view(model_inputs),
                          routes=output_args.get("routes"))
    real, padded = params.cu_seqlens_q.to(torch.int64), params.cu_seqlens_q_padded.to(torch.int64)
    if not torch.equal(real[:-1], padded[:-1]):
        raise ValueError(f"packed_seq_params: cu_seqlens_q {real.tolist()} and cu_seqlens_q_padded "
                         f"{padded.tolist()} differ before the last boundary (per-sequence padding: TP or CP > 1)")
    if mask is not None:  # a VL model's rows, packed as it packs them
        ids = packed_rows(ids.unsqueeze(-1), mask, padded).squeeze(-1)
        if positions.dim() == 3:  # mRoPE (4, B, L) -> (4, 1, T)
            positions = packed_rows(positions.permute(1, 2, 0), mask, padded).permute(2, 0, 1)
        else:
            positions = packed_rows(positions.unsqueeze(-1), mask, padded).squeeze(-1)
    bounds = torch.cat([real, padded[-1:]]) if padded[-1] > real[-1] else real
    return InputsView(ids, positions, None, cu_seqlens=bounds, labels=None if labels is None else labels.reshape(-1),
                      pad_size=ids.shape[-1] - output_args["total"],
                      media=media_view(model_inputs), routes=output_args.get("routes"))


def megatron_precision(key: str, case: Any) -> Precision:
    """``_lm_head_logits_processor`` divides the logits by the temperature in their own dtype (``logits.div_(
    temperature.to(logits.dtype))``); megatron-core's ``vocab_parallel_cross_entropy`` upcasts them to float32
    (log_probs: float32 from the scaled logits); ``vocab_parallel_entropy`` and ``vocab_parallel_sum_pi_squared``
    compute in the logits' dtype, the chunked entropy writes each chunk's into a float32 buffer; the top-K
    processor's terms are the suite's float32, from the scaled logits."""
    low = getattr(case, "logits_dtype", "float32")
    if low == "float32":
        return CONTRACT_PRECISION
    if key == "log_probs" or key in DISTILLATION_KEYS or (key == "entropy" and case.entropy_chunk_size):
        return Precision("float32", low)
    return Precision(low, low)


#: what ``forward_step`` refuses (``spec.invariants.settings.REFUSALS``), each with how
MEGATRON_REFUSES: dict[str, str] = {
    "pad_mode": "forward_step packs no_padding micro-batches only (NotImplementedError for another pad_mode)",
    "sum_pi_squared_fused": "a per-batch use_fused_kernels other than the engine's setting (RuntimeError), and "
                            "sum_pi_squared with fused kernels (NotImplementedError)",
    "bucket_distillation": "pad_to_length is not supported with top-K distillation (RuntimeError)",
    "bucket_replay": "pad_to_length is not supported with router replay (RuntimeError)",
}

#: the engine configuration ``forward_step`` reads that the engine object draws (McoreEngineConfig's), and the top-K
#: KL's clamp (verl's own processor, megatron strategy)
MEGATRON_CONFIG_SPACE: tuple[ConfigSwitch, ...] = (
    ConfigSwitch("entropy_from_logits_with_chunking", setting="entropy_chunk_size", needs=("chunking",),
                 text="engine_config.entropy_from_logits_with_chunking: the entropy by "
                      "vocab_parallel_entropy_with_chunking (float32 buffer, chunks of the sequence axis), both formats"),
    ConfigSwitch("entropy_from_logits_chunk_size", setting="entropy_chunk_size", needs=("chunking",),
                 text="engine_config.entropy_from_logits_chunk_size: the chunk's tokens"),
    ConfigSwitch("pad_to_length_bucket", setting="pad_to_length", needs=("bucket",),
                 text="engine_config.pad_to_length / pad_to_length_bucket (with use_remove_padding): "
                      "preprocess_thd_engine pads the packed total to the bucket, on the last sequence"),
    ConfigSwitch(MTP_SWITCH, (False, True),
                 text="model_config.mtp.enable / enable_train: a model with multi-token prediction layers, trained "
                      "(gptmodel_forward_model_engine hands it labels, a loss mask and positions besides the ids: "
                      "INV-MEG-008 checks them; the main outputs must not change)"),
    ConfigSwitch(ROUTES_SWITCH, (None, *ROUTE_DTYPES),
                 text="engine_config.router_replay.mode R3: the micro-batch's routed_experts (the rollout's, in this "
                      "dtype) replayed by the MoE model's routers (set_router_replay_data; the routers' own route "
                      "where build_r3_replay_mask says not), on THD micro-batches (BSHD: finding F28, the profile's routes_note; "
                      "spec/engines/megatron/routing.py)"),
    ConfigSwitch(LOG_PROB_MIN_CLAMP, (None, -10.0, -1.0), needs=("distillation",),
                 text="distillation.distillation_loss.log_prob_min_clamp: megatron's _VocabParallelKLDivergence "
                      "clamps both top-K log-probs below (the oracle computes it: spec.truth.oracle.topk_terms)"),
)


def megatron_processor(case: Any) -> Callable:
    """What a real verl 0.9 Megatron run hands ``forward_step`` as ``logits_processor_func``: ``partial(
    distillation_ppo_loss, config=<actor config, strategy megatron>, distillation_config=...)``, whose top-K forward
    KL is ``verl.trainer.distillation.megatron.losses.compute_forward_kl_topk`` (vocab-parallel, one rank here)."""
    losses = importlib.import_module("verl.trainer.distillation.losses")
    config = importlib.import_module("verl.workers.config")
    loss = config.DistillationLossConfig(loss_mode="forward_kl_topk", topk=int(case.topk), use_policy_gradient=False,
                                         log_prob_min_clamp=drawn_config(case).get(LOG_PROB_MIN_CLAMP))
    return partial(losses.distillation_ppo_loss, config=SimpleNamespace(strategy="megatron"),
                   distillation_config=config.DistillationConfig(enabled=False, distillation_loss=loss))
