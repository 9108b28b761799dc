"""verl 0.7.1 micro-batch layer: micro-batches of equal-length samples hand a VLM position ids of shape (4 B, 1, n)
for ids (1, B n).

Needs: pip install torch tensordict verl==0.7.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies
the suggested fix (nest every rebuilt key along its token axis) by wrapping the released functions.

prepare_micro_batches cuts the mini-batch with chunk_tensordict (fixed micro-batch size) or index_select_tensor_dict
(use_dynamic_bsz), which rebuild each nested key with torch.nested.as_nested_tensor(list of per-sample tensors,
layout=torch.jagged). That infers the ragged axis from the shapes: for mRoPE samples' (4, n_i) position ids of equal
n_i it makes the 4 rope axes the ragged one, so values() is (4 B, n) instead of (n_total, 4)^T. The engine's packed
path reads position_ids.values().unsqueeze(1): the model gets (4 B, 1, n) positions for (1, B n) ids.
"""

import argparse
import sys
import warnings
from types import SimpleNamespace

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402
from verl.workers.engine.utils import prepare_micro_batches  # noqa: E402


def nest_on_tokens(tensors):
    """(4, n_i) items nested as (B, 4, j), ragged on the token axis whatever the lengths."""
    offsets = torch.tensor([0] + [t.shape[-1] for t in tensors]).cumsum(0)
    return torch.nested.nested_tensor_from_jagged(torch.cat([t.T for t in tensors]), offsets=offsets).transpose(1, 2)


def fixed(released):
    def wrapper(*args, **kwargs):
        """The suggested fix, from outside: every 3-D nested key rebuilt ragged on its token axis."""
        out = released(*args, **kwargs)
        for td in out if isinstance(out, (list, tuple)) else [out]:
            if not isinstance(td, TensorDict):
                continue
            for key, value in list(td.items()):
                if isinstance(value, torch.Tensor) and value.is_nested and value.dim() == 3:
                    td[key] = nest_on_tokens(list(value.unbind()))
        return out
    return wrapper


parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
if parser.parse_args().fixed:
    tu.chunk_tensordict = fixed(tu.chunk_tensordict)
    tu.index_select_tensor_dict = fixed(tu.index_select_tensor_dict)

B, n = 4, 3  # a mini-batch of 4 samples of 3 tokens, micro-batches of 2
ids = [torch.arange(1, n + 1) + 10 * b for b in range(B)]
pos = [torch.arange(n).expand(4, n) + 100 * torch.arange(4).view(4, 1) for _ in range(B)]  # rope axis k: 100 k + i
nest = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
failed = False
for dynamic in (False, True):
    mini = TensorDict({"input_ids": nest(ids), "position_ids": nest_on_tokens(pos),
                       "loss_mask": nest([torch.ones(n, dtype=torch.long)] * B)}, batch_size=[B])
    for key, value in (("use_dynamic_bsz", dynamic), ("micro_batch_size_per_gpu", 2), ("max_token_len_per_gpu", 2 * n),
                       ("temperature", 1.0), ("use_remove_padding", True)):
        tu.assign_non_tensor_data(mini, key, value)
    micro_batches, _ = prepare_micro_batches(mini)
    mb = micro_batches[0]
    engine = SimpleNamespace(use_ulysses_sp=False, module=SimpleNamespace(config=SimpleNamespace()))
    model_inputs, _ = FSDPEngineWithLMHead.prepare_model_inputs(engine, mb)
    got, ids_shape = model_inputs["position_ids"], tuple(model_inputs["input_ids"].shape)
    want_shape = (4, 1, ids_shape[1])
    ok = tuple(got.shape) == want_shape and torch.equal(got[:, 0, :n], pos[0])
    print(f"{'use_dynamic_bsz' if dynamic else 'micro_batch_size_per_gpu=2'}: model input_ids {ids_shape}, "
          f"position_ids {tuple(got.shape)} (expected {want_shape}); rows {got[:, 0, :].tolist()[:5]}"
          f"{' ...' if got.shape[0] > 5 else ''} -> {'ok' if ok else 'FAIL'}")
    failed |= not ok
sys.exit(1 if failed else 0)
