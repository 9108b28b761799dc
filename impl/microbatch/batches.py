"""From a mini-batch to micro-batches and back: verl's ``prepare_micro_batches``, ``rearrange_micro_batches``,
``restore_dynamic_batch`` and ``postprocess_batch_func``, with verl's names, signatures and return values.

The token budget of a micro-batch is ``max_token_len`` (``prepare_micro_batches`` passes
``max_token_len_per_gpu * sp_size``, as verl: a sequence-parallel group shares one micro-batch).
A sample longer than the budget cannot be placed in any micro-batch: as verl, impl refuses
the batch (a :class:`~impl.errors.ShapeError`, also a ``ValueError``, naming the sample, its
length and the budget), rather than putting it alone in an over-budget micro-batch that
would run out of memory on the device, far from its cause.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Sequence

import torch
from tensordict import TensorDict, TensorDictBase

from ..errors import ShapeError, UnsupportedConfigError
from ..flags import read_flag
from ..layout import is_nested
from .nested import RowIndex, _check_offsets, _parts, concat_nested_tensors, jagged, token_index
from .partition import (balanced_bins, bins_to_partitions, calculate_workload, ceildiv, fit_budget,
                        roundup_divisible)
from .tensordicts import Selector, chunk_tensordict

__all__ = ["rearrange_micro_batches", "prepare_micro_batches", "restore_dynamic_batch", "get_reverse_idx",
           "postprocess_batch_func"]


def _all_reduce(values: list[int], op: str, group: Any) -> list[int]:
    """``dist.all_reduce`` of a few ints over ``group`` (on the GPU for NCCL, else on the CPU)."""
    import torch.distributed as dist

    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=getattr(dist.ReduceOp, op), group=group)
    return [int(v) for v in tensor.tolist()]


def _syncs(dp_group: Any, same_micro_num_in_dp: bool) -> bool:
    import torch.distributed as dist

    return bool(same_micro_num_in_dp and dp_group is not None and dist.is_available() and dist.is_initialized())


def _sequence_lengths(batch: TensorDictBase) -> tuple[torch.Tensor, int, str]:
    """``(B,)`` int64 token counts, the length the budget must hold, and the key they come from."""
    if "input_ids" not in batch.keys():
        raise ShapeError(f"the mini-batch needs 'input_ids' to count tokens; keys: {sorted(batch.keys())}")
    ids = batch.get("input_ids")
    if is_nested(ids):
        values, offsets, ragged = _parts(ids, "input_ids")
        _check_offsets(values, offsets, ragged, "input_ids")
        lengths = offsets.to(device="cpu", dtype=torch.int64).diff()  # the partition runs on the host, as verl's
        return lengths, int(lengths.max()) if lengths.numel() else 0, "input_ids"
    if "attention_mask" not in batch.keys():
        raise ShapeError(f"dense 'input_ids' {tuple(ids.shape)} need an 'attention_mask' to count tokens")
    mask = batch.get("attention_mask")
    if mask.dim() != 2:
        raise ShapeError(f"'attention_mask' must be (B, L), got shape {tuple(mask.shape)}")
    # as verl: a padded row costs its full width against the budget check, its mask's sum in the count
    return mask.sum(dim=1).to(device="cpu", dtype=torch.int64), int(mask.shape[-1]), "attention_mask"


def rearrange_micro_batches(batch: TensorDictBase, max_token_len: int, dp_group=None, num_batches_divided_by=None,
                            same_micro_num_in_dp=True, min_num_micro_batch=None, use_dynamic_bsz_balance=True,
                            force_group_size=1) -> tuple[list[TensorDict], list[list[int]]]:
    """verl's ``rearrange_micro_batches``: micro-batches of at most ``max_token_len`` tokens, balanced by workload.

    Returns ``(micro_batches, batch_idx_list)``: ``batch_idx_list[i]`` lists (ascending) the
    mini-batch rows of micro-batch ``i``. Groups of ``force_group_size`` consecutive samples
    stay together. The count is ``max(min_num_micro_batch, ceil(total / max_token_len))``
    capped at the number of groups, the maximum over ``dp_group`` (a ``torch.distributed``
    group; ``None``: no synchronisation) when ``same_micro_num_in_dp``, rounded up to a
    multiple of ``num_batches_divided_by``, then raised (by that step) until every
    micro-batch fits; no micro-batch is ever empty (too many required: ``ShapeError``).
    With ``use_dynamic_bsz_balance`` the micro-batches are ordered as verl orders them
    (heaviest in the middle, lighter ones at both ends).
    """
    lengths, longest, source = _sequence_lengths(batch)
    max_token_len = int(max_token_len)
    if longest > max_token_len:
        worst = int(lengths.argmax()) if source == "input_ids" else 0
        raise ShapeError(
            f"max_token_len={max_token_len} is shorter than a sample: {source!r} row {worst} needs {longest} tokens; "
            "a sample cannot be split across micro-batches (raise max_token_len_per_gpu)")
    size = lengths.numel()
    group = int(force_group_size)
    if group < 1 or size % group:
        raise ShapeError(f"batch size {size} (input_ids) must be divisible by force_group_size {force_group_size}")
    groups = size // group
    if groups == 0:
        raise ShapeError("rearrange_micro_batches got an empty batch ('input_ids' has 0 rows)")
    total = int(lengths.sum())
    count = min(groups, ceildiv(total, max_token_len))
    if min_num_micro_batch is not None:
        count = max(int(min_num_micro_batch), count)
    sync = _syncs(dp_group, same_micro_num_in_dp)
    if sync:
        count = _all_reduce([count], "MAX", dp_group)[0]
    if num_batches_divided_by is not None:
        count = roundup_divisible(count, int(num_batches_divided_by))

    workloads = calculate_workload(lengths)
    if group > 1:
        workloads = workloads.view(groups, group).sum(1)
        tokens = lengths.view(groups, group).sum(1)
    else:
        tokens = lengths
    max_group, fewest_groups = int(tokens.max()), groups
    if sync:  # every rank must agree before any rank raises, or its peers hang in the next collective
        max_group, neg = _all_reduce([max_group, -groups], "MAX", dp_group)
        fewest_groups = -neg
    if max_group > max_token_len:
        raise ShapeError(f"a group of force_group_size={group} samples holds {max_group} tokens, over "
                         f"max_token_len={max_token_len}; a group cannot be split")
    step = int(num_batches_divided_by or 1)
    while True:
        if count > fewest_groups:
            raise ShapeError(
                f"{count} non-empty micro-batches are needed (max_token_len={max_token_len}, "
                f"min_num_micro_batch={min_num_micro_batch}, num_batches_divided_by={num_batches_divided_by}, "
                f"data-parallel count) but a rank has only {fewest_groups} groups of force_group_size={group}")
        bins = balanced_bins(workloads, count)
        fits = fit_budget(tokens, workloads, bins, count, max_token_len)
        if sync:
            fits = bool(_all_reduce([int(fits)], "MIN", dp_group)[0])
        if fits:
            break
        count += step

    loads = torch.zeros(count, dtype=torch.int64).index_add_(0, bins, workloads)
    parts = bins_to_partitions(bins, count)
    if use_dynamic_bsz_balance:
        # verl's order: by (workload, first index), heaviest first, then every other one reversed
        ranked = sorted(range(count), key=lambda b: (int(loads[b]), parts[b][0]), reverse=True)
        ranked = ranked[::2][::-1] + ranked[1::2]
        parts = [parts[b] for b in ranked]
    if group > 1:
        offsets = torch.arange(group)
        parts = [(torch.tensor(p).unsqueeze(1) * group + offsets).reshape(-1).tolist() for p in parts]
    selector = Selector(batch)
    micro_batches = [selector.select(torch.tensor(p, dtype=torch.int64)) for p in parts]
    return micro_batches, parts


def prepare_micro_batches(data: TensorDictBase, dp_group=None, num_batches_divided_by=None,
                          same_micro_num_in_dp=True, min_num_micro_batch=None,
                          use_dynamic_bsz_balance=True) -> tuple[list[TensorDict], list[list[int]] | None]:
    """verl's ``prepare_micro_batches``: dynamic (token budget) or fixed-size micro-batches of ``data``.

    Reads the flags ``use_dynamic_bsz`` (default True), ``sp_size`` (1), ``force_group_size``
    (1), ``max_token_len_per_gpu`` (required when dynamic: the budget is it times
    ``sp_size``) and ``micro_batch_size_per_gpu`` (required when fixed: that many groups per
    micro-batch). Returns ``(micro_batches, batch_idx_list)``; ``batch_idx_list`` is ``None``
    for fixed sizes (the order is kept).
    """
    use_dynamic = read_flag(data, "use_dynamic_bsz", True)
    sp_size = read_flag(data, "sp_size", 1)
    group = read_flag(data, "force_group_size", 1)
    if use_dynamic:
        if "max_token_len_per_gpu" not in data.keys():
            raise UnsupportedConfigError("'max_token_len_per_gpu' must be set when use_dynamic_bsz is True")
        budget = read_flag(data, "max_token_len_per_gpu") * sp_size
        return rearrange_micro_batches(data, max_token_len=budget, dp_group=dp_group,
                                       num_batches_divided_by=num_batches_divided_by,
                                       same_micro_num_in_dp=same_micro_num_in_dp,
                                       min_num_micro_batch=min_num_micro_batch,
                                       use_dynamic_bsz_balance=use_dynamic_bsz_balance, force_group_size=group)
    if "micro_batch_size_per_gpu" not in data.keys():
        raise UnsupportedConfigError("'micro_batch_size_per_gpu' must be set when use_dynamic_bsz is False")
    per_gpu = int(read_flag(data, "micro_batch_size_per_gpu"))
    size = len(data)
    if per_gpu < 1 or group < 1 or size % (group * per_gpu):
        raise ShapeError(f"data size {size} must be divisible by force_group_size * micro_batch_size_per_gpu "
                         f"= {group} * {per_gpu}")
    return chunk_tensordict(data, size // (per_gpu * group)), None


def _inverse(batch_idx_list: Sequence[Sequence[int]], size: int) -> torch.Tensor:
    """The permutation undoing ``chain(*batch_idx_list)``, checked to be one."""
    flat = torch.tensor(list(chain.from_iterable(batch_idx_list)), dtype=torch.int64)
    if flat.numel() != size:
        raise ShapeError(f"batch_idx_list holds {flat.numel()} indices for data of batch size {size}")
    if size and (int(flat.min()) < 0 or int(flat.max()) >= size
                 or not bool((torch.bincount(flat, minlength=size) == 1).all())):
        counts = torch.bincount(flat.clamp(0, size - 1), minlength=size)
        raise ShapeError(f"batch_idx_list is not a permutation of range({size}): rows "
                         f"{(counts != 1).nonzero().squeeze(1)[:8].tolist()} appear other than once")
    inverse = torch.empty(size, dtype=torch.int64)
    inverse[flat] = torch.arange(size)
    return inverse


def get_reverse_idx(idx_map: Sequence[int]) -> list[int]:
    """verl's ``get_reverse_idx``: ``out[idx_map[i]] = i`` (``idx_map`` must be a permutation)."""
    return _inverse([list(idx_map)], len(idx_map)).tolist()


def restore_dynamic_batch(data: torch.Tensor, batch_idx_list: Sequence[Sequence[int]]) -> torch.Tensor:
    """verl's ``restore_dynamic_batch``: rows concatenated in micro-batch order, back in mini-batch order.

    Nested tensors keep their layout (a 3-D ``(B, C, j)`` output stays ragged at 2, also for
    equal lengths or B = 1, where verl's ``as_nested_tensor`` rebuild turns it ragged at 1:
    verl #7899).
    """
    size = int(data.shape[0]) if not is_nested(data) else _parts(data, "data")[1].numel() - 1
    inverse = _inverse(batch_idx_list, size)
    if is_nested(data):
        values, offsets, ragged = _parts(data, "data")
        _check_offsets(values, offsets, ragged, "data")
        return RowIndex(offsets.to(torch.int64), inverse.to(offsets.device)).apply(values, ragged)
    return data[inverse.to(data.device)]


def _restore_nested(parts: Sequence[torch.Tensor], batch_idx_list: Sequence[Sequence[int]], key: str) -> torch.Tensor:
    """``restore_dynamic_batch(concat_nested_tensors(parts), batch_idx_list)`` in one pass: each micro-batch's
    rows are written straight to their places in the output (no concatenated intermediate)."""
    if len(parts) != len(batch_idx_list):
        raise ShapeError(f"model_output {key!r}: {len(parts)} micro-batch outputs for {len(batch_idx_list)} "
                         "index lists")
    split = [_parts(p, f"model_output {key!r}[{i}]") for i, p in enumerate(parts)]
    ragged = split[0][2]
    axis = ragged - 1
    values0 = split[0][0]
    device = values0.device
    rest = [s for d, s in enumerate(values0.shape) if d != axis]
    lengths = []
    for i, ((values, offsets, r), rows) in enumerate(zip(split, batch_idx_list)):
        _check_offsets(values, offsets, r, f"model_output {key!r}[{i}]")
        if r != ragged or [s for d, s in enumerate(values.shape) if d != axis] != rest:
            raise ShapeError(f"model_output {key!r}[{i}] has values {tuple(values.shape)} ragged at {r}; "
                             f"micro-batch 0 has {tuple(values0.shape)} ragged at {ragged}")
        if offsets.numel() - 1 != len(rows):
            raise ShapeError(f"model_output {key!r}[{i}] has {offsets.numel() - 1} rows, its micro-batch "
                             f"{len(rows)}")
        lengths.append(offsets.to(device=device, dtype=torch.int64).diff())
    size = sum(len(rows) for rows in batch_idx_list)
    inverse = _inverse(batch_idx_list, size).to(device)
    lengths_cat = torch.cat(lengths)
    out_lengths = lengths_cat.index_select(0, inverse)
    out_offsets = torch.nn.functional.pad(out_lengths.cumsum(0), (1, 0))
    total = int(out_offsets[-1])
    shape = list(values0.shape)
    shape[axis] = total
    out = values0.new_empty(shape)
    for (values, _, _), rows, local in zip(split, batch_idx_list, lengths):  # a loop over micro-batches
        at = torch.as_tensor(rows, dtype=torch.int64, device=device)
        local_offsets = torch.nn.functional.pad(local.cumsum(0), (1, 0))
        dest = token_index(out_offsets.index_select(0, at), local, local_offsets, values.shape[axis], torch.int64)
        out.index_copy_(axis, dest, values)
    return jagged(out, out_offsets, ragged, out_lengths)


def postprocess_batch_func(output_lst: Sequence[dict], indices: Sequence[Sequence[int]] | None,
                           data: TensorDictBase) -> dict[str, Any]:
    """verl's ``postprocess_batch_func``: the micro-batches' ``model_output`` concatenated and, with
    dynamic batch sizes, restored to the mini-batch order; ``loss`` and ``metrics`` collected.

    Like verl it requires ``pad_mode`` no_padding. Nested outputs are concatenated with one
    ``cat`` and keep their layout; dense outputs (verl would unbind them into a nested
    tensor) are concatenated along dim 0.
    """
    use_dynamic = read_flag(data, "use_dynamic_bsz", True)
    pad_mode = read_flag(data, "pad_mode", "no_padding")
    if str(getattr(pad_mode, "value", pad_mode)) != "no_padding":
        raise UnsupportedConfigError(f"postprocess_batch_func only supports pad_mode no_padding, got {pad_mode!r}")
    collected: dict[str, list[torch.Tensor]] = {}
    for out in output_lst:
        for key, value in out.get("model_output", {}).items():
            collected.setdefault(key, []).append(value)
    model_output: dict[str, torch.Tensor] = {}
    for key, parts in collected.items():
        if all(is_nested(p) for p in parts):
            model_output[key] = (_restore_nested(parts, indices, key) if use_dynamic
                                 else concat_nested_tensors(parts))
        elif not any(is_nested(p) for p in parts):
            merged = torch.cat(parts, dim=0)
            model_output[key] = restore_dynamic_batch(merged, indices) if use_dynamic else merged
        else:
            raise ShapeError(f"model_output {key!r}: some micro-batches return nested tensors, others dense")
    losses = [out["loss"] for out in output_lst if "loss" in out]
    metrics: dict[str, list] = {}
    for out in output_lst:
        for key, value in out.get("metrics", {}).items():
            if key not in metrics:  # as verl's append_to_dict (its Metric values start their own list)
                metrics[key] = value.init_list() if hasattr(value, "init_list") else []
            if isinstance(value, list):
                metrics[key].extend(value)
            else:
                metrics[key].append(value)
    return {"model_output": model_output, "loss": losses, "metrics": metrics}
