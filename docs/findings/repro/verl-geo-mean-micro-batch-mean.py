"""verl 0.9.1 compute_policy_loss_geo_mean (GMPO): each micro-batch's loss is the mean over its own sequences, so the
loss and gradient of a mini-batch grow with the number of micro-batches it is cut into.

Needs: pip install torch verl==0.9.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies the suggested
fix (the sequences' losses summed and divided by the mini-batch's samples on every rank, times dp_size, as agg_loss's
seq-mean modes do with the global facts the engine hands each micro-batch) around the released function.

Every other policy loss of verl's ppo_loss ends with agg_loss(..., **config.global_batch_info): the micro-batch's
losses divided by facts of the whole mini-batch (global_batch_size, batch_num_tokens, dp_size), and the FSDP engine's
forward_backward_batch backpropagates each micro-batch's loss as it is, gradients accumulating. geo_mean ends with
pg_loss = torch.mean(pg_losses): the mean over the micro-batch's own sequences. A mini-batch of two sequences cut into
two one-sample micro-batches gives the sum of two means, twice the mean of the mini-batch (verl issue #7913).
"""

import argparse
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
fixed = parser.parse_args().fixed
released = core_algos.compute_policy_loss_geo_mean


def geo_mean(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
             rollout_is_weights=None):
    """The fix, stated around the released function: its mean over the micro-batch's B sequences, times B, is their
    sum; divided by the mini-batch's samples on every rank (global_batch_size) and times dp_size, as agg_loss does."""
    loss, metrics = released(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                             rollout_is_weights)
    info = config.global_batch_info
    if fixed and info.get("global_batch_size"):
        loss = loss * log_prob.shape[0] / info["global_batch_size"] * info.get("dp_size", 1)
    return loss, metrics


config = FSDPActorConfig(strategy="fsdp", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
                         clip_ratio=0.2, policy_loss=PolicyLossConfig(loss_mode="geo_mean"))
config.global_batch_info.update(dp_size=1, global_batch_size=2, batch_num_tokens=5)  # what ppo_loss sets
# two sequences of 1 and 4 response tokens, on policy (ratio 1), sequence advantages 1.0 and -0.5
log_prob = torch.tensor([[-1.0, 0.0, 0.0, 0.0], [-0.5, -1.5, -0.25, -2.0]], requires_grad=True)
old = log_prob.detach().clone()
advantages = torch.tensor([[1.0, 0.0, 0.0, 0.0], [-0.5, -0.5, -0.5, -0.5]])
mask = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])

whole, _ = geo_mean(old, log_prob, advantages, mask, config=config)  # the uncut mini-batch
(grad_whole,) = torch.autograd.grad(whole, log_prob)
# cut into two one-sample micro-batches, their losses backpropagated one after the other (gradient accumulation)
parts = sum(geo_mean(old[i:i + 1], log_prob[i:i + 1], advantages[i:i + 1], mask[i:i + 1], config=config)[0]
            for i in range(2))
(grad_parts,) = torch.autograd.grad(parts, log_prob)
print(f"uncut mini-batch: loss {whole.item():.6f}, gradient of sample 1's first token {grad_whole[1, 0].item():.6f}")
print(f"two micro-batches: loss {parts.item():.6f}, gradient of sample 1's first token {grad_parts[1, 0].item():.6f} "
      f"({grad_parts[1, 0].item() / grad_whole[1, 0].item():.1f}x)")
failed = not (torch.allclose(whole, parts) and torch.allclose(grad_whole, grad_parts))
print("FAIL" if failed else "ok")
sys.exit(1 if failed else 0)
