"""Micro-batch layer functions with a bug each, at module level (as an engine's own layer is), for
tests/test_repro_minibatch.py: a reproducer imports them by module and name, without the suite."""

from __future__ import annotations

import torch

from impl.microbatch.batches import postprocess_batch_func as _postprocess
from impl.microbatch.batches import prepare_micro_batches as _prepare
from impl.microbatch.batches import rearrange_micro_batches as _rearrange
from impl.microbatch.batches import restore_dynamic_batch as _restore
from impl.microbatch import nested as _nested
from impl.microbatch import tensordicts as _tensordicts


def restore_dynamic_batch(data, batch_idx_list):
    """Without grad the results stay in micro-batch order (an evaluation fast path that skips the restore)."""
    return _restore(data, batch_idx_list) if torch.is_grad_enabled() else data


def prepare_micro_batches(data, *args, **kwargs):
    """The last micro-batch's index list loses its last sample (the micro-batch itself keeps it)."""
    micro, indices = _prepare(data, *args, **kwargs)
    if indices is not None and len(indices[-1]) > 1:
        indices = [list(part) for part in indices]
        indices[-1] = indices[-1][:-1]
    return micro, indices


def chunk_tensordict(td, chunks):
    """The chunks come back last first."""
    return list(_tensordicts.chunk_tensordict(td, chunks))[::-1]


def index_select_tensor_dict(batch, indices):
    """The indices are sorted first: the samples come back ascending, not in the order asked for."""
    return _tensordicts.index_select_tensor_dict(batch, sorted(int(i) for i in indices))


def concat_tensordict(data):
    """The NonTensorData flags are forgotten."""
    out = _tensordicts.concat_tensordict(data)
    for key in list(out.keys()):
        value = out.get(key)
        if not isinstance(value, torch.Tensor) and type(value).__name__ != "NonTensorStack":
            del out[key]
    return out


def nested_tensor_from_tensor_list(tensors, ragged_idx=None):
    """ragged_idx is ignored: torch picks the ragged dim (the 4 of equal-length (4, n) mRoPE items)."""
    if tensors and tensors[0].dim() == 2 and ragged_idx == 2:
        return torch.nested.as_nested_tensor(list(tensors), layout=torch.jagged)
    return _nested.nested_tensor_from_tensor_list(tensors, ragged_idx=ragged_idx)


def list_of_dict_to_tensordict(list_of_dicts):
    """A key whose every sample has one shape is stacked dense (verl #7661)."""
    out = _tensordicts.list_of_dict_to_tensordict(list_of_dicts)
    for key in list_of_dicts[0]:
        items = [d[key] for d in list_of_dicts]
        if all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in items) and len({tuple(t.shape) for t in items}) == 1:
            out.set(key, torch.stack(items))
    return out


def maybe_fix_3d_position_ids(data):
    """mRoPE positions rebuilt from their unbound samples: with equal lengths or B = 1 the 4 becomes the ragged dim."""
    _tensordicts.maybe_fix_3d_position_ids(data)
    pos = data.get("position_ids") if "position_ids" in data.keys() else None
    if isinstance(pos, torch.Tensor) and pos.is_nested and pos.dim() == 3:
        data.set("position_ids", torch.nested.as_nested_tensor(list(pos.unbind()), layout=torch.jagged))


def prepare_micro_batches_exclusive(data, dp_group=None, num_batches_divided_by=None, same_micro_num_in_dp=True,
                                    min_num_micro_batch=None, use_dynamic_bsz_balance=True):
    """The budget is checked with >= (one token less): a mini-batch that fits one budget exactly is cut in two."""
    if not _flag(data, "use_dynamic_bsz"):
        return _prepare(data, dp_group, num_batches_divided_by, same_micro_num_in_dp, min_num_micro_batch,
                        use_dynamic_bsz_balance)
    return _rearrange(data, _flag(data, "max_token_len_per_gpu") * _flag(data, "sp_size") - 1, dp_group=dp_group,
                      num_batches_divided_by=num_batches_divided_by, same_micro_num_in_dp=same_micro_num_in_dp,
                      min_num_micro_batch=min_num_micro_batch, use_dynamic_bsz_balance=use_dynamic_bsz_balance,
                      force_group_size=_flag(data, "force_group_size", 1))


def prepare_micro_batches_fixed_keys(data, *args, **kwargs):
    """The fixed path's micro-batches lose the loss_mask (input_ids, which decide the samples, are right)."""
    micro, indices = _prepare(data, *args, **kwargs)
    if indices is None:
        micro = [mb.exclude("loss_mask") for mb in micro]
    return micro, indices


def prepare_micro_batches_alone(data, dp_group=None, *args, **kwargs):
    """The data-parallel group is never handed on: each rank picks its own count."""
    return _prepare(data, None, *args, **kwargs)


def _flag(data, key, default=None):
    value = data.get(key, default)
    return getattr(value, "data", value)


def postprocess_batch_func(output_lst, indices, data):
    """The micro-batches' losses come back last first (a training step's logged losses out of order)."""
    out = _postprocess(output_lst=output_lst, indices=indices, data=data)
    out["loss"] = list(out["loss"])[::-1]
    return out
