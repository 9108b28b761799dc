"""TRL 1.16.0: selective_log_softmax and entropy_from_logits compute in the logits' dtype (bf16/fp16).

Needs: pip install torch trl==1.16.0. Exit 1 while the bug is present, 0 once fixed.

trl.trainer.utils.selective_log_softmax (used by GRPO, RLOO, PPO, DPO, ...) takes a per-row log_softmax in the
logits' own dtype for anything but float32/float64, and entropy_from_logits likewise; models that return bf16
logits (most Hugging Face models under bf16 training) get bf16 log-probs and entropies. Gaussian logits (std 3),
152,064 ids (Qwen2.5's padded vocabulary), 64 tokens, cast to bfloat16 as a bf16 model returns them.
"""

import sys

import torch

from trl.trainer.utils import entropy_from_logits, selective_log_softmax

VOCAB, TOKENS = 152_064, 64
gen = torch.Generator().manual_seed(0)
logits = (3.0 * torch.randn(1, TOKENS, VOCAB, generator=gen)).to(torch.bfloat16)
labels = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)

ref = torch.log_softmax(logits.double(), dim=-1)  # float64 on the same (bf16-valued) logits
want_lp = ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
want_ent = -(ref.exp() * ref).sum(-1)
got_lp = selective_log_softmax(logits, labels)
got_ent = entropy_from_logits(logits)
err_lp = (got_lp.double() - want_lp).abs()
err_ent = (got_ent.double() - want_ent).abs()
print(f"log-probs dtype {got_lp.dtype}: max |error| {err_lp.max():.3g} nats (mean {err_lp.mean():.3g}); "
      f"importance ratio exp(error) up to {err_lp.max().exp():.4f}")
print(f"entropy dtype {got_ent.dtype}: max |error| {err_ent.max():.3g} nats (mean {err_ent.mean():.3g})")
ok = got_lp.dtype == torch.float32 and float(err_lp.max()) < 1e-4 and float(err_ent.max()) < 1e-3
print("ok" if ok else "FAIL: outputs in bf16, off by far more than a float32 evaluation of the same logits")
sys.exit(0 if ok else 1)
