"""OpenRLHF 0.11.2: compute_entropy = logsumexp(z) - sum(softmax(z) * z) cancels in float32 (low temperature).

Needs: pip install torch openrlhf==0.11.2 (--no-deps is enough: transformers, peft, deepspeed and flash-attn's CUDA
parts are stubbed below when missing, flash-attn's bert_padding too: the padded path run here never calls it).
Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies the suggested fix (-sum(p * log_softmax(z))) by
monkeypatch.

The entropy the actor logs (return_entropy=True) is the difference of two float32 terms of size |z| = |logits| / T;
when the entropy is small next to them its digits are lost: two tied top logits (entropy ln 2) come out 0.6875 at
T = 1e-6 and 0 at T = 1e-8, and on a 152k vocabulary at T = 0.05 confident tokens read entropy 0.
"""

import argparse
import importlib.abc
import importlib.machinery
import sys
from unittest import mock


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Module-level imports of openrlhf.models that are not installed (transformers, peft, deepspeed, flash-attn's
    CUDA parts, the math grader's pylatexenc) become MagicMock modules, as verl's CPU tests stub them; nothing of
    OpenRLHF itself is replaced. Installed packages import for real (this finder is asked last)."""

    ROOTS = ("transformers", "peft", "deepspeed", "pylatexenc")
    #: flash-attn's CUDA package and its ring-attention all_gather only: flash_attn.ops stays missing, so
    #: log_probs_from_logits takes its torch fallback as on any machine without flash-attn
    NAMES = ("flash_attn", "flash_attn.utils", "flash_attn.utils.distributed")

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.ROOTS or name in self.NAMES:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


try:  # flash-attn's pure-torch padding helpers: flash-attn itself, or its bert_padding.py copied alone
    import flash_attn.bert_padding  # noqa: F401
except ImportError:
    try:
        import flash_attn_bert_padding

        sys.modules["flash_attn.bert_padding"] = flash_attn_bert_padding
    except ImportError:  # the padded path run here never calls them: stubbed with the rest
        _Stubs.NAMES += ("flash_attn.bert_padding",)
sys.meta_path.append(_Stubs())

import math  # noqa: E402

import torch  # noqa: E402

import openrlhf.models.actor as actor_module  # noqa: E402
from openrlhf.models.actor import Actor  # noqa: E402


class Out(dict):
    __getattr__ = dict.get

    def __setattr__(self, key, value):
        self[key] = value


def fixed_entropy(logits):
    """The suggested fix: sum -p log p from one log_softmax (no difference of two large terms)."""
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
if parser.parse_args().fixed:
    actor_module.compute_entropy = fixed_entropy
torch._dynamo.config.suppress_errors = True  # compute_entropy is @torch.compile'd: eager if no compiler is here


def entropy(logits, temperature):
    """The entropy Actor.forward logs, for (1, L, V) model logits."""
    actor = Actor(lambda *a, **k: Out(logits=logits.clone()), temperature=temperature)
    actor.packing_samples, actor.is_vlm = False, False
    output = actor(torch.zeros(1, logits.shape[1], dtype=torch.long), attention_mask=torch.ones(1, logits.shape[1]),
                   return_output=True, return_entropy=True)
    return output.entropy[0, 0].double()


def exact(logits, temperature):
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)[0, 0]


failed = False
tied = torch.tensor([[[1.0, 1.0, 0.0, -1.0], [0.0, 0.0, 0.0, 0.0]]])  # two tied top logits: entropy ln 2
for temperature in (1e-2, 1e-6, 1e-8):
    got = entropy(tied, temperature)
    ok = abs(got - math.log(2)) < 1e-4
    print(f"tied top logits, T={temperature}: entropy {got.item():.6f}, exact {math.log(2):.6f} -> {'ok' if ok else 'FAIL'}")
    failed |= not ok

# Gaussian logits (std 3) over a 151,936-id vocabulary at T = 0.05, 64 tokens: per-token error against float64
V, T, TOKENS = 151_936, 0.05, 64
big = 3.0 * torch.randn(1, TOKENS + 1, V, generator=torch.Generator().manual_seed(0))
actor = Actor(lambda *a, **k: Out(logits=big.clone()), temperature=T)
actor.packing_samples, actor.is_vlm = False, False
got = actor(torch.zeros(1, TOKENS + 1, dtype=torch.long), attention_mask=torch.ones(1, TOKENS + 1),
            return_output=True, return_entropy=True).entropy[0].double()
logp = torch.log_softmax(big[0, :TOKENS].double() / T, -1)
want = -(logp.exp() * logp).sum(-1)
err = (got - want).abs()
i = int(want.argmin())
ok = bool((err <= 1e-5 + 1e-2 * want).all())  # float32 -sum(p log p) stays within 1e-5 here
print(f"V={V}, T={T}: per-token |error| up to {err.max().item():.2g} nats (mean entropy {got.mean().item():.6f}, exact "
      f"{want.mean().item():.6f}); most confident token: {got[i].item():.3g}, exact {want[i].item():.3g} -> "
      f"{'ok' if ok else 'FAIL'}")
failed |= not ok
sys.exit(1 if failed else 0)
