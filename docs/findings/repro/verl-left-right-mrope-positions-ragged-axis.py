"""verl 0.9.1 / 0.7.1 left_right_2_no_padding: mRoPE position ids become ragged on the wrong axis (all lengths equal, or B = 1).

Needs: pip install torch tensordict verl==0.9.1 (or verl==0.7.1). Exit 1 while the bug is present, 0 once fixed.

verl.workers.utils.padding.left_right_2_no_padding turns a trainer's dense (B, 4, S) mRoPE position ids into a
nested tensor with torch.nested.as_nested_tensor over the per-sample (4, n_i) slices. When every n_i is equal
(or B = 1) as_nested_tensor has no ragged dimension to find and makes the 4 axes the ragged one: (B, j, n)
instead of (B, 4, j), so the packed (4, 1, total) positions the model gets are garbled (verl issue #7899).

flash-attn: verl 0.7.1's padding module unpads through verl.utils.attention_utils, which imports
flash_attn.bert_padding (CUDA wheels only); 0.9.1 falls back to pure-torch equivalents of its own. Where flash-attn
is not installed and this verl has no such fallback, this script puts a stub flash_attn.bert_padding in sys.modules:
flash-attn's own pure-torch bert_padding.py where it is on the path as flash_attn_bert_padding (.ci/steps/
bert_padding.py), else the same pure-torch equivalents verl 0.9.1 falls back to (verl.utils.attention_utils
_fallback_*, written out below). The preparation code that runs is still verl's own left_right_2_no_padding; the stub
only does the unpadding flash-attn would (every token kept by the attention mask, in order), which the expected side
below does not rely on.
"""

import sys
import warnings

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")
from verl.utils import attention_utils  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402


def _bert_padding_stub():
    """A module standing in for flash_attn.bert_padding: flash-attn's own bert_padding.py where it is on the path as
    flash_attn_bert_padding, else verl 0.9.1's pure-torch equivalents (verl/utils/attention_utils.py _fallback_*)."""
    import types

    try:
        import flash_attn_bert_padding
        return flash_attn_bert_padding, "flash-attn's bert_padding.py (flash_attn_bert_padding)"
    except ImportError:
        pass

    def index_first_axis(tensor, indices):
        assert tensor.ndim >= 2
        return tensor[indices]

    def pad_input(hidden_states, indices, batch, seqlen):
        other_shape = hidden_states.shape[1:]
        output = hidden_states.new_zeros(batch * seqlen, *other_shape)
        output[indices] = hidden_states
        return output.view(batch, seqlen, *other_shape)

    def unpad_input(hidden_states, attention_mask, unused_mask=None):
        all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
        seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
        used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
        indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
        cu_seqlens = torch.nn.functional.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
        return (index_first_axis(hidden_states.reshape(-1, *hidden_states.shape[2:]), indices), indices, cu_seqlens,
                seqlens_in_batch.max().item(), used_seqlens_in_batch)

    def rearrange(*args, **kwargs):
        raise NotImplementedError("the flash_attn.bert_padding stub of this script has no rearrange")

    module = types.ModuleType("flash_attn.bert_padding")
    module.index_first_axis, module.pad_input, module.unpad_input, module.rearrange = \
        index_first_axis, pad_input, unpad_input, rearrange
    return module, "verl 0.9.1's pure-torch fallbacks, written out"


try:
    import flash_attn.bert_padding  # noqa: F401
except ImportError:
    if not hasattr(attention_utils, "_fallback_unpad_input"):  # verl 0.7.1: no pure-torch fallback of its own
        stub, source = _bert_padding_stub()
        package = sys.modules["flash_attn"] = __import__("types").ModuleType("flash_attn")
        package.bert_padding = sys.modules["flash_attn.bert_padding"] = stub
        print(f"flash-attn is not installed: flash_attn.bert_padding stubbed by {source}")

B, P, R = 2, 2, 2  # two samples, prompts and responses of equal length (no padding at all)
S = P + R
input_ids = torch.randint(1, 50, (B, S), generator=torch.Generator().manual_seed(0))
attention_mask = torch.ones(B, S, dtype=torch.int64)
positions = (torch.arange(S).expand(B, S).unsqueeze(1) + torch.arange(4).view(1, 4, 1)).contiguous()  # (B, 4, S)
batch = TensorDict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": positions,
                    "response_mask": torch.ones(B, R, dtype=torch.int64), "prompts": input_ids[:, :P].clone(),
                    "responses": input_ids[:, P:].clone()}, batch_size=[B])
out = left_right_2_no_padding(batch)
pos = out["position_ids"]
ragged = getattr(pos, "_ragged_idx", None)
shape = tuple(pos.shape)
print(f"nested position_ids: shape {shape} ragged at dim {ragged}; expected (B, 4, j) ragged at dim 2")
ok = ragged == 2 and shape[1] == 4 and all(torch.equal(p, positions[i]) for i, p in enumerate(pos.unbind()))
print("ok" if ok else "FAIL")
sys.exit(0 if ok else 1)
