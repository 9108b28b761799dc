"""verl 0.9.1 distillation_loss (forward_kl_topk): a micro-batch whose response tokens are all masked raises.

Needs: pip install torch tensordict verl==0.9.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies the
suggested fix (the masked metrics skipped for an empty selection) by wrapping the released loss function and metric
helper.

verl.trainer.distillation.losses.compute_forward_kl_topk logs student_mass[response_mask].min() and .max() (and the
teacher's): a micro-batch with no loss token (a sample whose response mask is all 0, alone in its micro-batch under
micro batch size 1 or dynamic batching: an overlong or filtered response, a multi-turn sample of tool tokens only) has
an empty selection, and torch's min() of an empty tensor raises, so the step stops. Every other loss of the step takes
such a micro-batch (its loss is 0).
"""

import argparse
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from tensordict import TensorDict  # noqa: E402
from verl.trainer.distillation import losses  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
if parser.parse_args().fixed:
    released_topk, released_range = losses.DISTILLATION_LOSS_REGISTRY["forward_kl_topk"], \
        losses.compute_distillation_loss_range

    def guarded_topk(config, distillation_config, model_output, data):
        """The fix: a micro-batch without a loss token has no masked metrics to log (its per-token losses still
        reach agg_loss, which weighs them by the all-0 mask)."""
        if bool(data["response_mask"].values().any()):
            return released_topk(config, distillation_config, model_output, data)
        kl = losses.no_padding_2_padding(model_output["distillation_losses"], data).clamp_min(0.0)
        return kl, {}

    def guarded_range(distillation_losses, response_mask):
        return released_range(distillation_losses, response_mask) if bool(response_mask.values().any()) else {}

    losses.DISTILLATION_LOSS_REGISTRY["forward_kl_topk"] = guarded_topk
    losses.compute_distillation_loss_range = guarded_range


def nested(values, lengths):
    return torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, *lengths]).cumsum(0))


# one sample: prompt of 2 tokens, response of 2 tokens whose loss mask is all 0
data = TensorDict({"input_ids": nested(torch.tensor([3, 1, 4, 1]), [4]), "prompts": nested(torch.tensor([3, 1]), [2]),
                   "responses": nested(torch.tensor([4, 1]), [2]),
                   "response_mask": nested(torch.tensor([0, 0]), [2])}, batch_size=[1])
tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=4, global_batch_size=2)  # the mini-batch's facts
outputs = {key: nested(torch.rand(4, requires_grad=True), [4]) for key in
           ("log_probs", "distillation_losses", "student_mass", "teacher_mass")}
config = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1)
distillation = DistillationConfig(enabled=False, distillation_loss=DistillationLossConfig(
    loss_mode="forward_kl_topk", topk=2, use_policy_gradient=False))
try:
    loss, _ = losses.distillation_loss(config, distillation, outputs, data)
    print(f"micro-batch without a loss token: loss {loss.item():.6f}")
    print("ok")
    sys.exit(0)
except RuntimeError as exc:
    print(f"micro-batch without a loss token: RuntimeError: {exc}")
    print("FAIL")
    sys.exit(1)
