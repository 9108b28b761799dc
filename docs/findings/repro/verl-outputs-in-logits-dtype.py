"""verl 0.9.1 model engine: bf16 logits give bf16 entropy, bf16 temperature-scaled logits and (on the torch path)
bf16 log-probs.

Needs: pip install torch tensordict verl==0.9.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies
the suggested fix (upcast the model's logits to float32 before scaling) by wrapping the released helper.

The FSDP engine's prepare_model_outputs (and TorchTitan's, Automodel's) scales the model's logits with
_scale_logits_by_temperature -- logits / temperature.clamp(min=1e-8).to(logits.dtype), in the logits' dtype -- and
takes verl_F.entropy_from_logits and logprobs_from_logits on the result. With a model that returns bf16 logits
(Hugging Face causal LMs under bf16 no longer upcast), the scaled logits are rounded to bf16, the entropy is computed
and returned in bf16, and the log-probs too where logprobs_from_logits takes its torch path
(logprobs_from_logits_v2: a per-row log_softmax in bf16): no flash-attn, VERL_DISABLE_FLASH_ATTN_CE=1 (verl's switch
for bitwise-reproducible log-probs), or a machine without CUDA. flash-attn's cross-entropy kernel computes in float32
from the bf16 scaled logits. Gaussian logits (std 3), 151,936 ids, 64 tokens, cast to bf16 as a bf16 model returns them.
"""

import argparse
import os
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
os.environ.setdefault("VERL_DISABLE_FLASH_ATTN_CE", "1")  # the torch path, as without flash-attn
import verl.workers.engine.fsdp.transformer_impl as fsdp_impl  # noqa: E402
from verl.utils import torch_functional as verl_F  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
if parser.parse_args().fixed:
    released = fsdp_impl._scale_logits_by_temperature

    def _scale_logits_by_temperature(logits, temperature, *, is_unit_temperature):
        """The suggested fix: scale (and compute everything after) in float32."""
        return released(logits.float(), temperature, is_unit_temperature=is_unit_temperature)

    fsdp_impl._scale_logits_by_temperature = _scale_logits_by_temperature

VOCAB, TOKENS = 151_936, 64
gen = torch.Generator().manual_seed(0)
logits = (3.0 * torch.randn(TOKENS, VOCAB, generator=gen)).to(torch.bfloat16)  # packed (total_nnz, V)
labels = torch.randint(0, VOCAB, (TOKENS,), generator=gen)
failed = False
for T in (1.0, 0.6):
    temperature = torch.full((TOKENS, 1), T)  # temperature_rmpad.unsqueeze(-1), as the engine divides
    scaled = fsdp_impl._scale_logits_by_temperature(logits, temperature, is_unit_temperature=T == 1.0)
    got_lp = verl_F.logprobs_from_logits(scaled, labels)
    got_ent = verl_F.entropy_from_logits(scaled)
    ref = torch.log_softmax(logits.double() / T, dim=-1)  # float64 from the same bf16 logits
    err_lp = (got_lp.double() - ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)).abs()
    err_ent = (got_ent.double() - (-(ref.exp() * ref).sum(-1))).abs()
    # what flash-attn's cross-entropy (float32 inside) would return from the same scaled logits: the bf16 scaling alone
    flash_like = torch.log_softmax(scaled.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    err_scaled = (flash_like - ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)).abs().max()
    ok = got_lp.dtype == got_ent.dtype == torch.float32 and err_lp.max() < 1e-4 and err_ent.max() < 1e-3
    print(f"T={T}: log-probs {str(got_lp.dtype)[6:]}, max |error| {err_lp.max():.3g} nats (importance ratio off by up "
          f"to {err_lp.max().exp() - 1:.2%}); entropy {str(got_ent.dtype)[6:]}, max |error| {err_ent.max():.3g} nats "
          f"(float32 log-probs of the scaled logits, as with flash-attn: max |error| {err_scaled:.3g}) "
          f"-> {'ok' if ok else 'FAIL'}")
    failed |= not ok
sys.exit(1 if failed else 0)
