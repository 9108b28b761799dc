"""verl 0.9.1 agg_loss: seq-mean-token-sum-norm's default scale is the micro-batch's padded width, so the loss and its
gradient change with how the mini-batch is cut into micro-batches.

Needs: pip install torch verl==0.9.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies the suggested
fix (a scale of the whole mini-batch: the longest response of the mini-batch, handed to every micro-batch as
``loss_scale_factor``) by wrapping the released agg_loss.

verl.trainer.ppo.core_algos.agg_loss promises a loss "invariant to fsdp/megatron parallelism": every mode divides by
facts of the whole mini-batch (batch_num_tokens, global_batch_size, dp_size) that the engine hands each micro-batch.
seq-mean-token-sum-norm divides once more, by loss_scale_factor, which defaults to loss_mask.shape[-1]: the padded
width of the micro-batch in hand (each micro-batch is padded to its own longest response by no_padding_2_padding
and to_padded_tensor). Two samples with responses of 1 and 4 tokens, cut into one micro-batch each (micro batch size
1, or dynamic batching, or two DP ranks), are divided by 1 and 4 instead of 4 and 4.
"""

import argparse
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from verl.trainer.ppo import core_algos  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
fixed = parser.parse_args().fixed
released = core_algos.agg_loss
MINI_BATCH_WIDTH = 4  # the mini-batch's longest response: a fact of the whole mini-batch, as global_batch_size is


def agg_loss(loss_mat, loss_mask, loss_agg_mode, *args, **kwargs):
    """The fix: without loss_scale_factor, seq-mean-token-sum-norm divides by the mini-batch's longest response."""
    if fixed and loss_agg_mode == "seq-mean-token-sum-norm" and kwargs.get("loss_scale_factor") is None:
        kwargs["loss_scale_factor"] = MINI_BATCH_WIDTH
    return released(loss_mat, loss_mask, loss_agg_mode, *args, **kwargs)


# two samples: a 1-token and a 4-token response, every token counted; one trainable per-token loss each
losses = torch.tensor([[0.5, 0.0, 0.0, 0.0], [0.25, 0.75, -0.5, 1.0]], requires_grad=True)
mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1]])
facts = {"dp_size": 1, "batch_num_tokens": 5, "global_batch_size": 2}  # what forward_backward_batch hands each

whole = agg_loss(losses, mask, "seq-mean-token-sum-norm", **facts)  # the uncut mini-batch, width 4
(grad_whole,) = torch.autograd.grad(whole, losses)
# cut into two micro-batches, each padded to its own longest response (widths 1 and 4), the losses accumulated
parts = agg_loss(losses[:1, :1], mask[:1, :1], "seq-mean-token-sum-norm", **facts) + \
    agg_loss(losses[1:], mask[1:], "seq-mean-token-sum-norm", **facts)
(grad_parts,) = torch.autograd.grad(parts, losses)
print(f"uncut mini-batch: loss {whole.item():.6f}, gradient of sample 0's token {grad_whole[0, 0].item():.6f}")
print(f"two micro-batches (widths 1 and 4): loss {parts.item():.6f}, gradient of sample 0's token "
      f"{grad_parts[0, 0].item():.6f} ({grad_parts[0, 0].item() / grad_whole[0, 0].item():.1f}x)")
failed = not (torch.allclose(whole, parts) and torch.allclose(grad_whole, grad_parts))
print("FAIL" if failed else "ok")
sys.exit(1 if failed else 0)
