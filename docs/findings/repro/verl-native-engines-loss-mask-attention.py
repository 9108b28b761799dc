"""verl 0.9.1 TorchTitan and Automodel engines: the padded attention mask is built from the response-only loss_mask.

Needs: pip install torch tensordict verl==0.9.1 (torchtitan / nemo_automodel are stubbed when absent: the
preparation never calls them). Exit 1 while the bug is present in either engine, 0 once fixed.

With use_remove_padding=False both engines build attention_mask = ones_like(t) for t in loss_mask: r_i ones per
row (the response length) instead of n_i (the whole prompt + response). The model then attends to the first r_i
tokens only, so every later token's log-prob (and entropy) is computed without part of its context. This is
verl issue #6278, fixed for the FSDP engine by PR #6345, still present in these two engines.
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


sys.meta_path.insert(0, _Stubs(("torchtitan", "nemo_automodel"), {
    "torchtitan.models.common.attention": {"VarlenMetadata": VarlenMetadata},
    "torchtitan.components.dataloader": {"BaseDataLoader": type("BaseDataLoader", (), {"Config": type("Config", (), {})})},
}))
import warnings  # noqa: E402
from types import SimpleNamespace  # noqa: E402

warnings.filterwarnings("ignore")
from verl.utils import torch_functional as verl_F  # noqa: E402
from verl.workers.engine.automodel.transformer_impl import AutomodelEngineWithLMHead  # noqa: E402
from verl.workers.engine.torchtitan.transformer_impl import TorchTitanEngineWithLMHead  # noqa: E402

VOCAB, PROMPTS, RESPONSES = 32, [6, 3], [2, 4]
gen = torch.Generator().manual_seed(0)
EMBED, PROJ = torch.randn(VOCAB, 8, generator=gen), 2.0 * torch.randn(8, VOCAB, generator=gen)


def model_logits(ids, mask):
    """A tiny causal model that honours the mask: token t sees the mean embedding of the tokens <= t it may attend."""
    x = EMBED[ids] * mask.unsqueeze(-1)
    ctx = x.cumsum(1) / mask.cumsum(1).clamp(min=1).unsqueeze(-1)
    return torch.tanh(EMBED[ids] + ctx) @ PROJ


def micro_batch():
    lens = [p + r for p, r in zip(PROMPTS, RESPONSES)]
    ids = torch.randint(0, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(1))
    offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    nested = lambda v, o: torch.nested.nested_tensor_from_jagged(v, o)  # noqa: E731
    r_off = torch.tensor([0, *torch.tensor(RESPONSES).cumsum(0).tolist()])
    td = TensorDict({"input_ids": nested(ids, offsets), "position_ids": nested(torch.cat([torch.arange(n) for n in lens]), offsets),
                     "loss_mask": nested(torch.ones(sum(RESPONSES), dtype=torch.int64), r_off)}, batch_size=[len(lens)])
    td.set_non_tensor("use_remove_padding", False)
    td.set_non_tensor("temperature", 1.0)
    return td, ids, lens


def common(eng):
    eng.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                        entropy_from_logits_chunk_size=2048, use_torch_compile=False, attn_type="varlen",
                                        attn_implementation="sdpa")
    eng.compute_entropy_from_logits = verl_F.entropy_from_logits
    eng.parallel_dims = SimpleNamespace(cp_enabled=False)
    return eng


def run_torchtitan(mb):
    eng = common(object.__new__(TorchTitanEngineWithLMHead))
    input_ids, extra_inputs, extra_kwargs, output_args = eng.prepare_model_inputs(mb)
    mask = extra_kwargs["attention_masks"]
    return mask, eng.prepare_model_outputs(model_logits(input_ids, mask), output_args, mb)


def run_automodel(mb):
    eng = common(object.__new__(AutomodelEngineWithLMHead))
    model_inputs, output_args = eng.prepare_model_inputs(mb)
    mask = model_inputs["attention_mask"]
    output = SimpleNamespace(logits=model_logits(model_inputs["input_ids"], mask))
    return mask, eng.prepare_model_outputs(output, output_args, mb)


failed = False
for name, run in (("TorchTitan", run_torchtitan), ("Automodel", run_automodel)):
    mb, ids, lens = micro_batch()
    mask, out = run(mb)
    want_mask = (torch.arange(max(lens)).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)).to(torch.int32)
    print(f"{name}: attention_mask rows {mask.tolist()}, expected {want_mask.tolist()}")
    worst = 0.0
    for i, seq in enumerate(out["log_probs"].unbind()):
        start = sum(lens[:i])
        alone = ids[start:start + lens[i]].unsqueeze(0)
        lsm = torch.log_softmax(model_logits(alone, torch.ones_like(alone)).double(), -1)[0]
        want = lsm[:-1].gather(-1, alone[0, 1:].unsqueeze(-1)).squeeze(-1)
        resp = slice(PROMPTS[i] - 1, lens[i] - 1)  # the response tokens' log-probs, what the loss reads
        err = (seq[:-1].double() - want)[resp].abs()
        t = int(err.argmax())
        worst = max(worst, float(err.max()))
        print(f"  sample {i}: response log-prob {t}: got {seq[resp][t]:.4f}, expected {want[resp][t]:.4f}; "
              f"mean |error| over the response {err.mean():.4f} nats")
    bad = not torch.equal(mask.to(torch.int32), want_mask) or worst > 1e-4
    print(f"  -> {'FAIL' if bad else 'ok'}")
    failed |= bad
sys.exit(1 if failed else 0)
