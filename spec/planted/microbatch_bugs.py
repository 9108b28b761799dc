"""Planted bugs in impl's micro-batch layer (``impl.microbatch``): each a small, plausible mistake that real
layers make, rejected under ``ci`` by the ``INV-MB-*`` invariant(s) ``spec/planted/__init__.py`` names.

Each entry is a function ``layer -> layer`` that replaces one or two of impl's functions with a wrapper holding the
mistake (impl itself is not changed). Loud ones show on most mini-batches; quiet ones only under one condition:
balancing that reorders the micro-batches, a sample exactly at the budget, equal lengths, a forced group, ranks
whose own counts differ.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import torch
from tensordict import TensorDict

from ..protocol.microbatch import MicroBatchLayer
from .helper_bugs import as_nested_tensor_guessed

__all__ = ["restore_off_by_one_when_reordered", "restore_skipped_without_grad", "budget_check_exclusive", "equal_lengths_stacked_dense",
           "micro_batches_drop_flags", "groups_split", "dp_count_not_synchronised", "fixed_path_drops_remainder",
           "micro_batch_rows_rotated", "chunks_reversed", "concat_drops_flags", "index_select_sorted",
           "nested_from_list_by_torch", "fix_positions_by_unbind", "balance_ignores_equal_size",
           "losses_only_with_model_output", "dense_tokens_counted_by_response", "index_tensor_deduplicated"]


def _flag(data: Any, key: str, default: Any = None) -> Any:
    value = data.get(key, default) if key in data.keys() else default
    return getattr(value, "data", value)


def restore_off_by_one_when_reordered(layer: MicroBatchLayer) -> MicroBatchLayer:
    """restore_dynamic_batch builds its inverse permutation shifted by one whenever the balancing reordered the
    micro-batches (the flattened indices are not ascending): every sample gets its neighbour's outputs."""
    restore = layer.get("restore_dynamic_batch")

    def restore_dynamic_batch(data, batch_idx_list):
        flat = list(chain.from_iterable(batch_idx_list))
        if flat == sorted(flat):
            return restore(data, batch_idx_list)
        shifted = [flat[(i + 1) % len(flat)] for i in range(len(flat))]  # off by one
        return restore(data, [shifted])

    return layer.with_functions("planted", restore_dynamic_batch=restore_dynamic_batch,
                                postprocess_batch_func=_postprocess_with(layer, restore_dynamic_batch))


def restore_skipped_without_grad(layer: MicroBatchLayer) -> MicroBatchLayer:
    """An evaluation fast path: without grad (the old-policy and reference log-prob passes) restore_dynamic_batch
    returns the results in micro-batch order, as if the balancing never reordered the samples."""
    restore = layer.get("restore_dynamic_batch")

    def restore_dynamic_batch(data, batch_idx_list):
        if torch.is_grad_enabled():
            return restore(data, batch_idx_list)
        return data

    return layer.with_functions("planted", restore_dynamic_batch=restore_dynamic_batch,
                                postprocess_batch_func=_postprocess_with(layer, restore_dynamic_batch))


def _postprocess_with(layer: MicroBatchLayer, restore) -> Any:
    """postprocess_batch_func that concatenates with the layer's own concat and restores with ``restore``."""
    join = layer.get("concat_nested_tensors")

    def postprocess_batch_func(output_lst, indices, data):
        keys = list(output_lst[0].get("model_output", {})) if output_lst else []
        out = {key: join([o["model_output"][key] for o in output_lst]) for key in keys}
        if _flag(data, "use_dynamic_bsz", True) and indices is not None:
            out = {key: restore(value, indices) for key, value in out.items()}
        return {"model_output": out, "loss": [o["loss"] for o in output_lst if "loss" in o], "metrics": {}}

    return postprocess_batch_func


def _dynamic_prepare(layer: MicroBatchLayer, rearrange) -> Any:
    """prepare_micro_batches whose dynamic path calls ``rearrange`` (the fixed path is the layer's own)."""
    prepare = layer.get("prepare_micro_batches")

    def prepare_micro_batches(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                              min_num_micro_batch=None, use_dynamic_bsz_balance=True):
        if not _flag(data, "use_dynamic_bsz", True):
            return prepare(data, dp_group, num_batches_divided_by, same_micro_num_in_dp, min_num_micro_batch,
                           use_dynamic_bsz_balance)
        budget = _flag(data, "max_token_len_per_gpu") * _flag(data, "sp_size", 1)
        return rearrange(data, budget, dp_group=dp_group, num_batches_divided_by=num_batches_divided_by,
                         same_micro_num_in_dp=same_micro_num_in_dp, min_num_micro_batch=min_num_micro_batch,
                         use_dynamic_bsz_balance=use_dynamic_bsz_balance,
                         force_group_size=_flag(data, "force_group_size", 1))

    return prepare_micro_batches


def budget_check_exclusive(layer: MicroBatchLayer) -> MicroBatchLayer:
    """The budget is checked with ``>=`` where ``>`` is meant (``tokens < max_token_len`` counts as fitting): a sample,
    group or micro-batch of exactly max_token_len tokens is over budget, so such a sample is refused and a mini-batch
    that fits one budget exactly is cut in two."""
    rearrange = layer.get("rearrange_micro_batches")

    def rearrange_micro_batches(batch, max_token_len, *args, **kwargs):
        return rearrange(batch, int(max_token_len) - 1, *args, **kwargs)

    return layer.with_functions("planted", rearrange_micro_batches=rearrange_micro_batches,
                                prepare_micro_batches=_dynamic_prepare(layer, rearrange_micro_batches))


def equal_lengths_stacked_dense(layer: MicroBatchLayer) -> MicroBatchLayer:
    """list_of_dict_to_tensordict stacks a key into a dense tensor whenever every sample's tensor has the same shape
    (verl #7661): a batch whose samples all have one length (a GRPO group all at the maximum) gets dense ids and
    positions, and ``.offsets()`` fails downstream."""
    build = layer.get("list_of_dict_to_tensordict")

    def list_of_dict_to_tensordict(list_of_dicts, *args, **kwargs):
        out = build(list_of_dicts, *args, **kwargs)
        for key in list_of_dicts[0]:
            items = [d[key] for d in list_of_dicts]
            if all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in items) and \
                    len({tuple(t.shape) for t in items}) == 1:
                out.set(key, torch.stack(items))
        return out

    return layer.with_functions("planted", list_of_dict_to_tensordict=list_of_dict_to_tensordict)


def micro_batches_drop_flags(layer: MicroBatchLayer) -> MicroBatchLayer:
    """prepare_micro_batches rebuilds each micro-batch from its tensors only: the NonTensorData flags
    (use_remove_padding, pad_mode, calculate_entropy, ...) are dropped, so the engine falls back to its defaults."""
    prepare = layer.get("prepare_micro_batches")

    def prepare_micro_batches(data, *args, **kwargs):
        micro, indices = prepare(data, *args, **kwargs)
        stripped = []
        for mb in micro:
            out = TensorDict({}, batch_size=mb.batch_size)
            for key in mb.keys():
                value = mb.get(key)
                if isinstance(value, torch.Tensor) or type(value).__name__ == "NonTensorStack":
                    out.set(key, value)
            stripped.append(out)
        return stripped, indices

    return layer.with_functions("planted", prepare_micro_batches=prepare_micro_batches)


def groups_split(layer: MicroBatchLayer) -> MicroBatchLayer:
    """rearrange_micro_batches checks that the batch divides into force_group_size groups but partitions the samples
    one by one: a group (a reward model's chosen/rejected pair, a GRPO group) can be split across micro-batches."""
    rearrange = layer.get("rearrange_micro_batches")

    def rearrange_micro_batches(batch, max_token_len, *args, force_group_size=1, **kwargs):
        lengths = batch["input_ids"].offsets().diff()
        if len(lengths) % int(force_group_size):
            raise ValueError(f"batch size {len(lengths)} must be divisible by force_group_size {force_group_size}")
        return rearrange(batch, max_token_len, *args, force_group_size=1, **kwargs)

    return layer.with_functions("planted", rearrange_micro_batches=rearrange_micro_batches,
                                prepare_micro_batches=_dynamic_prepare(layer, rearrange_micro_batches))


def dp_count_not_synchronised(layer: MicroBatchLayer) -> MicroBatchLayer:
    """prepare_micro_batches never hands the data-parallel group on (``dp_group`` dropped): each rank picks its own
    micro-batch count, and a rank with fewer micro-batches leaves the others waiting in a collective."""
    prepare = layer.get("prepare_micro_batches")

    def prepare_micro_batches(data, dp_group=None, *args, **kwargs):
        return prepare(data, None, *args, **kwargs)

    return layer.with_functions("planted", prepare_micro_batches=prepare_micro_batches)


def fixed_path_drops_remainder(layer: MicroBatchLayer) -> MicroBatchLayer:
    """The fixed-size path cuts ``B // (micro_batch_size_per_gpu * force_group_size)`` chunks without checking the
    divisibility: the last ``B mod size`` samples are silently dropped."""
    prepare = layer.get("prepare_micro_batches")
    select = layer.get("index_select_tensor_dict")

    def prepare_micro_batches(data, *args, **kwargs):
        if _flag(data, "use_dynamic_bsz", True):
            return prepare(data, *args, **kwargs)
        size = _flag(data, "micro_batch_size_per_gpu") * _flag(data, "force_group_size", 1)
        count = len(data) // size
        return [select(data, list(range(k * size, (k + 1) * size))) for k in range(count)], None

    return layer.with_functions("planted", prepare_micro_batches=prepare_micro_batches)


def micro_batch_rows_rotated(layer: MicroBatchLayer) -> MicroBatchLayer:
    """prepare_micro_batches returns the right index lists but builds each micro-batch of two or more samples from
    them rotated by one: the engine computes sample j's outputs under sample j+1's index."""
    prepare = layer.get("prepare_micro_batches")
    select = layer.get("index_select_tensor_dict")

    def prepare_micro_batches(data, *args, **kwargs):
        micro, indices = prepare(data, *args, **kwargs)
        if indices is None:
            return micro, indices
        rotated = [select(data, list(part[1:]) + list(part[:1])) if len(part) > 1 else mb
                   for mb, part in zip(micro, indices)]
        return rotated, indices

    return layer.with_functions("planted", prepare_micro_batches=prepare_micro_batches)


def chunks_reversed(layer: MicroBatchLayer) -> MicroBatchLayer:
    """chunk_tensordict returns its chunks last first."""
    chunk = layer.get("chunk_tensordict")

    def chunk_tensordict(td, chunks):
        return list(chunk(td, chunks))[::-1]

    return layer.with_functions("planted", chunk_tensordict=chunk_tensordict)


def concat_drops_flags(layer: MicroBatchLayer) -> MicroBatchLayer:
    """concat_tensordict concatenates the tensors and forgets the NonTensorData flags."""
    concat = layer.get("concat_tensordict")

    def concat_tensordict(data):
        out = concat(data)
        for key in list(out.keys()):
            value = out.get(key)
            if not isinstance(value, torch.Tensor) and type(value).__name__ != "NonTensorStack":
                del out[key]
        return out

    return layer.with_functions("planted", concat_tensordict=concat_tensordict)


def index_select_sorted(layer: MicroBatchLayer) -> MicroBatchLayer:
    """index_select_tensor_dict sorts the indices first: the selected samples come back in ascending order, not the
    order asked for."""
    select = layer.get("index_select_tensor_dict")

    def index_select_tensor_dict(batch, indices):
        return select(batch, sorted(int(i) for i in indices))

    return layer.with_functions("planted", index_select_tensor_dict=index_select_tensor_dict)


def nested_from_list_by_torch(layer: MicroBatchLayer) -> MicroBatchLayer:
    """nested_tensor_from_tensor_list ignores ragged_idx and lets ``torch.nested.as_nested_tensor`` pick the ragged dim:
    (4, n) mRoPE items of equal lengths (or one item) come out ragged on the 4."""
    build = layer.get("nested_tensor_from_tensor_list")

    def nested_tensor_from_tensor_list(tensors, ragged_idx=None):
        if tensors and tensors[0].dim() == 2 and ragged_idx == 2:
            return as_nested_tensor_guessed(list(tensors))
        return build(tensors, ragged_idx=ragged_idx)

    return layer.with_functions("planted", nested_tensor_from_tensor_list=nested_tensor_from_tensor_list)


def fix_positions_by_unbind(layer: MicroBatchLayer) -> MicroBatchLayer:
    """maybe_fix_3d_position_ids rebuilds mRoPE positions from their unbound samples with
    ``torch.nested.as_nested_tensor``: with equal lengths or B = 1 the 4 becomes the ragged dim."""
    fix = layer.get("maybe_fix_3d_position_ids")

    def maybe_fix_3d_position_ids(data):
        fix(data)
        pos = data.get("position_ids") if "position_ids" in data.keys() else None
        if isinstance(pos, torch.Tensor) and pos.is_nested and pos.dim() == 3:
            data.set("position_ids", as_nested_tensor_guessed(list(pos.unbind())))
        return None

    return layer.with_functions("planted", maybe_fix_3d_position_ids=maybe_fix_3d_position_ids)


def balance_ignores_equal_size(layer: MicroBatchLayer) -> MicroBatchLayer:
    """get_seqlen_balanced_partitions balances by tokens only, whatever equal_size asks: the data-parallel ranks of a
    trainer's balance_batch get different sample counts when the lengths differ."""
    balance = layer.get("get_seqlen_balanced_partitions")

    def get_seqlen_balanced_partitions(seqlen_list, k_partitions, equal_size):
        return balance(seqlen_list, k_partitions, False)

    return layer.with_functions("planted", get_seqlen_balanced_partitions=get_seqlen_balanced_partitions)


def losses_only_with_model_output(layer: MicroBatchLayer) -> MicroBatchLayer:
    """postprocess_batch_func collects each micro-batch's loss and metrics inside its model_output loop: a training
    step whose micro-batches return no model_output (loss and metrics only) reports no loss and no metrics."""
    post = layer.get("postprocess_batch_func")

    def postprocess_batch_func(output_lst, indices, data):
        out = post(output_lst=output_lst, indices=indices, data=data)
        if not any("model_output" in o for o in output_lst):
            out = {**out, "loss": [], "metrics": {}}
        return out

    return layer.with_functions("planted", postprocess_batch_func=postprocess_batch_func)


def dense_tokens_counted_by_response(layer: MicroBatchLayer) -> MicroBatchLayer:
    """rearrange_micro_batches counts a padded mini-batch's tokens over its response columns only (the loss tokens:
    the attention mask past the prompt block), not its whole attention mask: the prompts are not counted, so a
    micro-batch can hold more tokens than the budget."""
    rearrange = layer.get("rearrange_micro_batches")
    select = layer.get("index_select_tensor_dict")

    def rearrange_micro_batches(batch, max_token_len, *args, **kwargs):
        ids = batch["input_ids"]
        if ids.is_nested or "attention_mask" not in batch.keys() or "responses" not in batch.keys():
            return rearrange(batch, max_token_len, *args, **kwargs)
        mask = batch["attention_mask"]
        prompt_cols = mask.shape[-1] - batch["responses"].shape[-1]
        counted = batch.copy()
        counted.set("attention_mask", mask * (torch.arange(mask.shape[-1], device=mask.device) >= prompt_cols))
        _, indices = rearrange(counted, max_token_len, *args, **kwargs)
        return [select(batch, list(part)) for part in indices], indices

    return layer.with_functions("planted", rearrange_micro_batches=rearrange_micro_batches,
                                prepare_micro_batches=_dynamic_prepare(layer, rearrange_micro_batches))


def index_tensor_deduplicated(layer: MicroBatchLayer) -> MicroBatchLayer:
    """index_select_tensor_dict turns a tensor of indices into its unique values (``indices.unique()``, sorted): a
    tensor selection comes back in ascending order; a list selection is right."""
    select = layer.get("index_select_tensor_dict")

    def index_select_tensor_dict(batch, indices):
        if isinstance(indices, torch.Tensor):
            indices = indices.unique()
        return select(batch, indices)

    return layer.with_functions("planted", index_select_tensor_dict=index_select_tensor_dict)
