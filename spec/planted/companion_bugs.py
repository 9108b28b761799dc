"""Quiet planted bugs in an engine's own companion (``EngineUnderTest.logits_processor``): the top-K distillation
processor the engine hands its own ``prepare_model_outputs``, as verl hands its ``distillation_ppo_loss``.

The engine is impl; only its companion differs from the suite's stand-in, behind a switch of its own
(:data:`SWITCHES`, drawn like any other configuration switch).
"""

from __future__ import annotations

from typing import Any

import torch

from ..protocol.engine import ConfigSwitch
from ..protocol.profile import drawn_config
from ..truth.oracle import topk_terms

__all__ = ["ChunkedTopKDropsLastChunk", "SWITCHES"]


class ChunkedTopKDropsLastChunk:
    """An own top-K processor that streams the tokens in chunks of ``topk_chunk`` (memory at long context, as verl's
    ``use_chunked_topk``) but loops ``range(0, n - n % chunk, chunk)``: the tokens of a last, short chunk keep the
    zeros the output was allocated with. Shows with the switch set and ``chunk`` not dividing the tokens the
    processor is handed (INV-VAL-004); under sequence parallelism it slices the teacher tensors per rank as verl
    does (padded to a multiple of ``sp``)."""

    switch = "topk_chunk"

    def __init__(self, keys: tuple[str, ...], chunk: int, sp_size: int = 1, sp_rank: int = 0):
        self.keys, self.chunk, self.sp_size, self.sp_rank = keys, int(chunk), sp_size, sp_rank

    @classmethod
    def companion(cls, case: Any, sp_size: int = 1, sp_rank: int = 0) -> "ChunkedTopKDropsLastChunk | None":
        chunk = drawn_config(case).get(cls.switch)
        return None if not chunk else cls(tuple(case.distillation_keys), chunk, sp_size, sp_rank)

    def _teacher(self, data: Any, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, lp = data["teacher_ids"].values(), data["teacher_logprobs"].values().float()
        if self.sp_size > 1 and rows != ids.shape[0]:  # this rank's Ulysses shard of the padded row
            pad = rows * self.sp_size - ids.shape[0]
            ids = torch.cat([ids, ids.new_zeros(pad, ids.shape[1])])[self.sp_rank * rows:(self.sp_rank + 1) * rows]
            lp = torch.cat([lp, lp.new_zeros(pad, lp.shape[1])])[self.sp_rank * rows:(self.sp_rank + 1) * rows]
        return ids, lp

    def __call__(self, student_logits: torch.Tensor, data: Any, **_: object) -> dict[str, torch.Tensor]:
        logits = student_logits[0].float()
        n = logits.shape[0]
        ids, lp = self._teacher(data, n)
        if ids.shape[0] != n:
            raise ValueError(f"student_logits {tuple(student_logits.shape)} do not align with teacher tensors of "
                             f"{ids.shape[0]} tokens")
        out = {key: logits.new_zeros(n) for key in self.keys}
        for start in range(0, n - n % self.chunk, self.chunk):  # the bug: a last, short chunk is never computed
            stop = start + self.chunk
            terms = topk_terms(logits[start:stop], ids[start:stop], lp[start:stop])
            for key in self.keys:
                out[key][start:stop] = terms[key].float()
        return {key: value.unsqueeze(0) for key, value in out.items()}


#: bug class -> the switch it declares
SWITCHES = {
    ChunkedTopKDropsLastChunk: ConfigSwitch(
        "topk_chunk", (None, 2, 3), "the engine's own top-K processor streams the tokens in chunks of this many",
        needs=("distillation",)),
}
