"""skyrl-train 0.3.1 and skyrl 0.4.0: log-probs and entropy computed and returned in the logits' dtype (bf16 logits:
bf16 log-probs, bf16 entropy).

Needs: pip install torch numpy, then pip install --no-deps --ignore-requires-python skyrl-train==0.3.1 and/or
skyrl==0.4.0 (both wheels declare Python 3.12; this path runs on 3.11 too; their other imports are stubbed below when
missing). Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies the suggested fix (the logits upcast to
float32 before scoring).

``logprobs_from_logits`` (torch fallback ``logprobs_from_logits_v2``) takes a per-row ``F.log_softmax`` in the
logits' own dtype for bf16/fp16 logits, and ``chunked_entropy_from_logits`` writes each chunk into a tensor of the
logits' dtype. ``HFModelWrapper.forward`` hands both the model's logits as they come (divided by T in place, in
their dtype).
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


parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix (float32 logits) before running")
fixed = parser.parse_args().fixed

torch.manual_seed(0)
vocab = 32768
logits = (torch.randn(1, 8, vocab) * 3).to(torch.bfloat16)  # a bf16 model's logits
labels = torch.randint(vocab, (1, 8))
exact = torch.log_softmax(logits.double(), -1)  # float64, of the same bf16 logits
want_lp, want_h = exact.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(exact.exp() * exact).sum(-1)
failed = False
for version, utils in installed({"skyrl_train": "skyrl_train.utils.torch_utils",
                                 "skyrl": "skyrl.backends.skyrl_train.utils.torch_utils"}):
    scored = logits.float() if fixed else logits  # the fix: logits_BSV = output["logits"].float()
    lp = utils.logprobs_from_logits(scored.clone(), labels)
    h = utils.chunked_entropy_from_logits(scored.clone())
    err_lp, err_h = (lp.double() - want_lp).abs().max().item(), (h.double() - want_h).abs().max().item()
    ok = lp.dtype == h.dtype == torch.float32 and err_lp < 1e-4 and err_h < 1e-4
    print(f"{version}: log-probs {lp.dtype} (max |error| {err_lp:.3g} nats), entropy {h.dtype} "
          f"(max |error| {err_h:.3g}) -> {'ok' if ok else 'FAIL'}")
    failed |= not ok
sys.exit(1 if failed else 0)
