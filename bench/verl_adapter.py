"""Optional access to verl (the comparison target). Nothing of verl is copied here.

``load()`` returns ``None`` when verl is not importable; the benchmark then reports
impl and floor only.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable


@dataclass
class Verl:
    version: str
    engine: Any  # FSDPEngineWithLMHead built without __init__
    pad_mode: Any  # DatasetPadMode.NO_PADDING
    padding: Any  # verl.workers.utils.padding
    logprobs_path: str  # which logprobs_from_logits branch runs here


def load() -> Verl | None:
    if os.environ.get("BENCH_NO_VERL"):
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import verl
            import verl.utils.torch_functional as verl_F
            from verl.utils.dataset.dataset_utils import DatasetPadMode
            from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
            from verl.workers.utils import padding
    except Exception:  # noqa: BLE001 - verl absent or broken: impl/floor columns only
        return None

    engine = object.__new__(FSDPEngineWithLMHead)
    # The attributes prepare_model_inputs/prepare_model_outputs read, as a single-rank
    # engine without Ulysses SP, static bucket or cu_seqlens passing would have them.
    engine.use_ulysses_sp = False
    engine.ulysses_sequence_parallel_size = 1
    engine.engine_config = SimpleNamespace(entropy_checkpointing=False, entropy_from_logits_with_chunking=False,
                                           entropy_from_logits_chunk_size=2048)
    # verl wraps this in torch.compile when engine_config.use_torch_compile is set; the
    # benchmark uses the eager function (see README: CPU, no compiler in the loop).
    engine.compute_entropy_from_logits = verl_F.entropy_from_logits
    engine.module = SimpleNamespace(config=SimpleNamespace())
    engine.pad_to_length = False
    engine.pad_to_length_bucket = 8
    engine.pass_packed_cu_seqlens = False

    if verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE and os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1":
        path = "flash_attn Triton cross_entropy_loss"
    elif verl_F.NPU_CROSS_ENTROPY_LOSS_AVAILABLE:
        path = "torch_npu npu_cross_entropy_loss"
    else:
        path = "logprobs_from_logits_v2 (pure torch, per-row loop)"
    return Verl(verl.__version__, engine, DatasetPadMode.NO_PADDING, padding, path)


def shallow(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a verl helper that mutates its TensorDict argument: call it on a shallow copy."""
    return lambda td: fn(td.copy())
