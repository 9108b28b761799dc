"""OpenRLHF 0.11.2: packing_samples with a vision-language model hands it 1-D text positions, not its mRoPE positions.

Needs: pip install torch einops openrlhf==0.11.2 (--no-deps is enough: transformers, peft, deepspeed and flash-attn's
CUDA parts are stubbed below when missing; flash-attn's pure-torch bert_padding runs for real, from flash-attn itself
or its bert_padding.py on the path as flash_attn_bert_padding). Exit 1 while the bug is present, 0 once fixed, 2 when
bert_padding is missing (nothing checked); ``--fixed`` applies the suggested fix (the model's own mRoPE positions,
unpadded like the ids) by monkeypatch.

Actor.forward's padded path hands a VLM (is_vlm) position_ids=None, so the model computes its own 3-axis mRoPE
positions from the image grid; the packed path (packing_samples) calls unpad_and_slice_tensor, which hands every
model the 1-D text positions cumsum(mask) - 1. The image tokens and every token after an image get positions the
model never sees in the padded path (or in the rollout), so the packed log-probs are those of another input.
"""

import argparse
import importlib.abc
import importlib.machinery
import sys
from unittest import mock


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Module-level imports of openrlhf.models that are not installed (transformers, peft, deepspeed, flash-attn's
    CUDA parts, the math grader's pylatexenc) become MagicMock modules, as verl's CPU tests stub them; nothing of
    OpenRLHF itself is replaced. Installed packages import for real (this finder is asked last)."""

    ROOTS = ("transformers", "peft", "deepspeed", "pylatexenc")
    #: flash-attn's CUDA package and its ring-attention all_gather only: flash_attn.ops stays missing, so
    #: log_probs_from_logits takes its torch fallback as on any machine without flash-attn
    NAMES = ("flash_attn", "flash_attn.utils", "flash_attn.utils.distributed")

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


try:  # flash-attn's pure-torch padding helpers run for real: flash-attn itself, or its bert_padding.py copied alone
    import flash_attn.bert_padding  # noqa: F401
except ImportError:
    try:
        import flash_attn_bert_padding
    except ImportError:  # exit 2, not 1: nothing was checked
        print("the packed path runs flash-attn's bert_padding: install flash-attn, or put flash-attn 2.8.3's "
              "flash_attn/bert_padding.py (pure torch + einops) on the path as flash_attn_bert_padding.py", file=sys.stderr)
        sys.exit(2)
    sys.modules["flash_attn.bert_padding"] = flash_attn_bert_padding
sys.meta_path.append(_Stubs())

import torch  # noqa: E402

import openrlhf.models.actor as actor_module  # noqa: E402
from openrlhf.models.actor import Actor  # noqa: E402

IMAGE = 9  # the stand-in's image token


class Out(dict):
    """A ModelOutput-like result (output["logits"] and output.entropy both work)."""

    __getattr__ = dict.get

    def __setattr__(self, key, value):
        self[key] = value


class StandInVLM:
    """Records the position_ids Actor.forward hands it. Its own positions follow Qwen2-VL's get_rope_index rule: text
    tokens t = h = w = running index; an image of (1, gh, gw) merged patches at index s gets t = s, h = s + row,
    w = s + col; the text after it resumes at max + 1."""

    def get_rope_index(self, input_ids, image_grid_thw=None, video_grid_thw=None, attention_mask=None):
        pos = torch.zeros(3, *input_ids.shape, dtype=torch.long)
        grids = iter(image_grid_thw.tolist())
        for b in range(input_ids.shape[0]):
            nxt, i, row = 0, 0, input_ids[b][attention_mask[b].bool()].tolist()
            while i < len(row):
                if row[i] == IMAGE:
                    _, gh, gw = next(grids)
                    for k in range(gh * gw):
                        pos[:, b, i + k] = torch.tensor([nxt, nxt + k // gw, nxt + k % gw])
                    nxt, i = nxt + max(gh, gw), i + gh * gw
                else:
                    pos[:, b, i] = nxt
                    nxt, i = nxt + 1, i + 1
        return pos, None

    def __call__(self, input_ids, attention_mask=None, position_ids=None, **mm_inputs):
        self.position_ids = position_ids
        return Out(logits=torch.zeros(*input_ids.shape, 16))


def fix_packed_vlm_positions():
    """The suggested fix, applied by monkeypatch: in the packed path a VLM gets its own (3, B, S) mRoPE positions,
    unpadded with the ids' indices to (3, 1, nnz)."""
    original_forward, original_unpad = Actor.forward, actor_module.unpad_and_slice_tensor

    def forward(self, sequences, *args, **kwargs):
        def unpad(seqs, mask, group):
            ids, pos, rolled, pad_len, indices = original_unpad(seqs, mask, group)
            if getattr(self, "is_vlm", False):
                rope, _ = self.model.get_rope_index(seqs, kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"),
                                                    mask)
                pos = rope.flatten(1)[:, indices].unsqueeze(1)
            return ids, pos, rolled, pad_len, indices

        actor_module.unpad_and_slice_tensor = unpad
        try:
            return original_forward(self, sequences, *args, **kwargs)
        finally:
            actor_module.unpad_and_slice_tensor = original_unpad

    Actor.forward = forward


parser = argparse.ArgumentParser()
parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
if parser.parse_args().fixed:
    fix_packed_vlm_positions()

# two right-padded samples, as make_experience_batch merges them: one with a 2 x 2 image (4 merged tokens), one text
sequences = torch.tensor([[1, IMAGE, IMAGE, IMAGE, IMAGE, 2, 3], [4, 5, 6, 0, 0, 0, 0]])
mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0, 0]])
grid = torch.tensor([[1, 2, 2]])
model = StandInVLM()
own, _ = model.get_rope_index(sequences, grid, None, mask)  # what the model uses when it computes its positions

actor = Actor(model)
actor.is_vlm, actor._vlm_config = True, type("Config", (), {"image_token_id": IMAGE, "video_token_id": None})()
for packing in (False, True):
    actor.packing_samples = packing
    actor(sequences, attention_mask=mask, return_output=True, return_logprobs=True, image_grid_thw=grid)
    handed = model.position_ids
    print(f"packing_samples={packing}: position_ids handed to the VLM:",
          "None (the model computes its own mRoPE positions)" if handed is None else tuple(handed.shape))

want = own[:, mask.bool()]  # (3, nnz): the model's own positions of every real token
got = handed.reshape(-1, handed.shape[-1]).expand(3, -1)  # 1-D positions read on every axis
wrong = int((got != want).any(0).sum())
print(f"packed: {wrong} of {want.shape[1]} tokens get positions other than the model's own mRoPE positions "
      f"(sample 0 image tokens and after: got {got[:, 1:7].tolist()}, own {want[:, 1:7].tolist()})")
ok = handed.dim() == 3 and handed.shape[0] == 3 and wrong == 0
print("ok" if ok else "FAIL")
sys.exit(0 if ok else 1)
