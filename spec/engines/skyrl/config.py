"""SkyRL's configuration the ``skyrl-train`` (0.3.1) and ``skyrl`` (0.4.0) adapters draw
(``EngineUnderTest.config_space``), as its trainer and workers hand the batch builder
(``convert_prompts_responses_to_batch_tensors``) and ``HFModelWrapper.forward`` their inputs:

* ``rollout_logprobs`` (``generator.sampling_params.logprobs``, 1 by default): the generator returns each response
  token's sampling log-prob and the trainer hands them to the batch builder, which pads them for the off-policy
  corrections. Nothing the forward returns reads them: drawn, every check runs as without them (the padded
  rollout log-prob tensor is no output of the contract);
* ``num_actions_list``: ``forward``'s ``num_actions`` in the list form its signature takes (``Union[int,
  list[int]]``), one count, which ``forward`` unwraps to the int (a list of several counts becomes a NumPy array the
  slice ``log_probs[:, -num_actions - 1:-1]`` rejects: records.py declares that error path);
* ``reward_tensors`` (0.3.1): per-token rewards handed as tensors, which 0.3.1's builder takes as they are (a list
  it converts);
* ``max_seq_len`` (``trainer.algorithm.max_seq_len``, 0.4.0): a batch longer than it is logged, not truncated;
* ``sample_support_replay`` (``trainer.algorithm.enable_sample_support_replay`` with
  ``generator.inference_engine.enable_return_sample_support_set``, 0.4.0, text micro-batches: SkyRL's config refuses
  it with the vision-language generator): ``forward`` renormalises each response token's log-prob, and its entropy,
  over the sampler's recorded support (``sample_support_scores``: ``log p(t) = z_t - logsumexp_{v in S} z_v`` of
  the temperature-scaled logits ``z``). The support drawn is the whole vocabulary, what the sampler records when
  its ``top_k`` covers it (each row every id, the sampled token first): there the renormalisation is the identity
  and SkyRL's documented semantics give exactly the contract's full-vocabulary log-probs and entropy, which every
  check holds them to (computed in float32: :func:`precision`). A bounded ``top_k`` below the vocabulary is not
  drawn (the switch's ``unseen``): its log-probs are the policy's conditioned on the sampler's top-k, a quantity the
  contract does not define;
* ``routed_experts`` (0.4.0; ``generator.inference_engine.enable_return_routed_experts``, an MoE model's router
  replay, R3): the rollout's routed experts handed to the batch builder, one ``(captured, layers, top_k)`` array per
  trajectory in the wire's dtype (uint8, int16, int32; every other one read-only, as decoded from the wire), which
  collates them into one ``PackedTensor`` over every trajectory's tokens for the Megatron worker's replay
  (INV-ROUTE-001 reads it; the FSDP forward does not take them);
* ``images_concatenated`` (0.4.0's VLM): ``pixel_values`` and ``image_grid_thw`` handed as the concatenated tensors
  the Hugging Face model takes (what SkyRL's renderer, ``decode_mm_kwargs``, returns), not as per-sample
  ``TensorList`` s: ``forward`` hands them on as they are.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np
import torch

from ...protocol.engine import ConfigSwitch, Precision
from ...protocol.known import When
from ...protocol.profile import ROUTES_SWITCH, drawn_config
from ...truth.routes import ROUTE_DTYPES, captured_rows, routes_of

__all__ = ["TRAIN_SWITCHES", "SWITCHES", "SUPPORT_REPLAY", "batch_builder", "num_actions", "replay_kwargs",
           "precision", "full_support", "rollout_routes", "collated_routes"]

_COMMON = (
    ConfigSwitch("rollout_logprobs", (False, True), "generator.sampling_params.logprobs=1: the rollout's per-token "
                 "log-probs handed to the batch builder, padded for the off-policy corrections"),
    ConfigSwitch("num_actions_list", (False, True), "forward(num_actions=[n]): the list form of its signature, one "
                 "count"),
)
TRAIN_SWITCHES: tuple[ConfigSwitch, ...] = (
    *_COMMON,
    ConfigSwitch("reward_tensors", (False, True), "per-token rewards handed to the batch builder as tensors"),
)
SWITCHES: tuple[ConfigSwitch, ...] = (
    *_COMMON,
    ConfigSwitch("max_seq_len", (None, 8), "trainer.algorithm.max_seq_len: a longer batch is logged, not truncated"),
    ConfigSwitch("sample_support_replay", (False, True), "trainer.algorithm.enable_sample_support_replay: log-probs "
                 "and entropy renormalised over the sampler's recorded support, the whole vocabulary (top_k >= V)",
                 unseen={"top_k < V": "log-probs conditioned on the sampler's top-k support: a quantity the contract "
                                      "does not define (its log-probs are the full vocabulary's)"}),
    ConfigSwitch("images_concatenated", (False, True), "a VLM's pixel_values and image_grid_thw handed concatenated "
                 "(the renderer's tensors), not as per-sample TensorLists"),
    ConfigSwitch(ROUTES_SWITCH, (None, *ROUTE_DTYPES), "an MoE rollout's routed experts (router replay, R3) handed to "
                 "the batch builder per trajectory in the wire's dtype, which collates them into one PackedTensor "
                 "for the Megatron worker's replay; a wire-decoded (read-only) array for every other trajectory"),
)

#: the cases whose log-probs and entropy forward takes over the recorded support (a text micro-batch, switch on)
SUPPORT_REPLAY = When("sample_support_replay on (a text micro-batch)", lambda case: (
    not getattr(case, "mrope", False) and bool(drawn_config(case).get("sample_support_replay"))))


def batch_builder(collate: Callable[..., tuple], pad: Any, prompts: list[list[int]], responses: list[list[int]],
                  config: dict, new: bool, routes: list[np.ndarray] | None = None) -> Callable[..., tuple]:
    """SkyRL's batch builder ``collate`` bound to the samples (``pad``: 0.4.0's pad id, 0.3.1's tokenizer) as the
    trainer calls it: zero rewards (0.3.1's as tensors where ``reward_tensors``), every response token loss-active,
    the rollout's log-probs where ``rollout_logprobs`` (any per-token values: the forward never reads them), 0.4.0's
    ``max_seq_len`` and the rollout's routed experts (``routes``); the returned callable takes the rest
    (``rollout_sample_support``)."""
    tensors = not new and config.get("reward_tensors")
    kwargs: dict[str, Any] = {
        "rewards": [torch.zeros(len(r)) if tensors else [0.0] * len(r) for r in responses],
        "loss_masks": [[1] * len(r) for r in responses],
        "logprobs": [[-1.0] * len(r) for r in responses] if config.get("rollout_logprobs") else None}
    if new:
        kwargs["max_seq_len"] = config.get("max_seq_len")
    if routes is not None:
        kwargs["rollout_expert_indices"] = routes
    return partial(collate, pad, prompts, responses, **kwargs)


def rollout_routes(mb: Any) -> list[np.ndarray] | None:
    """The micro-batch's routed experts (``routed_experts``, drawn where the ``routed_experts`` switch is on) as the
    rollout hands SkyRL's batch builder them: one ``(captured, layers, top_k)`` array per trajectory, every other one
    read-only (decoded from the wire, ``generate_wire``), or None."""
    routes = routes_of(mb)
    if routes is None:
        return None
    arrays = [captured_rows(t).cpu().numpy().copy() for t in routes]
    for array in arrays[1::2]:
        array.flags.writeable = False
    return arrays


def collated_routes(batch: Callable[..., tuple]) -> list[torch.Tensor] | None:
    """The routes SkyRL's batch builder (``batch``, :func:`batch_builder`'s) collated, a ``PackedTensor`` (values over
    every trajectory's tokens, ``cu_seqlens``), per trajectory; None where it was handed none."""
    if "rollout_expert_indices" not in batch.keywords:
        return None
    packed = batch()[6]
    return list(packed.values.split(torch.diff(torch.as_tensor(packed.cu_seqlens)).tolist()))


def num_actions(config: dict, count: int) -> int | list[int]:
    """``forward``'s ``num_actions``: the count, or a list of it (``num_actions_list``)."""
    return [count] if config.get("num_actions_list") else count


def full_support(responses: list[list[int]], vocab: int) -> list[np.ndarray]:
    """Each response's recorded support, ``(r_i, vocab)`` int32: every vocabulary id per token, the sampled first."""
    ids = np.arange(vocab, dtype=np.int64)
    return [((np.asarray(r, dtype=np.int64)[:, None] + ids) % vocab).astype(np.int32) for r in responses]


def replay_kwargs(batch: Callable[..., tuple], responses: list[list[int]], config: dict, vlm: bool,
                  vocab: int | None) -> dict[str, Any]:
    """``forward``'s sample-support keywords (none unless ``sample_support_replay`` on a text micro-batch): the
    support and loss mask the batch builder (``batch(rollout_sample_support=...)``) collates from
    :func:`full_support` over ``vocab`` ids (the logits' width; None, before the model runs: the responses' ids, a
    support only its shape matters for, as nothing is scored yet)."""
    if not config.get("sample_support_replay") or vlm:
        return {}
    vocab = vocab or 1 + max((max(r) for r in responses if r), default=0)
    out = batch(rollout_sample_support=full_support(responses, vocab))
    return {"sample_support": out[7], "loss_mask": out[4], "enable_sample_support_replay": True}


def precision(key: str, case: Any) -> Precision:
    """SkyRL's precision: log-probs and entropy in the logits' dtype (F22), or with sample-support replay float32
    from the logits scaled in their own dtype (``sample_support_scores`` computes bf16/fp16 logits in float32 after
    ``forward``'s in-place ``div_``)."""
    return Precision("float32" if SUPPORT_REPLAY(case) else case.logits_dtype, case.logits_dtype)
