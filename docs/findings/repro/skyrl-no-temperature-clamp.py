"""skyrl-train 0.3.1 and skyrl 0.4.0: HFModelWrapper.forward divides the logits by its temperature with no floor
(T below 1e-8: log-probs grow as 1/T; T = 0: NaN).

Needs: pip install torch numpy, then pip install --no-deps --ignore-requires-python skyrl-train==0.3.1 and/or
skyrl==0.4.0 (both wheels declare Python 3.12; this path runs on 3.11 too; their other imports are stubbed below when
missing). Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies the suggested fix (clamp at 1e-8).

``logits_BSV.div_(temperature)`` takes the temperature as the worker passes it (``cfg...temperature``); verl's
engines and the contract clamp it at 1e-8, so T = 5e-9 gives log-probs twice the clamped ones and T = 0 gives inf
logits and NaN log-probs.
"""

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from unittest import mock


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Module-level imports of SkyRL's modules that are not installed (transformers, peft, ray, datasets, omegaconf,
    loguru, jaxtyping, pydantic, cloudpathlib, deepspeed) become MagicMock modules, as verl's CPU tests stub them;
    nothing of SkyRL itself is replaced. Installed packages import for real (this finder is asked last)."""

    ROOTS = ("transformers", "peft", "ray", "datasets", "omegaconf", "loguru", "jaxtyping", "pydantic", "cloudpathlib",
             "deepspeed")
    #: flash-attn's package and its pure-torch bert_padding (the padded path run here never calls it); flash_attn.ops
    #: stays missing, so logprobs_from_logits takes its torch fallback as on any machine without flash-attn
    NAMES = ("flash_attn", "flash_attn.bert_padding")

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


sys.meta_path.append(_Stubs())

import torch  # noqa: E402

VERSIONS = {"skyrl_train": "skyrl-train 0.3.1", "skyrl": "skyrl 0.4.0"}


def installed(modules):
    """(version, module) for each installed SkyRL. skyrl 0.4.0's skyrl.backends package is loaded without running its
    __init__ (it re-exports the Tinker API, pydantic models that need Python 3.12 and are no part of this path)."""
    found = []
    for top, version in VERSIONS.items():
        if importlib.util.find_spec(top) is None:
            continue
        if top == "skyrl" and "skyrl.backends" not in sys.modules:
            sys.modules["skyrl.backends"] = importlib.util.module_from_spec(importlib.util.find_spec("skyrl.backends"))
        found.append((version, importlib.import_module(modules[top])))
    if not found:
        sys.exit("neither skyrl-train 0.3.1 nor skyrl 0.4.0 is installed (pip install --no-deps --ignore-requires-python ...)")
    return found


class Out(dict):
    __getattr__ = dict.get

    def __setattr__(self, key, value):
        self[key] = value


parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix (clamp at 1e-8) before running")
fixed = parser.parse_args().fixed

logits = torch.tensor([[[0.0, 1.0, 3.0], [0.0, 1.0, 3.0]]])
sequences = torch.tensor([[2, 1]])  # the log-prob of token 1 after token 2: num_actions = 1
failed = False
for version, wrapper in installed({"skyrl_train": "skyrl_train.model_wrapper",
                                   "skyrl": "skyrl.backends.skyrl_train.workers.model_wrapper"}):
    for temperature in (0.0, 5e-9):
        model = wrapper.HFModelWrapper(lambda *a, **k: Out(logits=logits.clone()))
        used = max(temperature, 1e-8) if fixed else temperature  # the fix: div_(max(temperature, 1e-8))
        got = model(sequences, 1, attention_mask=torch.ones(1, 2, dtype=torch.long), temperature=used)[0, 0]
        clamped = torch.log_softmax(logits[0, 0].double() / max(temperature, 1e-8), -1)[1]
        ok = bool(torch.isfinite(got)) and torch.allclose(got.double(), clamped, rtol=1e-5)
        print(f"{version}: T={temperature}: log-prob got {got.item():.6g}, with the 1e-8 clamp {clamped.item():.6g} -> "
              f"{'ok' if ok else 'FAIL'}")
        failed |= not ok
sys.exit(1 if failed else 0)
