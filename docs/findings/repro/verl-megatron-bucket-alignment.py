"""verl 0.9.1 Megatron engine: the static bucket ignores the TP x CP (x2 zig-zag) alignment of packed THD sequences.

Needs: pip install torch tensordict verl==0.9.1 (megatron-core is stubbed when absent: only its parallel-state
getters are read, and they are answered here, and its PackedSeqParams, a plain dataclass, is written out below with
megatron-core 0.16.1's fields; a bare stub would hand verl a MagicMock for the lengths checked here). Exit 1 while the bug is present, 0 once fixed.

verl.models.mcore.util.preprocess_thd_engine pads every sequence to a multiple of align = TP * CP (* 2 for the
zig-zag CP layout), then, with pad_to_length_bucket=b, pads the total to lcm(b, CP) and gives that pad to the last
sequence. Unless b is a multiple of align, the last sequence is no longer a multiple of align: with CP = 2 zig-zag
each rank must take two chunks of len / (2 * CP) rows, which is not an integer; a row is dropped and
postprocess_thd_engine cannot re-assemble the batch.
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

from dataclasses import dataclass  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402

@dataclass
class PackedSeqParams:  # megatron.core.packed_seq_params.PackedSeqParams (megatron-core 0.16.1), used only if absent
    qkv_format: str = None
    cu_seqlens_q: torch.Tensor = None
    cu_seqlens_kv: torch.Tensor = None
    cu_seqlens_q_padded: torch.Tensor = None
    cu_seqlens_kv_padded: torch.Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    local_cp_size: int = None
    cp_group: object = None


sys.meta_path.insert(0, _Stubs(("megatron",), {"megatron.core.packed_seq_params": {"PackedSeqParams": PackedSeqParams}}))
import warnings  # noqa: E402

warnings.filterwarnings("ignore")
from verl.models.mcore import util  # noqa: E402

TP, CP, LAYOUT, BUCKET = 1, 2, "zigzag", 7
x = torch.nested.nested_tensor_from_jagged(torch.tensor([11, 12]), torch.tensor([0, 2]))  # one sequence of 2 tokens


def parallel_state(rank):
    return SimpleNamespace(get_tensor_model_parallel_world_size=lambda: TP, get_context_parallel_world_size=lambda: CP,
                           get_context_parallel_rank=lambda: rank, get_context_parallel_group=lambda: None)


shards = []
for rank in range(CP):
    util.mpu = parallel_state(rank)
    rows, params, _ = util.preprocess_thd_engine(x, pre_process=True, pad_to_length_bucket=BUCKET, cp_layout=LAYOUT)
    shards.append((rows, params))
lengths = (shards[0][1].cu_seqlens_q_padded.diff()).tolist()
align = TP * CP * 2
print(f"TP={TP} CP={CP} {LAYOUT} bucket={BUCKET}: padded sequence lengths {lengths}, each must be a multiple of {align}; "
      f"rows per rank {[tuple(r.shape) for r, _ in shards]}")


def all_gather(output_list, tensor, group=None, async_op=False):
    for i, (rows, _) in enumerate(shards):
        output_list[i].copy_(rows)


ok = all(n % align == 0 for n in lengths)
torch.distributed.all_gather = all_gather  # the CP all-gather, answered from the ranks' own shards
try:
    for rank in range(CP):
        util.mpu = parallel_state(rank)
        back = util.postprocess_thd_engine(shards[rank][0], shards[rank][1], x, 1, post_process=True, cp_layout=LAYOUT)
        got = back.values().tolist() if back.is_nested else back.tolist()
        print(f"rank {rank} re-assembles {got}, expected [11, 12]")
        ok &= got == [11, 12]
except RuntimeError as exc:
    print(f"postprocess_thd_engine raised RuntimeError: {exc}")
    ok = False
print("ok" if ok else "FAIL")
sys.exit(0 if ok else 1)
