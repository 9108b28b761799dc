"""verl 0.9.1 Ulysses sequence parallelism: 3-D (mRoPE) position ids are sliced along the wrong axis on the text path.

Needs: pip install torch tensordict verl==0.9.1 (two CPU processes, gloo). Exit 1 while the bug is present, 0 once
fixed.

verl.utils.ulysses.ulysses_pad_and_slice_inputs pads, then slices input_ids (1, n) and position_ids with
slice_input_tensor(dim=1). For multi-axis positions (4, 1, n) dim 1 is the singleton batch axis, not the token
axis: each rank gets (4, 0, n) positions instead of (4, 1, n / sp). The FSDP engine takes this path when
use_ulysses_sp and the model config has no vision_config (vision-language models pad without slicing here and
slice after the embedding), i.e. a text-only model fed multi-axis positions.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SP, TOKENS = 2, 6


def rank_main(rank, result):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("REPRO_PORT", "29533"))
    dist.init_process_group("gloo", rank=rank, world_size=SP)
    from verl.utils import ulysses

    ulysses.set_ulysses_sequence_parallel_group(dist.group.WORLD)
    ids = torch.arange(100, 100 + TOKENS).unsqueeze(0)  # (1, n)
    positions = (torch.arange(TOKENS) + torch.arange(4).unsqueeze(1)).unsqueeze(1)  # (4, 1, n): axis a = pos + a
    local_ids, local_pos, pad = ulysses.ulysses_pad_and_slice_inputs(ids, positions, sp_size=SP)
    n = TOKENS // SP
    want = positions[:, :, rank * n:(rank + 1) * n]
    ok = tuple(local_pos.shape) == tuple(want.shape) and torch.equal(local_pos, want)
    result[rank] = int(ok)
    print(f"rank {rank}: ids {tuple(local_ids.shape)}, position_ids got shape {tuple(local_pos.shape)}, "
          f"expected {tuple(want.shape)} {want[:, 0].tolist()} -> {'ok' if ok else 'FAIL'}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    result = mp.get_context("spawn").Array("i", SP)
    mp.spawn(rank_main, args=(result,), nprocs=SP, join=True)
    sys.exit(0 if all(result) else 1)
