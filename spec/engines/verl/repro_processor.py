"""verl's own top-K distillation processor built as :meth:`spec.engines.verl.VerlEngine.logits_processor` builds
it (verl 0.9: the file hands it the engine instead of the stand-in it writes out), for a standalone reproducer:
vendored after :mod:`spec.engines.verl.repro_snippet` where this verl ships it. Imported only where verl 0.9 is installed."""

from __future__ import annotations

from functools import partial  # noqa: E402

from verl.trainer.distillation.losses import distillation_ppo_loss  # noqa: E402
from verl.workers.config import DistillationConfig, DistillationLossConfig, FSDPActorConfig  # noqa: E402

#: what the file binds for this module: none
BOUND = ()

_ACTOR = []


def logits_processor(case, sp_size, sp_rank):
    """What a verl 0.9 run hands prepare_model_outputs (verl.workers.engine_workers): partial(distillation_ppo_loss,
    config=<actor config, strategy fsdp>, distillation_config=...), its distillation_loss the top-K forward KL with
    the case's switches (enabled=False: the processor path reads distillation_loss only). Under Ulysses SP verl
    slices the teacher tensors itself, reading its module-level group (_Engine sets it around the call)."""
    if not _ACTOR:
        _ACTOR.append(FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1))
    drawn = dict(case.engine_config or ())
    loss = DistillationLossConfig(loss_mode="forward_kl_topk", topk=int(case.topk), use_policy_gradient=False,
                                  log_prob_min_clamp=drawn.get("log_prob_min_clamp"),
                                  use_chunked_topk=bool(drawn.get("use_chunked_topk", False)),
                                  chunked_topk_chunk_size=int(drawn.get("chunked_topk_chunk_size", 4096)))
    return partial(distillation_ppo_loss, config=_ACTOR[0],
                   distillation_config=DistillationConfig(enabled=False, distillation_loss=loss))
