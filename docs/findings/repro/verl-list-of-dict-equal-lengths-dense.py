"""verl 0.9.1 list_of_dict_to_tensordict: a group whose samples all have one length is stacked dense, not nested.

Needs: pip install torch tensordict verl==0.9.1. Exit 1 while the bug is present, 0 once fixed; ``--fixed`` applies
the suggested fix (the rule of verl PR #7661: nested for every non-scalar tensor key) by monkeypatch.

verl.utils.tensordict_utils.list_of_dict_to_tensordict (the TransferQueue rollout write, agent_loop_tq.py, and the
padding upsampler, padding_utils.py) picks dense or nested per key by testing whether every sample's tensor has the
same shape. A GRPO group whose responses all hit max_response_length (or a list of one sample) passes that test, so
its ragged per-sample keys come back as dense (N, L) tensors: the next concat with another group raises, and
code that reads data["responses"].offsets() (trainer_base.py) has no offsets to read.
"""

import argparse
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
from verl.utils import tensordict_utils as tu  # noqa: E402
from tensordict import NonTensorStack, TensorDict  # noqa: E402


def fixed_list_of_dict_to_tensordict(list_of_dicts):
    """The suggested fix (verl PR #7661's rule): scalars stacked, every other tensor key nested, the rest non-tensor."""
    keys = list_of_dicts[0].keys()
    data = {}
    for key in keys:
        values = [d[key] for d in list_of_dicts]
        if all(isinstance(v, torch.Tensor) for v in values):
            data[key] = torch.stack(values) if values[0].dim() == 0 else tu.nested_tensor_from_tensor_list(values)
        else:
            data[key] = NonTensorStack(*values)
    return TensorDict(data, batch_size=[len(list_of_dicts)])


parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
if parser.parse_args().fixed:
    tu.list_of_dict_to_tensordict = fixed_list_of_dict_to_tensordict


def group(prompt_len, response_lens):
    """A GRPO group as the rollout writes it: one dict of per-sample tensors per response."""
    return [{"prompts": torch.arange(1, prompt_len + 1), "responses": torch.arange(10, 10 + r),
             "input_ids": torch.arange(1, prompt_len + r + 1)} for r in response_lens]


saturated = tu.list_of_dict_to_tensordict(group(3, [4, 4]))  # both responses at max_response_length = 4
ragged = tu.list_of_dict_to_tensordict(group(3, [2, 4]))
for name, td in (("saturated group (responses 4, 4)", saturated), ("ragged group (responses 2, 4)", ragged)):
    print(f"{name}: " + ", ".join(f"{k} {'nested' if v.is_nested else 'dense'} {tuple(v.shape)}"
                                  for k, v in sorted(td.items())))
failed = not all(v.is_nested for v in saturated.values())
try:
    merged = tu.concat_tensordict([ragged, saturated])
    print(f"concat_tensordict of the two groups: responses lengths {merged['responses'].offsets().diff().tolist()}")
except Exception as exc:  # noqa: BLE001 - the failure is the finding
    print(f"concat_tensordict of the two groups: {type(exc).__name__}: {exc}")
    failed = True
try:
    print(f"saturated['responses'].offsets(): {saturated['responses'].offsets().tolist()}")
except Exception as exc:  # noqa: BLE001
    print(f"saturated['responses'].offsets(): {type(exc).__name__}: {exc}")
    failed = True
print("FAIL" if failed else "ok")
sys.exit(1 if failed else 0)
