"""The training step's loss: from a micro-batch's per-token loss to the scalar it backpropagates.

``agg_loss`` has verl's name, signature and modes (``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
``seq-mean-token-mean``, ``seq-mean-token-sum-norm``) and keeps verl's promise that the loss accumulated over every
micro-batch and rank is the whole mini-batch's whatever the cut: each mode divides by facts of the whole mini-batch
(its valid tokens, its samples) and multiplies by the DP size (DDP/FSDP average the ranks' gradients). One
difference: ``seq-mean-token-sum-norm`` without a ``loss_scale_factor`` divides by the mini-batch's longest response
(``response_width``, a global fact) where verl divides by the micro-batch's padded width (``loss_mask.shape[-1]``),
which changes with the cut (docs/findings/F24-seq-mean-token-sum-norm-width.md).

The global facts (``batch_num_tokens``, ``global_batch_size``, ``response_width``, ``dp_size``) come from
:func:`local_facts` gathered over the data-parallel ranks (:func:`global_facts`; the gather is a seam, e.g.
:func:`group_gather`: ``torch.distributed.all_gather`` on the DP group). Masked positions never reach the loss, whatever they hold (a
``where``, not a product: a NaN at a padded or masked position stays out). Vectorised; nothing is mutated.

:func:`forward_backward_batch` is one rank's whole step, verl's ``FSDPEngine.forward_backward_batch`` for impl's
engines: the global facts gathered over the DP group it is handed (never another group), assigned to the mini-batch;
the cut (``prepare_micro_batches`` with the group: every rank the same micro-batch count); each micro-batch through the
engine and the model, its loss backpropagated; the outputs restored (``postprocess_batch_func``).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from tensordict import TensorDict

from .errors import ShapeError, UnsupportedConfigError
from .microbatch import postprocess_batch_func, prepare_micro_batches

__all__ = ["AGG_MODES", "agg_loss", "policy_loss", "value_loss", "sft_loss", "local_facts", "global_facts",
           "padded_responses", "group_gather", "forward_backward_batch"]

AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _masked(loss_mat: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if loss_mat.shape != loss_mask.shape:
        raise ShapeError(f"agg_loss: loss_mat {tuple(loss_mat.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    keep = loss_mask.to(torch.bool)
    return torch.where(keep, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device)), keep


def _global(value, dp_size: int, name: str, local: torch.Tensor):
    if value is not None:
        return value
    if dp_size > 1:
        raise UnsupportedConfigError(f"agg_loss: {name} (a fact of the whole mini-batch) is required when dp_size > 1")
    return local


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str, dp_size: int = 1,
             batch_num_tokens: int | None = None, global_batch_size: int | None = None,
             loss_scale_factor: float | None = None, response_width: int | None = None) -> torch.Tensor:
    """The scalar of one micro-batch's ``(b, R)`` ``loss_mat`` under ``loss_mask``: summed over the micro-batches of a
    rank and averaged over ``dp_size`` ranks, the whole mini-batch's loss in ``loss_agg_mode``. ``batch_num_tokens``,
    ``global_batch_size``: the mini-batch's valid tokens and samples on every rank (required when ``dp_size > 1``);
    ``loss_scale_factor``: seq-mean-token-sum-norm's constant, else ``response_width`` (the mini-batch's longest
    response), else the micro-batch's width."""
    masked, keep = _masked(loss_mat, loss_mask)
    if loss_agg_mode == "token-mean":
        tokens = _global(batch_num_tokens, dp_size, "batch_num_tokens", keep.sum())
        return masked.sum() / tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked.sum() * dp_size
    counts = keep.sum(-1)
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        per_sequence = masked.sum(-1)
    elif loss_agg_mode == "seq-mean-token-mean":
        per_sequence = masked.sum(-1) / counts.clamp(min=1)
    else:
        raise UnsupportedConfigError(f"agg_loss: unknown loss_agg_mode {loss_agg_mode!r}; known: {AGG_MODES}")
    samples = _global(global_batch_size, dp_size, "global_batch_size", (counts > 0).sum())
    loss = per_sequence.sum() / samples * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        horizon = loss_scale_factor if loss_scale_factor is not None else (
            response_width if response_width is not None else loss_mask.shape[-1])
        loss = loss / horizon
    return loss


def policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", clip_ratio: float = 0.2,
                clip_ratio_c: float = 3.0, **facts) -> torch.Tensor:
    """PPO's clipped objective with dual clip (``(b, R)`` each), aggregated by :func:`agg_loss` with ``facts``."""
    ratio = torch.exp((log_probs - old_log_probs).clamp(-20.0, 20.0))
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_ratio, 1 + clip_ratio))
    losses = torch.where(advantages < 0, torch.minimum(clipped, -advantages * clip_ratio_c), clipped)
    return agg_loss(losses, response_mask, loss_agg_mode, **facts)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor,
               loss_agg_mode: str = "token-mean", cliprange_value: float = 0.5, **facts) -> torch.Tensor:
    """PPO's clipped value loss, ``0.5 * max((v - R)^2, (clip(v) - R)^2)``, aggregated by :func:`agg_loss`."""
    clipped = torch.maximum(torch.minimum(values, old_values + cliprange_value), old_values - cliprange_value)
    losses = torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    return 0.5 * agg_loss(losses, response_mask, loss_agg_mode, **facts)


def sft_loss(log_probs: torch.Tensor, response_mask: torch.Tensor, loss_agg_mode: str = "token-mean",
             **facts) -> torch.Tensor:
    """The negative log-likelihood of the response tokens, aggregated by :func:`agg_loss`."""
    return agg_loss(-log_probs, response_mask, loss_agg_mode, **facts)


def local_facts(response_mask: torch.Tensor) -> torch.Tensor:
    """One rank's share of the global facts, ``(4,)`` int64: its valid tokens, samples, longest response and 1 (a
    rank), from its nested ``(b, r_i)`` or dense ``(b, R)`` response mask."""
    if response_mask.is_nested:
        lengths = response_mask.offsets().diff()
        tokens = response_mask.values().to(torch.bool).sum()
    else:
        lengths = torch.full((response_mask.shape[0],), response_mask.shape[-1], device=response_mask.device)
        tokens = response_mask.to(torch.bool).sum()
    width = lengths.max() if lengths.numel() else torch.zeros((), dtype=torch.int64, device=lengths.device)
    return torch.stack([tokens.to(torch.int64), torch.tensor(int(lengths.numel()), device=lengths.device),
                        width.to(torch.int64), torch.ones((), dtype=torch.int64, device=lengths.device)])


def global_facts(local: torch.Tensor, all_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
                 ) -> dict[str, int]:
    """The facts every micro-batch of the step is handed, from the ranks' :func:`local_facts`: ``all_gather(local)``
    returns every rank's ``(world, 4)`` (a seam, e.g. :func:`group_gather`, an all-gather on the DP group;
    None: one rank). Tokens, samples and ranks are summed, the longest response is the longest of all."""
    every = local.unsqueeze(0) if all_gather is None else all_gather(local)
    if every.dim() != 2 or every.shape[1] != 4:
        raise ShapeError(f"global_facts: all_gather returned {tuple(every.shape)}, expected (world, 4)")
    tokens, samples, _, ranks = every.sum(0).tolist()
    return {"batch_num_tokens": int(tokens), "global_batch_size": int(samples), "dp_size": int(ranks),
            "response_width": int(every[:, 2].max())}


def padded_responses(nested: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """A nested ``(b, r_i)`` per-response-token tensor (a step key: the response mask, old log-probs, advantages) as
    ``(b, width)``, right-padded with zeros (``width``: default the longest ``r_i``)."""
    if not nested.is_nested:
        raise ShapeError(f"padded_responses: expected a nested (b, r_i) tensor, got a dense {tuple(nested.shape)}")
    offsets = nested.offsets()
    lengths = offsets.diff()
    width = int(lengths.max()) if width is None else int(width)
    if lengths.numel() and int(lengths.max()) > width:
        raise ShapeError(f"padded_responses: a response of {int(lengths.max())} tokens does not fit width {width}")
    values = nested.values()
    rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths.to(values.device))
    cols = torch.arange(values.shape[0], device=values.device) - offsets[:-1].to(values.device)[rows]
    out = values.new_zeros((lengths.numel(), width, *values.shape[1:]))
    out[rows, cols] = values
    return out


def group_gather(group: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """:func:`global_facts`' gather over the process group ``group`` (``all_gather``; None: one rank)."""
    if group is None:
        return None

    def gather(local: torch.Tensor) -> torch.Tensor:
        every = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, local.contiguous(), group=group)
        return torch.stack(every)

    return gather


def _agreed_cut(data: TensorDict, dp_group: Any) -> tuple[list, Any]:
    return prepare_micro_batches(data, dp_group=dp_group, same_micro_num_in_dp=True)


def forward_backward_batch(engine: Any, module: Callable[..., Any], data: TensorDict,
                           loss_function: Callable[[dict, TensorDict], torch.Tensor], dp_group: Any = None,
                           processor: Callable | None = None, forward_only: bool = False,
                           cut: Callable[[TensorDict, Any], tuple[list, Any]] | None = None,
                           restore: Callable[..., dict[str, Any]] = postprocess_batch_func) -> dict[str, Any]:
    """One rank's step over its mini-batch ``data`` (its ``response_mask`` and the cut's flags: ``use_dynamic_bsz``,
    ``max_token_len_per_gpu`` or ``micro_batch_size_per_gpu``): the global facts (:func:`global_facts` over
    ``dp_group``) assigned to a shallow copy of ``data`` as non-tensor entries, the cut with ``dp_group``, every
    micro-batch through ``engine``'s ``prepare_model_inputs``, ``module`` and ``prepare_model_outputs`` (``processor``
    its logits processor), ``loss_function(model_output, micro_batch)`` backpropagated unless ``forward_only``.
    ``cut(data, dp_group) -> (micro_batches, indices)``: the cut (default ``prepare_micro_batches`` with the group and
    ``same_micro_num_in_dp``); ``restore(output_lst=, indices=, data=)``: the restore (default
    ``postprocess_batch_func``). Returns its ``{"model_output", "loss", "metrics"}``, the outputs in ``data``'s
    order."""
    if "response_mask" not in data.keys():
        raise ShapeError(f"forward_backward_batch: data has no 'response_mask' (keys {sorted(data.keys())})")
    data = data.copy()
    for key, value in global_facts(local_facts(data.get("response_mask")), group_gather(dp_group)).items():
        data.set_non_tensor(key, value)
    micro_batches, indices = (cut or _agreed_cut)(data, dp_group)
    outputs, losses = [], []
    # one model call and one backward per micro-batch, in turn: gradient accumulation bounds the activations' memory
    # by running them apart (each micro-batch's tokens are vectorised inside the engine's calls). Nothing in the loop
    # waits for the device: the losses are read back once, after it (float64 holds any float loss exactly)
    for micro_batch in micro_batches:
        with torch.no_grad() if forward_only else torch.enable_grad():
            inputs, output_args = engine.prepare_model_inputs(micro_batch)
            model_output = engine.prepare_model_outputs(module(**inputs), output_args, micro_batch, processor)
            loss = loss_function(model_output, micro_batch)
        if not forward_only:
            loss.backward()
        outputs.append({k: v.detach() for k, v in model_output.items()})
        losses.append(loss.detach().to(torch.float64))
    values = torch.stack(losses).tolist() if losses else []
    output_lst = [{"model_output": output, "loss": value} for output, value in zip(outputs, values)]
    return restore(output_lst=output_lst, indices=indices, data=data)
