"""A user's engine (a ``make_engine`` factory, importing nothing of the suite) with a sequence-parallel bug that
shows only on real ranks: each rank rolls the labels within its own shard, so the label of a shard's last token
wraps to the shard's first instead of the next rank's first (the planted ``shard_roll``'s mistake, again here
because a reproducer imports this module in rank processes without the suite). For tests/test_repro_ranks.py."""

import torch

import impl
from impl import build_attention_mask_from_nested, no_padding_2_padding  # noqa: F401 - helpers the suite finds


class ShardRoll(impl.LMHeadEngine):
    def prepare_model_inputs(self, mb):
        mi, oa = super().prepare_model_inputs(mb)
        if self.settings.sp_size > 1 and "temperature_rmpad" in oa:
            oa["input_ids_rmpad_rolled"] = torch.roll(mi["input_ids"][0], -1)
            if "shift_labels" in mi:
                mi["shift_labels"] = oa["input_ids_rmpad_rolled"].unsqueeze(0)
        return mi, oa


def make_engine(head: str = "lm", **settings):
    return (ShardRoll if head == "lm" else impl.ValueHeadEngine)(**settings)
