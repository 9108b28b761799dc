"""Planted bugs on the real-rank path: sequence-parallel mistakes that only show across processes.

Each is impl with one mistake, rejected through real ranks (:mod:`spec.execute.ranks`, gloo) by an
assertion of an ``INV-RANK-*`` invariant.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch
import torch.distributed as dist

import impl
from impl.flags import read_flag
from impl.inputs import prepare_model_inputs
from impl.outputs import prepare_model_outputs, prepare_value_outputs

from .inputs_bugs import ShardRoll


class RollAfterSlice(ShardRoll):
    """Labels are rolled after slicing: each rank rolls its own shard (ids and fused shift_labels), so the
    label of a shard's last token wraps to the shard's first instead of the next rank's first. The same
    mistake as ``shard_roll`` (one implementation), planted again to be rejected on real ranks."""


def _total(mb) -> int:
    return int(mb["input_ids"].offsets()[-1])


class PadWhenDivisible(impl.LMHeadEngine):
    """The sequence-parallel pad is ``sp - n % sp``: when the token count divides the world size a whole
    extra row of ``sp`` pad tokens is added (and reported) instead of none."""

    def _settings_for(self, mb):
        sp, bucket = self.settings.sp_size, self.settings.pad_to_length
        total = _total(mb)
        bucketed = total if bucket is None else -(-total // bucket) * bucket
        if sp == 1 or bucketed % sp or read_flag(mb, "distillation_use_topk", False):
            return self.settings
        # the wrong formula's extra row, expressed as a bucket that inputs and outputs agree on
        return replace(self.settings, pad_to_length=bucketed + sp)

    def prepare_model_inputs(self, mb):
        return prepare_model_inputs(mb, self._settings_for(mb))

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        return prepare_model_outputs(output, output_args, mb, logits_processor_func, self._settings_for(mb))


class GatherEvenShare(impl.LMHeadEngine):
    """The all-gather keeps ``total_nnz // sp`` rows of every rank's shard (an even share) and zero-fills
    the gathered row's tail: when the token count does not divide the world size, the last token(s) of
    every shard are lost."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        gather, sp = self.settings.all_gather, self.settings.sp_size
        if sp == 1 or gather is None:
            return super().prepare_model_outputs(output, output_args, mb, logits_processor_func)
        share = _total(mb) // sp

        def even_share(local: torch.Tensor) -> torch.Tensor:
            full = gather(local)
            parts = [part[:share] for part in full.split(local.shape[0], dim=0)]
            kept = torch.cat(parts, dim=0)
            return torch.cat([kept, kept.new_zeros(full.shape[0] - kept.shape[0], *kept.shape[1:])], dim=0)

        settings = replace(self.settings, all_gather=even_share)
        return prepare_model_outputs(output, output_args, mb, logits_processor_func, settings)


class TemperatureSlicedLogitsNot(impl.LMHeadEngine):
    """The logits are all-gathered to the full row (not sliced) while the temperature is this rank's
    slice, tiled ``sp`` times to fit: every shard is scaled with this rank's temperatures."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        gather, sp = self.settings.all_gather, self.settings.sp_size
        if sp == 1 or gather is None or read_flag(mb, "use_fused_kernels", False):
            return super().prepare_model_outputs(output, output_args, mb, logits_processor_func)
        logits = gather(output.logits[0]).unsqueeze(0)  # (1, padded, V): the full row
        padded = logits.shape[1]
        args = dict(output_args)
        args["input_ids_rmpad_rolled"] = gather(output_args["input_ids_rmpad_rolled"])
        args["temperature_rmpad"] = output_args["temperature_rmpad"].repeat(sp)  # sliced, tiled to fit
        settings = replace(self.settings, sp_size=1, sp_rank=0, all_gather=None,
                           pad_to_length=padded if padded > _total(mb) else None)
        return prepare_model_outputs(SimpleNamespace(logits=logits), args, mb, logits_processor_func, settings)


class TemperatureNotSliced(impl.LMHeadEngine):
    """``temperature_rmpad`` is not sliced: every rank gets the whole (bucket-padded) row's per-token
    temperature while its ids, positions and labels are its shard."""

    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if self.settings.sp_size > 1 and "pad_size" in oa:
            whole = replace(self.settings, sp_size=1, sp_rank=0, all_gather=None)
            oa["temperature_rmpad"] = prepare_model_inputs(mb, whole)[1]["temperature_rmpad"]
        return mi, oa


class SpRankFromGlobalRank(impl.LMHeadEngine):
    """The rank within the sequence-parallel group is taken as the global rank modulo ``sp`` (as if SP were the
    innermost dimension of a ``("dp", "sp")`` device mesh) instead of the rank it is handed (its rank in the SP
    group): right for one group ``[0, sp)`` and for groups ``[k sp, (k + 1) sp)``, wrong for a group that starts
    elsewhere or interleaves, where two ranks of one group take the same slice."""

    def __init__(self, **settings):
        sp = int(settings.get("sp_size", 1) or 1)
        if sp > 1 and dist.is_available() and dist.is_initialized():
            settings["sp_rank"] = dist.get_rank() % sp
        super().__init__(**settings)


class CriticGatherReversed(impl.ValueHeadEngine):
    """The value head's all-gather puts the SP ranks' shards in reverse rank order (a critic path with its own
    gather, written for a descending device mesh): a PPO critic under Ulysses SP gets each token's value from
    another shard. The LM head is untouched."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        gather, sp = self.settings.all_gather, self.settings.sp_size
        if sp == 1 or gather is None:
            return super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **verl_only)

        def reversed_gather(local: torch.Tensor) -> torch.Tensor:
            return torch.cat(list(gather(local).chunk(sp, dim=0))[::-1], dim=0)

        settings = replace(self.settings, all_gather=reversed_gather)
        return prepare_value_outputs(output, output_args, mb, settings)
