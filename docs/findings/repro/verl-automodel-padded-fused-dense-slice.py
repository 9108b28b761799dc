"""verl 0.9.1 Automodel engine: padded mode with fused kernels returns dense response slices, not nested sequences.

Needs: pip install torch tensordict verl==0.9.1 (nemo_automodel is stubbed when absent: the
preparation never calls them). Exit 1 while the bug is present in either engine, 0 once fixed.

With use_remove_padding=False and use_fused_kernels=True, AutomodelEngineWithLMHead.prepare_model_outputs returns
log_probs = output.log_probs[:, -response_length - 1 : -1] (response_length: the max_response_length flag, default
1024): a dense (B, min(L, 1024)) tensor where every other path returns nested full sequences, and what the trainer
does next (no_padding_2_padding, as the FSDP engine's forward_step does) cannot read it. The FSDP engine had the same
slice and crashed there until PR #6846 re-wrapped it.
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
from verl.workers.utils.padding import no_padding_2_padding  # noqa: E402

PROMPTS, RESPONSES = [3, 2], [2, 4]
lens = [p + r for p, r in zip(PROMPTS, RESPONSES)]
ids = torch.randint(0, 16, (sum(lens),), generator=torch.Generator().manual_seed(1))
offsets = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
r_off = torch.tensor([0, *torch.tensor(RESPONSES).cumsum(0).tolist()])
p_off = torch.tensor([0, *torch.tensor(PROMPTS).cumsum(0).tolist()])
is_prompt = torch.cat([torch.arange(n) < p for n, p in zip(lens, PROMPTS)])
nj = torch.nested.nested_tensor_from_jagged
mb = TensorDict({"input_ids": nj(ids, offsets), "position_ids": nj(torch.cat([torch.arange(n) for n in lens]), offsets),
                 "prompts": nj(ids[is_prompt], p_off), "responses": nj(ids[~is_prompt], r_off),
                 "loss_mask": nj(torch.ones(sum(RESPONSES), dtype=torch.int64), r_off)}, batch_size=[2])
for key, value in (("use_remove_padding", False), ("use_fused_kernels", True), ("temperature", 1.0)):
    mb.set_non_tensor(key, value)

eng = object.__new__(AutomodelEngineWithLMHead)
eng.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                    entropy_from_logits_chunk_size=2048, use_torch_compile=False, attn_implementation="sdpa")
eng.compute_entropy_from_logits = verl_F.entropy_from_logits
model_inputs, output_args = eng.prepare_model_inputs(mb)
B, L = model_inputs["input_ids"].shape
# a fused-kernel model returns per-position log-probs and entropy (B, L); the padded positions hold NaN here
real = torch.arange(L).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)
per_position = torch.where(real, -torch.arange(1.0, L + 1).expand(B, L), torch.tensor(float("nan")))
out = eng.prepare_model_outputs(SimpleNamespace(log_probs=per_position, entropy=per_position.clone()), output_args, mb)
lp = out["log_probs"]
print(f"log_probs: {'nested' if lp.is_nested else 'dense'} {tuple(lp.shape) if not lp.is_nested else ''}; "
      f"expected nested ({B}, j) over the full sequences {lens}")
try:
    sliced = no_padding_2_padding(lp, mb)  # what the trainer does next
    want = torch.zeros(B, max(RESPONSES))
    for i in range(B):
        want[i, : RESPONSES[i]] = per_position[i, PROMPTS[i] - 1 : lens[i] - 1]
    ok = sliced.shape == want.shape and torch.equal(sliced, want)
    print(f"no_padding_2_padding(log_probs): got {sliced.tolist()}, expected {want.tolist()}")
except Exception as exc:  # noqa: BLE001
    ok = False
    print(f"no_padding_2_padding(log_probs) raised {type(exc).__name__}: {exc}")
print("ok" if ok and lp.is_nested else "FAIL")
sys.exit(0 if ok and lp.is_nested else 1)
