"""verl 0.7.1 FSDP engine: the padded attention mask is built from the response-only loss_mask (verl issue #6278).

Needs: pip install torch tensordict verl==0.7.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies
the suggested fix (the mask from the sequences' own lengths, as PR #6345 does) by wrapping the released method.

With use_remove_padding=False FSDPEngineWithLMHead.prepare_model_inputs builds attention_mask from
torch.ones_like(t) for t in loss_mask: r_i ones per row (the response length) instead of n_i (prompt + response),
so the model attends to the first r_i tokens only and every later token's log-prob is computed without part of its
context. F05 is the same code in the TorchTitan and Automodel engines of 0.9.1.
"""

import argparse
import sys
import warnings
from types import SimpleNamespace

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
prepare = FSDPEngineWithLMHead.prepare_model_inputs
if parser.parse_args().fixed:
    released = prepare

    def prepare(self, micro_batch):
        """The suggested fix: the padded mask covers each whole sequence (its input_ids length)."""
        model_inputs, output_args = released(self, micro_batch)
        if not micro_batch.get_non_tensor("use_remove_padding", True):
            lens = micro_batch["input_ids"].offsets().diff()
            width = model_inputs["attention_mask"].shape[1]
            model_inputs["attention_mask"] = (torch.arange(width) < lens.unsqueeze(1)).to(torch.int32)
        return model_inputs, output_args

PROMPTS, RESPONSES = (6, 3), (2, 4)  # two samples: 8 and 7 tokens, the responses 2 and 4 of them
nest = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
seqs = [torch.arange(1, p + r + 1) for p, r in zip(PROMPTS, RESPONSES)]
batch = TensorDict({"input_ids": nest(seqs), "position_ids": nest([torch.arange(len(s)) for s in seqs]),
                    "loss_mask": nest([torch.ones(r, dtype=torch.long) for r in RESPONSES])}, batch_size=[2])
for key, value in (("temperature", 1.0), ("use_remove_padding", False)):
    tu.assign_non_tensor_data(batch, key, value)
engine = SimpleNamespace(use_ulysses_sp=False, module=SimpleNamespace(config=SimpleNamespace()))
model_inputs, _ = prepare(engine, batch)
mask = model_inputs["attention_mask"]
want = (torch.arange(mask.shape[1]) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).to(mask.dtype)
ok = torch.equal(mask, want)
print(f"padded attention_mask rows {mask.tolist()}, expected {want.tolist()} -> {'ok' if ok else 'FAIL'}")
sys.exit(0 if ok else 1)
