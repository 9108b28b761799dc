"""Planted faults: a malformed per-rank output, a rank that dies on some shards, an output in a dtype the engine's
own declaration rules out. Each is impl with one mistake; each must be rejected under ``ci`` by a failed
check (:class:`spec.execute.attribution.EngineFault` or an invariant's assertion), never read as a suite error, and
within the run's fault budget (``spec.run.runner.fault_budget``, ``shrink_deadline``).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import impl
from impl.flags import read_flag


def _shortened(value: torch.Tensor, drop: int) -> torch.Tensor:
    """``value`` (a jagged nested tensor) with its values ``drop`` entries short of what its offsets claim."""
    values = value.values()
    return torch.nested.nested_tensor_from_jagged(values[: max(0, values.shape[0] - drop)], value.offsets())


class CriticValuesShortOnRanks(impl.ValueHeadEngine):
    """On real ranks, rank 1's value head drops the gathered row's last two values but keeps the offsets: a PPO
    critic's values hold fewer entries than their offsets claim (reading them raises deep inside torch)."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **verl_only)
        if self.settings.sp_rank == 1 and dist.is_available() and dist.is_initialized():
            out = {key: _shortened(value, 2) if key == "values" else value for key, value in out.items()}
        return out


class RankDiesOnUnevenShard(impl.LMHeadEngine):
    """On real ranks, rank 1 exits (``os._exit``) when the packed row does not divide the world size (its shard ends
    in sequence-parallel padding): a crash in the engine's own preparation that takes the rank process down."""

    def prepare_model_inputs(self, mb):
        sp = self.settings.sp_size
        total = int(mb["input_ids"].offsets()[-1])
        if sp > 1 and self.settings.sp_rank == 1 and total % sp and dist.is_available() and dist.is_initialized():
            os._exit(17)
        return super().prepare_model_inputs(mb)


class EntropyRoundedOnChunkedPath(impl.LMHeadEngine):
    """With bf16/fp16 logits, the packed chunked entropy is rounded to the logits' dtype and returned in it, where
    the engine declares float32 for that path (verl's rule: ``entropy_from_logits_with_chunking`` upcasts each
    chunk); its records excuse low-precision outputs on the other paths only."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **verl_only)
        low = output.logits.dtype
        chunked = bool(read_flag(mb, "use_remove_padding", True)) and bool(self.settings.entropy_chunk_size)
        if low in (torch.bfloat16, torch.float16) and chunked and "entropy" in out:
            entropy = out["entropy"]
            out = {**out, "entropy": torch.nested.nested_tensor_from_jagged(entropy.values().to(low),
                                                                            entropy.offsets())}
        return out


class EntropyRoundedBehindLogProbs(impl.LMHeadEngine):
    """verl's held-out bug class: with bf16/fp16 logits every output comes back in the logits' dtype, as the engine
    declares (verl's precision rule: log_probs in that dtype, excused by its INV-DEV-001 record), except that the
    packed chunked entropy, declared float32 (``entropy_from_logits_with_chunking`` upcasts each chunk), comes back in
    it too, beside those log_probs. A check that stops at the first output not in float32 (``log_probs``, excused)
    never sees the entropy."""

    def prepare_model_outputs(self, output, output_args, mb, logits_processor_func=None, **verl_only):
        out = super().prepare_model_outputs(output, output_args, mb, logits_processor_func, **verl_only)
        low = output.logits.dtype
        fused = bool(read_flag(mb, "use_fused_kernels", False))  # verl's fused kernels return float32, as declared
        if low not in (torch.bfloat16, torch.float16) or fused or "log_probs" not in out:
            return out
        chunked = bool(read_flag(mb, "use_remove_padding", True)) and bool(self.settings.entropy_chunk_size)
        rounded = {"log_probs"} | ({"entropy"} if chunked else set())
        return {key: torch.nested.nested_tensor_from_jagged(value.values().to(low), value.offsets())
                if key in rounded else value for key, value in out.items()}
