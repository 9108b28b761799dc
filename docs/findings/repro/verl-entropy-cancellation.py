"""verl 0.9.1: entropy_from_logits loses the digits of small entropies in float32 (low temperature, large vocabulary).

Needs: pip install torch tensordict verl==0.9.1. Exit 1 while the bug is present, 0 once fixed.

verl's FSDP, VeOmni, TorchTitan and Automodel engines compute the per-token entropy with
verl.utils.torch_functional.entropy_from_logits on the temperature-scaled float32 logits. It evaluates
logsumexp(z) - sum(softmax(z) * z): two large, nearly equal float32 numbers whose difference is the
(small) entropy. Here: Gaussian logits (std 3, seed 0) over a 151,936-id vocabulary (Qwen2's), T = 0.05.
"""

import sys

import torch

from verl.utils.torch_functional import entropy_from_logits

VOCAB, TOKENS, TEMPERATURE = 151_936, 64, 0.05
logits = 3.0 * torch.randn(TOKENS, VOCAB, generator=torch.Generator().manual_seed(0))
z = logits / TEMPERATURE  # float32, as the engine hands it over (logits_rmpad / temperature_rmpad)

got = entropy_from_logits(z).double()
lsm = torch.log_softmax(z.double(), dim=-1)
exact = -(lsm.exp() * lsm).sum(-1)  # float64 reference
lsm32 = torch.log_softmax(z, dim=-1)
fixed = -(lsm32.exp() * lsm32).sum(-1).double()  # the suggested float32 fix: -sum(p * log p)

err, err_fixed = (got - exact).abs(), (fixed - exact).abs()
worst = int((err / exact).argmax())
print(f"token-mean entropy: verl {got.mean():.7g}, exact {exact.mean():.7g} "
      f"({(got.mean() - exact.mean()) / exact.mean() * 100:+.3g}%); -sum(p log p) in float32: "
      f"{(fixed.mean() - exact.mean()) / exact.mean() * 100:+.3g}%")
print(f"worst token {worst}: verl {got[worst]:.6g}, exact {exact[worst]:.6g} "
      f"({(got[worst] - exact[worst]) / exact[worst] * 100:+.3g}%); max |error| verl {err.max():.3g} nats, "
      f"float32 -sum(p log p) {err_fixed.max():.3g} nats")
# A correct float32 evaluation is off by ~eps * log2(V) per token; verl's by ~eps * max|z|.
bad = err > 10 * err_fixed.max()
if bool(bad.any()):
    print(f"FAIL: {int(bad.sum())} of {TOKENS} tokens' entropy off by more than 10x a correct float32 evaluation")
    sys.exit(1)
print("PASS: entropy is as exact as float32 allows")
