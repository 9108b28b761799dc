"""verl 0.7.1 FSDP engine, fused kernels + Ulysses sequence parallelism: the model gets no labels and rolls its own
sequence shard, so one label per rank is wrong (verl issue #6068).

Needs: pip install torch tensordict verl==0.7.1. Runs two CPU ranks (gloo) as one Ulysses group. Exit 1 while the
bug is present, 0 once fixed; ``--fixed`` applies the suggested fix (the engine hands the fused model its globally
rolled, sliced labels as shift_labels, which the fused forward uses unrolled) by wrapping the released method.

FSDPEngineWithLMHead.prepare_model_inputs (packed, use_fused_kernels) rolls the packed ids globally for the non-fused
log-probs (output_args["input_ids_rmpad_rolled"], sliced per rank), but hands the fused model only its SP-sliced
input_ids; verl.models.transformers.dense_common's fused forward then takes rolled_labels = torch.roll(input_ids,
shifts=-1, dims=-1) on that shard, which wraps at the shard edge: the last position of every rank scores the shard's
own first token instead of the next rank's first token.
"""

import argparse
import os
import sys
import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

SP = 2


def fixed_prepare_model_inputs(released):
    def prepare_model_inputs(self, micro_batch):
        """The suggested fix: hand the fused model the engine's own rolled (and SP-sliced) labels."""
        model_inputs, output_args = released(self, micro_batch)
        if micro_batch.get_non_tensor("use_fused_kernels", False):
            model_inputs["shift_labels"] = output_args["input_ids_rmpad_rolled"].unsqueeze(0)
        return model_inputs, output_args
    return prepare_model_inputs


def rank_main(rank, fixed, port, result):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=SP)
    from verl.utils import tensordict_utils as tu
    from verl.utils.ulysses import set_ulysses_sequence_parallel_group
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    set_ulysses_sequence_parallel_group(dist.new_group(list(range(SP))))
    prepare = FSDPEngineWithLMHead.prepare_model_inputs
    if fixed:
        prepare = fixed_prepare_model_inputs(prepare)
    seqs = [torch.arange(10, 15), torch.arange(20, 23)]  # two packed samples, 8 tokens: 4 per rank
    nest = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    batch = TensorDict({"input_ids": nest(seqs), "position_ids": nest([torch.arange(len(s)) for s in seqs]),
                        "loss_mask": nest([torch.ones_like(s) for s in seqs])}, batch_size=[2])
    for key, value in (("temperature", 1.0), ("use_remove_padding", True), ("use_fused_kernels", True)):
        tu.assign_non_tensor_data(batch, key, value)
    engine = SimpleNamespace(use_ulysses_sp=True, ulysses_sequence_parallel_size=SP,
                             module=SimpleNamespace(config=SimpleNamespace()))
    model_inputs, output_args = prepare(engine, batch)
    # what verl.models.transformers.dense_common's fused forward labels the shard with
    if model_inputs.get("shift_labels") is not None:
        fused_labels = model_inputs["shift_labels"]  # (the fix: used as given, not rolled again)
    else:
        fused_labels = torch.roll(model_inputs["input_ids"], shifts=-1, dims=-1)  # dense_common: labels None
    result[rank] = (model_inputs["input_ids"].tolist()[0], fused_labels.tolist()[0],
                    output_args["input_ids_rmpad_rolled"].tolist(), sorted(k for k in model_inputs if "label" in k))
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fixed", action="store_true", help="apply the suggested fix before running")
    fixed = parser.parse_args().fixed
    result = mp.Manager().dict()
    mp.spawn(rank_main, args=(fixed, 29_500 + os.getpid() % 1000, result), nprocs=SP)
    wrong = 0
    for rank in range(SP):
        ids, fused, engine_rolled, label_keys = result[rank]
        bad = [i for i, (a, b) in enumerate(zip(fused, engine_rolled)) if a != b]
        wrong += len(bad)
        print(f"rank {rank}: input_ids {ids}, label keys handed to the model {label_keys}; fused labels {fused}, "
              f"the engine's global next tokens {engine_rolled}: {len(bad)} wrong at {bad}")
    print("FAIL" if wrong else "ok")
    sys.exit(1 if wrong else 0)
