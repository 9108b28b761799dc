"""verl 0.9.1 TorchTitan engine: the temperature is not clamped at 1e-8 (T = 0 gives NaN log-probs).

Needs: pip install torch tensordict verl==0.9.1 (torchtitan is stubbed when absent: the preparation never
calls it). Exit 1 while the bug is present, 0 once fixed.

TorchTitanEngineWithLMHead.prepare_model_outputs divides the logits by micro_batch["temperature"] without the
clamp(min=1e-8) every other verl engine applies (FSDP, VeOmni, Automodel): at T = 0 (greedy) the logits become
+-inf and the log-probs NaN; below 1e-8 they scale with 1/T (T = 5e-9: twice the clamped value).
"""

import importlib.abc
import importlib.machinery
import sys
from typing import NamedTuple
from unittest import mock


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stand-in modules for PACKAGES when they are not installed (verl imports them at module level; the
    preparation code under test never calls into them), as verl's own CPU tests mock them."""

    def __init__(self, packages, records):
        self.packages, self.records = packages, records

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.packages:
            return None
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec") and finder.find_spec(name, path, target):
                return None  # the real package is installed: use it
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        for attr, value in self.records.get(spec.name, {}).items():
            setattr(module, attr, value)
        return module

    def exec_module(self, module):
        pass

import torch  # noqa: E402
from tensordict import TensorDict  # noqa: E402


class VarlenMetadata(NamedTuple):  # torchtitan.models.common.attention.VarlenMetadata's fields
    cu_seq_q: torch.Tensor
    cu_seq_k: torch.Tensor
    max_q: int
    max_k: int


sys.meta_path.insert(0, _Stubs(("torchtitan",), {
    "torchtitan.models.common.attention": {"VarlenMetadata": VarlenMetadata},
    "torchtitan.components.dataloader": {"BaseDataLoader": type("BaseDataLoader", (), {"Config": type("Config", (), {})})},
}))
import warnings  # noqa: E402
from types import SimpleNamespace  # noqa: E402

warnings.filterwarnings("ignore")
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.engine.torchtitan.transformer_impl import TorchTitanEngineWithLMHead  # noqa: E402


def engine():
    eng = object.__new__(TorchTitanEngineWithLMHead)  # no model, no mesh: only what the preparation reads
    eng.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                        entropy_from_logits_chunk_size=2048, use_torch_compile=False,
                                        attn_type="varlen")
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits
    eng.parallel_dims = SimpleNamespace(cp_enabled=False)
    return eng


def micro_batch(lens, vocab, temperature):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (sum(lens),), generator=gen)
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    pos = torch.cat([torch.arange(n) for n in lens])
    nested = lambda v: torch.nested.nested_tensor_from_jagged(v, offsets)  # noqa: E731
    td = TensorDict({"input_ids": nested(ids), "position_ids": nested(pos), "loss_mask": nested(torch.ones_like(ids)),
                     "temperature": torch.tensor(temperature)}, batch_size=[len(lens)])
    td.set_non_tensor("use_remove_padding", True)
    return td, ids, offsets


def expected(logits, ids, offsets, temps):
    """float64: each token's logits over ITS sample's temperature, log-prob of the next token of its sequence."""
    per_token = torch.repeat_interleave(torch.tensor(temps, dtype=torch.float64), offsets.diff())
    lsm = torch.log_softmax(logits.double() / per_token.unsqueeze(-1), dim=-1)
    return lsm[:-1].gather(-1, ids[1:].unsqueeze(-1)).squeeze(-1)


failed = False
for temperature in (0.0, 5e-9):
    mb, ids, offsets = micro_batch([3], 4, [1.0])
    mb.del_("temperature")
    mb.set_non_tensor("temperature", temperature)
    eng = engine()
    input_ids, extra_inputs, extra_kwargs, output_args = eng.prepare_model_inputs(mb)
    logits = torch.randn(1, input_ids.shape[1], 4, generator=torch.Generator().manual_seed(1))
    got = eng.prepare_model_outputs(logits.clone(), output_args, mb)["log_probs"].values().double()[:-1]
    want = expected(logits[0], ids, offsets, [max(temperature, 1e-8)])  # the contract of every other verl engine
    ok = bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6))
    print(f"T={temperature}: log-probs got {got.tolist()}, expected (clamped at 1e-8) {want.tolist()} -> {'ok' if ok else 'FAIL'}")
    failed |= not ok
sys.exit(1 if failed else 0)
