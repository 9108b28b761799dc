"""verl 0.7.1 rearrange_micro_batches: a micro-batch can hold more tokens than max_token_len (use_dynamic_bsz).

Needs: pip install torch tensordict verl==0.7.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies
the suggested fix (verl PR #7553's rule, in verl 0.9.1: raise the count until every micro-batch fits, refuse a
forced group over the budget) by wrapping the released function.

rearrange_micro_batches takes ceil(total tokens / max_token_len) micro-batches -- a lower bound, since samples are
not split -- and balances their workloads (sum of squared lengths) with Karmarkar-Karp without checking the token
budget, so a micro-batch can exceed max_token_len by up to one sample; it also asserts only that each sample fits,
so a forced group (force_group_size > 1) over the budget is accepted whole. The budget is what the user sizes GPU
memory with (ppo_max_token_len_per_gpu, log_prob_max_token_len_per_gpu): the overflow is a memory overrun.
"""

import argparse
import sys
import warnings

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")
from verl.utils import seqlen_balancing  # noqa: E402

original = seqlen_balancing.rearrange_micro_batches


def fixed(batch, max_token_len, *args, min_num_micro_batch=None, force_group_size=1, **kwargs):
    """The suggested fix, from outside: refuse a forced group over the budget, then raise the count until every
    micro-batch holds at most max_token_len tokens (verl 0.9.1 does this inside the function)."""
    lens = batch["attention_mask"].sum(-1)
    groups = lens.view(-1, force_group_size).sum(-1)
    if int(groups.max()) > max_token_len:
        raise ValueError(f"A forced group exceeds max_token_len: {int(groups.max())} > {max_token_len}")
    count = min_num_micro_batch or 1
    while True:
        micro, idx = original(batch, max_token_len, *args, min_num_micro_batch=count,
                              force_group_size=force_group_size, **kwargs)
        if all(int(lens[i].sum()) <= max_token_len for i in idx):
            return micro, idx
        count += 1


parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
rearrange = fixed if parser.parse_args().fixed else original


def batch_of(lengths, width):
    mask = (torch.arange(width) < torch.tensor(lengths).unsqueeze(1)).long()
    return TensorDict({"input_ids": torch.ones(len(lengths), width, dtype=torch.long), "attention_mask": mask},
                      batch_size=[len(lengths)])


failed = False
for lengths, budget in (([7] * 8, 8), ([30_720] * 16, 32_768)):
    batch = batch_of(lengths, max(lengths))
    micro, idx = rearrange(batch, max_token_len=budget)
    tokens = [int(m["attention_mask"].sum()) for m in micro]
    over = max(tokens) > budget
    print(f"{len(lengths)} samples of {lengths[0]} tokens, max_token_len={budget}: {len(micro)} micro-batches, the "
          f"largest holds {max(tokens)} tokens ({max(tokens) / budget:.2f}x the budget) -> {'FAIL' if over else 'ok'}")
    failed |= over

batch = batch_of([3, 3], 3)  # one forced group (force_group_size=2) of 6 tokens, budget 4: each sample fits
try:
    micro, _ = rearrange(batch, max_token_len=4, force_group_size=2)
    tokens = max(int(m["attention_mask"].sum()) for m in micro)
    print(f"a forced group of 2 x 3 tokens, max_token_len=4: accepted, a micro-batch of {tokens} tokens -> FAIL")
    failed = True
except (ValueError, AssertionError) as exc:
    print(f"a forced group of 2 x 3 tokens, max_token_len=4: refused ({type(exc).__name__}: {exc}) -> ok")
sys.exit(1 if failed else 0)
