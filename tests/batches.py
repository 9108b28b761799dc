"""Hand-written micro-batches for the worked-example and error tests."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from spec.cases.materialize import PadMode, jagged


def lengths_batch(prompts: list[list[int]], responses: list[list[int]], *, temperature=1.0, mrope: bool = False,
                  device: str = "cpu", **flags) -> TensorDict:
    """A micro-batch from explicit prompt and response token lists."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    lens = tuple(len(s) for s in seqs)
    ids = torch.tensor([t for s in seqs for t in s], device=device)
    pos = torch.cat([torch.arange(n, device=device) for n in lens])
    position_ids = (jagged(pos.unsqueeze(0) + torch.arange(4, device=device).unsqueeze(1), lens, jagged_dim=2)
                    if mrope else jagged(pos, lens))
    rlens = tuple(len(r) for r in responses)
    data = {
        "input_ids": jagged(ids, lens),
        "position_ids": position_ids,
        "prompts": jagged(torch.tensor([t for p in prompts for t in p], device=device), tuple(len(p) for p in prompts)),
        "responses": jagged(torch.tensor([t for r in responses for t in r], device=device), rlens),
        "loss_mask": jagged(torch.ones(sum(rlens), dtype=torch.int64, device=device), rlens),
        "response_mask": jagged(torch.ones(sum(rlens), dtype=torch.int64, device=device), rlens),
    }
    per_sample = isinstance(temperature, torch.Tensor) and temperature.dim() >= 1 \
        and temperature.shape[0] == len(seqs)
    if per_sample:
        data["temperature"] = temperature.to(device)
    td = TensorDict(data, batch_size=[len(seqs)])
    if not per_sample:  # a float, or (for error tests) a tensor TensorDict would refuse as a batch entry
        td.set_non_tensor("temperature", temperature)
    td.set_non_tensor("pad_mode", PadMode.NO_PADDING)
    for key, value in flags.items():
        td.set_non_tensor(key, value)
    return td


def seed_batch(**kwargs) -> TensorDict:
    """The seeds' example: prompts of 3 and 2 tokens, responses of 2 and 1 (lengths [5, 3])."""
    return lengths_batch([[1, 2, 3], [6, 7]], [[4, 5], [8]], **kwargs)
