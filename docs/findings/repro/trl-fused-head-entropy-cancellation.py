"""TRL 1.16.0: the fused LM head's entropy cancels in float32 at low temperature.

Needs: pip install torch trl==1.16.0. Exit 1 while the bug is present, 0 once fixed.

GRPO's fused LM head (trl.kernels.ChunkedLogProbFunction, add_fused_lm_head) computes the entropy as
log_z - sum(exp(s) * s) / sum(exp(s)) from online sums in float32: two large, nearly equal terms at low
temperature. Two tied top logits: the true entropy is ln 2 whatever the temperature.
"""

import math
import sys

import torch

from trl.kernels import ChunkedLogProbFunction

z = torch.tensor([[1.0, 1.0, 0.0, -1.0]])  # identity head: hidden states = logits
failed = False
for temperature in (1e-2, 1e-4, 1e-6, 1e-8):
    _, ent, *_ = ChunkedLogProbFunction.apply(z, torch.eye(4), None, torch.tensor([0]), temperature, 32768, None, 1.0,
                                              ("log_probs", "entropy"))
    s = z.double() / temperature
    exact = float(-(torch.softmax(s, -1) * torch.log_softmax(s, -1)).sum(-1))
    ok = abs(ent.item() - exact) < 1e-4
    print(f"T={temperature}: entropy got {ent.item():.6g}, expected {exact:.6g} (ln 2 = {math.log(2):.6g}) -> {'ok' if ok else 'FAIL'}")
    failed |= not ok
sys.exit(1 if failed else 0)
