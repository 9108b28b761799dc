"""OpenRLHF 0.11.2: Actor.forward divides the logits by its temperature with no floor (T below 1e-8: log-probs grow as
1/T; T = 0: NaN).

Needs: pip install torch openrlhf==0.11.2 (--no-deps is enough: transformers, peft, deepspeed and flash-attn's CUDA
parts are stubbed below when missing, flash-attn's bert_padding too: the padded path run here never calls it).
Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies the suggested fix (clamp at 1e-8).

output["logits"].div_(self.temperature) takes the temperature as configured; verl's engines and the contract clamp
it at 1e-8, so T = 5e-9 gives log-probs twice the clamped ones and T = 0 gives inf logits and NaN log-probs.
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

import torch  # noqa: E402

from openrlhf.models.actor import Actor  # noqa: E402


class Out(dict):
    __getattr__ = dict.get

    def __setattr__(self, key, value):
        self[key] = value


parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix (clamp at 1e-8) before running")
fixed = parser.parse_args().fixed

logits = torch.tensor([[[0.0, 1.0, 3.0], [0.0, 1.0, 3.0]]])
sequences = torch.tensor([[2, 1]])  # the log-prob of token 1 after token 2
failed = False
for temperature in (0.0, 5e-9):
    actor = Actor(lambda *a, **k: Out(logits=logits.clone()), temperature=temperature)
    actor.packing_samples, actor.is_vlm = False, False
    if fixed:  # the suggested fix: output["logits"].div_(max(self.temperature, 1e-8))
        actor.temperature = max(temperature, 1e-8)
    got = actor(sequences, attention_mask=torch.ones(1, 2, dtype=torch.long), return_logprobs=True)[0, 0]
    clamped = torch.log_softmax(logits[0, 0].double() / max(temperature, 1e-8), -1)[1]
    ok = bool(torch.isfinite(got)) and torch.allclose(got.double(), clamped, rtol=1e-5)
    print(f"T={temperature}: log-prob got {got.item():.6g}, with the 1e-8 clamp {clamped.item():.6g} -> "
          f"{'ok' if ok else 'FAIL'}")
    failed |= not ok
sys.exit(1 if failed else 0)
