"""verl 0.9.1 left_right_2_no_padding: mRoPE position ids become ragged on the wrong axis (all lengths equal, or B = 1).

Needs: pip install torch tensordict verl==0.9.1. Exit 1 while the bug is present, 0 once fixed.

verl.workers.utils.padding.left_right_2_no_padding turns a trainer's dense (B, 4, S) mRoPE position ids into a
nested tensor with torch.nested.as_nested_tensor over the per-sample (4, n_i) slices. When every n_i is equal
(or B = 1) as_nested_tensor has no ragged dimension to find and makes the 4 axes the ragged one: (B, j, n)
instead of (B, 4, j), so the packed (4, 1, total) positions the model gets are garbled (verl issue #7899).
"""

import sys
import warnings

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

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
