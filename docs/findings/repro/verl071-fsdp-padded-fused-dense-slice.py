"""verl 0.7.1 FSDP engine: padded (use_remove_padding=False) + fused kernels return dense response slices, and
the actor's loss cannot read them.

Needs: pip install torch tensordict verl==0.7.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies
the suggested fix (nested full-sequence outputs, as the other paths return and PR #6846 made this one) by wrapping
the released method.

prepare_model_outputs' padded fused branch returns output.log_probs[:, -response_length - 1 : -1] with
response_length the max_response_length flag (default 1024): a dense (B, <= L - 1) tensor where every other path
returns nested full sequences. ppo_loss then calls no_padding_2_padding(log_probs, data), which asserts that the
values cover every token of the micro-batch: AssertionError, the step fails. F06 is the same branch in the
Automodel engine of 0.9.1.
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
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

nest = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
prepare = FSDPEngineWithLMHead.prepare_model_outputs
if parser.parse_args().fixed:
    released = prepare

    def prepare(self, output, output_args, micro_batch):
        """The suggested fix: padded fused outputs nested per sequence, like every other path."""
        if micro_batch.get_non_tensor("use_remove_padding", True) or not micro_batch.get_non_tensor(
                "use_fused_kernels", False):
            return released(self, output, output_args, micro_batch)
        lens = micro_batch["input_ids"].offsets().diff().tolist()
        return {key: nest([getattr(output, key)[i, :n] for i, n in enumerate(lens)]) for key in ("log_probs", "entropy")}

PROMPTS, RESPONSES = (2, 1), (1, 2)
seqs = [torch.arange(1, p + r + 1) for p, r in zip(PROMPTS, RESPONSES)]
batch = TensorDict({"input_ids": nest(seqs), "prompts": nest([s[:p] for s, p in zip(seqs, PROMPTS)]),
                    "responses": nest([s[p:] for s, p in zip(seqs, PROMPTS)]),
                    "attention_mask": nest([torch.ones_like(s) for s in seqs])}, batch_size=[2])
for key, value in (("use_remove_padding", False), ("use_fused_kernels", True), ("calculate_entropy", True)):
    tu.assign_non_tensor_data(batch, key, value)
L = max(len(s) for s in seqs)
log_probs = -0.1 * torch.arange(1.0, 2 * L + 1).view(2, L)  # the fused model's (B, L) log-probs
output = SimpleNamespace(log_probs=log_probs, entropy=log_probs.abs())
engine = SimpleNamespace(use_ulysses_sp=False, engine_config=SimpleNamespace(entropy_checkpointing=False))
outputs = prepare(engine, output, {"temperature": torch.ones(2)}, batch)
got = outputs["log_probs"]
print(f"padded + fused log_probs: {'nested' if got.is_nested else 'dense'} {tuple(got.shape)} "
      f"(the other paths: nested over the {sum(len(s) for s in seqs)} tokens)")
try:  # what ppo_loss does with them
    sliced = no_padding_2_padding(got, batch)
    want = torch.stack([torch.nn.functional.pad(log_probs[i, p - 1:p + r - 1], (0, max(RESPONSES) - r))
                        for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES))])
    ok = torch.equal(sliced, want)
    print(f"no_padding_2_padding (ppo_loss): response log-probs {sliced.tolist()} -> {'ok' if ok else 'FAIL'}")
except AssertionError as exc:
    print(f"no_padding_2_padding (ppo_loss): AssertionError {exc} -> FAIL")
    ok = False
sys.exit(0 if ok else 1)
