"""verl 0.9.1 Megatron engine: R3 router replay with use_remove_padding=False (BSHD) replays other tokens' routes.

Needs: pip install torch tensordict verl==0.9.1 and megatron-core==0.16.1 (pip install --no-deps megatron-core==0.16.1:
its TopKRouter class is what verl walks the model for). Exit 1 while the bug is present, 0 once fixed.

MegatronEngineWithLMHead.forward_step (transformer_impl.py:1306-1324) hands the micro-batch's nested routed_experts to
set_router_replay_data, which packs them with preprocess_thd_engine whatever the data format: sample-major rows, each
sample's tokens back to back. With use_remove_padding=False the model runs BSHD: megatron's GPTModel works in
(S, B, H) (LanguageModelEmbedding transposes), and TopKRouter.routing flattens its (S, B, E) scores, so router row r
is token r // B of sample r % B. For samples of equal length the shapes agree and every router replays, on most
tokens, another token's route, silently; otherwise RouterReplay.get_replay_topk raises "Router replay tensors are
not aligned".

This runs verl's forward_step on one rank (TP = CP = 1) with a one-layer mixture-of-experts stand-in whose router is
megatron's TopKRouter class with verl's RouterReplay, and reads what the router replays at each of its rows.
"""

import sys
import warnings
from functools import partial
from types import SimpleNamespace
from unittest import mock

import torch
from tensordict import TensorDict

warnings.filterwarnings("ignore")
impl = __import__("verl.workers.engine.megatron.transformer_impl", fromlist=["_"])
util = __import__("verl.models.mcore.util", fromlist=["_"])
replay_utils = __import__("verl.utils.megatron.router_replay_utils", fromlist=["_"])


class Stop(BaseException):
    """Ends forward_step at the model call (everything router replay prepares is set by then)."""


def nested(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


# two samples of two tokens each: prompt [11] / [21], response [12] / [22]
ids = nested([torch.tensor([11, 12]), torch.tensor([21, 22])])
# the rollout's routes (R3): one MoE layer, top-2, a distinct route per token: token t of sample i -> [10i + t, 50]
routes = nested([torch.tensor([[[10 * i + t, 50]] for t in range(2)], dtype=torch.int16) for i in (1, 2)])
batch = TensorDict({"input_ids": ids, "loss_mask": nested([torch.tensor([1]), torch.tensor([1])]),
                    "response_mask": nested([torch.tensor([1]), torch.tensor([1])]),
                    "temperature": torch.ones(2), "routed_experts": routes}, batch_size=[2])

cls = impl.MegatronEngineWithLMHead
engine = SimpleNamespace(
    engine_config=SimpleNamespace(use_fused_kernels=False, pad_to_length=False, pad_to_length_bucket=None,
                                  use_remove_padding=False, dynamic_context_parallel=False,
                                  router_replay=SimpleNamespace(mode="R3"),
                                  entropy_from_logits_with_chunking=False, entropy_from_logits_chunk_size=2048),
    enable_routing_replay=True, _get_context_parallel_layout=cls._get_context_parallel_layout,
    model_config=SimpleNamespace(hf_config=SimpleNamespace(architectures=["Qwen2ForCausalLM"]),
                                 tokenizer=SimpleNamespace(pad_token_id=0),
                                 mtp=SimpleNamespace(enable=False, enable_train=False)),
    tf_config=SimpleNamespace(calculate_per_token_loss=False, fp8=None, num_layers=1, moe_router_topk=2,
                              experimental_attention_variant=None, virtual_pipeline_model_parallel_size=None))
engine.prepare_model_inputs = partial(cls.prepare_model_inputs, engine)
engine._lm_head_logits_processor = partial(cls._lm_head_logits_processor, engine)

router = replay_utils.TopKRouter.__new__(replay_utils.TopKRouter)
torch.nn.Module.__init__(router)
router.layer_number, router.router_replay = 1, replay_utils.RouterReplay()
router.router_replay.router_replay_action = replay_utils.RouterReplayAction.REPLAY_FORWARD
seen = {}


class Model:
    """What forward_step reads of the model (unwrap_model, the decoder's routers) and the call."""

    pre_process = post_process = True
    config = SimpleNamespace(fp8=None)
    decoder = torch.nn.Sequential(router)

    def __call__(self, **kwargs):
        seen["input_ids"] = kwargs["input_ids"]  # BSHD: (B, S)
        raise Stop


one_rank = SimpleNamespace(get_tensor_model_parallel_world_size=lambda: 1, get_context_parallel_world_size=lambda: 1,
                           get_context_parallel_rank=lambda: 0, get_context_parallel_group=lambda: None)
with mock.patch.object(util, "mpu", one_rank), mock.patch.object(impl, "get_device_id", lambda: "cpu"), \
        mock.patch.object(replay_utils, "device_name", "cpu"), \
        mock.patch.object(replay_utils, "scatter_to_sequence_parallel_region", lambda x, group=None: x):
    try:
        cls.forward_step(engine, iter([batch]), Model(), None, None)
    except Stop:
        pass

rows = seen["input_ids"].transpose(0, 1).reshape(-1)  # the router's token rows: megatron's (S, B) order
targets = router.router_replay.target_topk_idx
mask = router.router_replay.target_replay_mask
print(f"router rows (token ids, (S, B) order): {rows.tolist()}")
print(f"routes handed to them:                 {targets.tolist()}")
print(f"replay mask:                           {mask.int().tolist()}")
own = {int(tok): r[0].tolist() for seq, rr in zip(ids.unbind(), routes.unbind()) for tok, r in zip(seq, rr)}
read = {int(seq[0]) for seq in ids.unbind()}  # the tokens a counted log-prob reads: every sample's but its last
wrong = []
for tok, target, m in zip(rows.tolist(), targets.tolist(), mask.tolist()):
    if tok in read and not m:
        wrong.append(f"token {tok} routes natively: its rollout route {own[tok]} is not replayed")
    elif tok in read and target != own[tok]:
        wrong.append(f"token {tok} replays route {target}, its own is {own[tok]}")
    elif m and target != own[tok]:
        wrong.append(f"token {tok} (a sample's last, read by no counted log-prob) replays {target}, another token's")
print("\n".join(wrong))
print("FAIL" if wrong else "ok")
sys.exit(1 if wrong else 0)
