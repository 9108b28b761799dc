"""verl 0.7.1 FSDPEngineWithValueHead: values keep a trailing 1 ((B, j, 1), not (B, j)) on two paths, and the
critic's value loss is then wrong or fails.

Needs: pip install torch tensordict verl==0.7.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies
the suggested fix (squeeze the trailing 1 on both paths) by wrapping the released method.

prepare_model_outputs of the value engine squeezes the (total_nnz, 1) head output only for a token-classifier
model in the packed path (use_remove_padding=True). The padded path (use_remove_padding=False) of a
token-classifier critic narrows output.logits (B, L, 1) and keeps the 1; the packed path of a v_head critic
(trl's AutoModelForCausalLMWithValueHead) reads output[2].squeeze(0).unsqueeze(-1) and keeps it too. value_loss
then slices the response with F.pad(values, (0, pad)), which pads the last axis: with unequal response lengths the
rows cannot be stacked (RuntimeError), with equal ones vpreds are (B, R, 1) and broadcast against (B, R) returns in
compute_value_loss -- a loss over R x R pairs, silently.
"""

import argparse
import sys
import warnings
from types import SimpleNamespace

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead  # noqa: E402
from verl.workers.utils.losses import value_loss  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
if parser.parse_args().fixed:
    released = FSDPEngineWithValueHead.prepare_model_outputs

    def prepare_model_outputs(self, output, output_args, micro_batch):
        """The suggested fix: the values nested as (B, j), whatever the head's trailing 1."""
        values = released(self, output, output_args, micro_batch)["values"]
        flat = values.values()
        if flat.dim() == 2 and flat.shape[-1] == 1:
            values = torch.nested.nested_tensor_from_jagged(flat.squeeze(-1), values.offsets())
        return {"values": values}

    FSDPEngineWithValueHead.prepare_model_outputs = prepare_model_outputs


def batch(prompt_len, response_len, remove_padding):
    """A critic micro-batch of one sample as the engine gets it: nested ids, the rollout's values and returns."""
    seq = torch.arange(1, prompt_len + response_len + 1)
    nest = lambda t: torch.nested.as_nested_tensor([t], layout=torch.jagged)  # noqa: E731
    td = TensorDict({
        "input_ids": nest(seq), "prompts": nest(seq[:prompt_len]), "responses": nest(seq[prompt_len:]),
        "attention_mask": nest(torch.ones_like(seq)),
        "values": torch.zeros(1, response_len), "returns": torch.arange(1.0, response_len + 1).unsqueeze(0),
        "response_mask": torch.ones(1, response_len, dtype=torch.long),
    }, batch_size=[1])
    tu.assign_non_tensor_data(td, "use_remove_padding", remove_padding)
    return td


def head_output(n, remove_padding, v_head):
    """The critic model's output over the n tokens: value 0.1 * position."""
    v = 0.1 * torch.arange(n, dtype=torch.float32).unsqueeze(0)  # (1, n)
    return (None, None, v) if v_head else SimpleNamespace(logits=v.unsqueeze(-1))  # v_head: (1, n); else (1, n, 1)


P, R = 2, 3
config = SimpleNamespace(cliprange_value=100.0, loss_agg_mode="token-mean")
vpreds = 0.1 * torch.arange(P - 1, P + R - 1, dtype=torch.float32)  # the values that predict the R response tokens
want = 0.5 * ((vpreds - torch.arange(1.0, R + 1)) ** 2).mean().item()  # 0.5 * token-mean of (vpred - return)^2
failed = False
for name, remove_padding, v_head in (("token-classifier critic, padded (use_remove_padding=False)", False, False),
                                     ("v_head critic, packed (use_remove_padding=True)", True, True),
                                     ("token-classifier critic, packed (use_remove_padding=True)", True, False)):
    engine = SimpleNamespace(module=SimpleNamespace(v_head=None) if v_head else SimpleNamespace(), use_ulysses_sp=False)
    td = batch(P, R, remove_padding)
    out = FSDPEngineWithValueHead.prepare_model_outputs(engine, head_output(P + R, remove_padding, v_head), {}, td)
    shape = tuple(out["values"].values().shape)
    loss, _ = value_loss(config, out, td)
    ok = abs(loss.item() - want) < 1e-5
    print(f"{name}: values {shape}, value loss {loss.item():.4f} (expected {want:.4f}) -> {'ok' if ok else 'FAIL'}")
    failed |= not ok
sys.exit(1 if failed else 0)
