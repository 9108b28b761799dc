"""verl 0.9.1 Megatron engine: with FP8 padding and the BSHD format, a vision-language model is handed rows narrower
than the labels its logits are scored against.

Needs: pip install torch tensordict verl==0.9.1 megatron-core==0.16.1 --no-deps (megatron-core imports CPU-only; only
its parallel-state getters are read, and they are answered here). Exit 1 while the bug is present, 0 once fixed.

gptmodel_forward_model_engine (verl/models/mcore/model_forward.py) pads the labels, the temperature and the mask that
postprocess_bshd_engine reads with preprocess_bshd_engine(use_fp8_padding=True) (line 409/461): the width a multiple
of 128 * TP * CP / gcd(B, 128 * TP * CP) as well as of TP (x 2CP). For a vision-language model (vision_model=True) it
hands the model rows from build_vlm_attn_mask_bshd (line 447), which aligns the width to TP (x 2CP) only. The model's
logits are as wide as its rows, so the engine's _lm_head_logits_processor stops at
``assert logits.shape[:2] == label.shape[:2]`` (verl/workers/engine/megatron/transformer_impl.py:1205).
"""

import sys
from types import SimpleNamespace
from unittest import mock

import torch
import verl.models.mcore.model_forward as model_forward
import verl.models.mcore.util as util

PARALLEL_STATE = SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 1,
                                 get_context_parallel_world_size=lambda: 1, get_context_parallel_rank=lambda: 0,
                                 get_context_parallel_group=lambda: None)
VOCAB = 16


class VisionLanguageModel:
    """What gptmodel_forward_model_engine reads of a model, and logits as wide as the rows it is handed."""

    pre_process = post_process = True
    config = SimpleNamespace(fp8="e4m3")  # FP8 training: use_fp8_padding

    def __call__(self, input_ids, attention_mask=None, **kwargs):
        self.rows = tuple(input_ids.shape)
        return torch.zeros(*input_ids.shape, VOCAB)


def logits_processor(logits, label, temperature):
    """The engine's _lm_head_logits_processor's first line."""
    assert logits.shape[:2] == label.shape[:2], f"logits {tuple(logits.shape[:2])} vs label {tuple(label.shape[:2])}"
    return {"log_probs": torch.zeros(label.shape)}


def main() -> int:
    ids = torch.nested.nested_tensor([torch.tensor([3, 4, 5, 6, 7]), torch.tensor([8, 9])], layout=torch.jagged)
    temperature = torch.nested.nested_tensor([torch.ones(5), torch.ones(2)], layout=torch.jagged)
    model = VisionLanguageModel()
    with mock.patch.object(util, "mpu", PARALLEL_STATE):
        try:
            model_forward.gptmodel_forward_model_engine(
                model, ids, {}, logits_processor=logits_processor,
                logits_processor_args={"label": ids.clone(), "temperature": temperature}, vision_model=True,
                pad_token_id=0, data_format="bshd")
        except AssertionError as exc:
            print(f"TP=1 CP=1 FP8 bshd, lengths [5, 2]: the model is handed rows {model.rows}; {exc}")
            print("FAIL")
            return 1
    print(f"the model's rows {model.rows} line up with the labels")
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
