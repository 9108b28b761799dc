"""TRL 1.16.0: the logits are divided by the temperature without a floor (T = 0 gives NaN log-probs).

Needs: pip install torch trl==1.16.0. Exit 1 while the bug is present, 0 once fixed.

GRPO / SDFT scale logits as logits / self.temperature and score them with selective_log_softmax; there is no
clamp at 1e-8 (verl's FSDP engine and vLLM-style samplers clamp), so T = 0 gives +-inf logits and NaN log-probs,
and T below 1e-8 gives log-probs that grow as 1/T.
"""

import sys

import torch

from trl.trainer.utils import selective_log_softmax

logits = torch.tensor([[[0.0, 1.0, 3.0]]])
labels = torch.tensor([[1]])
failed = False
for temperature in (0.0, 5e-9):
    got = selective_log_softmax(logits / temperature, labels)  # as GRPOTrainer scales them
    clamped = torch.log_softmax(logits.double() / max(temperature, 1e-8), -1)[..., 1]
    ok = bool(torch.isfinite(got).all()) and torch.allclose(got.double(), clamped, rtol=1e-5)
    print(f"T={temperature}: log-prob got {got.item()}, with the 1e-8 clamp {clamped.item():.6g} -> {'ok' if ok else 'FAIL'}")
    failed |= not ok
sys.exit(1 if failed else 0)
