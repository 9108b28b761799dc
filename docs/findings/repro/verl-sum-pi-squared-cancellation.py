"""verl 0.9.1: calculate_sum_pi_squared_from_logits cancels in float32 (low temperature, large vocabulary).

Needs: pip install torch tensordict verl==0.9.1. Exit 1 while the bug is present, 0 once fixed.

With actor.calculate_sum_pi_squared=True (the Optimal Token Baseline), the FSDP engine returns
sum_pi_squared = exp(logsumexp(2z) - 2 logsumexp(z)) per token, two large float32 terms whose difference
is the result's logarithm; the trainer then forms w_t = 1 - 2 pi_t + sum_pi_squared (ray_trainer.py), a small
number for a confident token, where the error lands in full. Gaussian logits (std 3, seed 0), 151,936 ids, T = 0.02.
"""

import sys

import torch

from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits

VOCAB, TOKENS, TEMPERATURE = 151_936, 64, 0.02
logits = 3.0 * torch.randn(TOKENS, VOCAB, generator=torch.Generator().manual_seed(0))
z = logits / TEMPERATURE

got = calculate_sum_pi_squared_from_logits(z).double()
p64 = torch.softmax(z.double(), dim=-1)
exact = (p64 * p64).sum(-1)
fixed = (torch.softmax(z, dim=-1) ** 2).sum(-1).double()  # the suggested float32 fix: sum(softmax(z) ** 2)

top = p64.max(-1).values  # the sampled token is the top one here
w_got, w_exact, w_fixed = 1 - 2 * top + got, 1 - 2 * top + exact, 1 - 2 * top + fixed
confident = w_exact > 1e-4  # tokens whose weight is not (numerically) zero
rel = torch.where(confident, (w_got - w_exact).abs() / w_exact, torch.zeros_like(w_exact))
worst = int(rel.argmax())
print(f"sum_pi_squared: max |error| verl {(got - exact).abs().max():.3g}, float32 sum(p**2) {(fixed - exact).abs().max():.3g}")
print(f"OTB weight w = 1 - 2 pi + sum_pi_squared: token-mean verl {w_got.mean():.6g}, exact {w_exact.mean():.6g} "
      f"({(w_got.mean() - w_exact.mean()) / w_exact.mean() * 100:+.3g}%); worst token {worst}: verl {w_got[worst]:.4g}, "
      f"exact {w_exact[worst]:.4g} ({rel[worst] * 100:.3g}% off); float32 sum(p**2) worst "
      f"{torch.where(confident, (w_fixed - w_exact).abs() / w_exact, torch.zeros_like(w_exact)).max() * 100:.3g}%")
bad = (got - exact).abs() > 10 * (fixed - exact).abs().max()
if bool(bad.any()):
    print(f"FAIL: {int(bad.sum())} of {TOKENS} tokens' sum_pi_squared off by more than 10x a correct float32 evaluation")
    sys.exit(1)
print("PASS")
