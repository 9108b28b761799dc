"""A tiny deterministic causal model that honours the attention mask and packed boundaries.

Token t's output depends on its own id and position and on the mean embedding of the
tokens it may attend to: earlier tokens of the same sequence that the attention mask
keeps. Packed rows (no mask) are split into sequences where the (first-axis) position
restarts at 0, as packed flash-attention models do. A wrong mask or wrong boundaries
change the logits, as they changed verl's KL.

The head is low rank: ``logits = tanh(hidden(8)) @ proj(8, V)``, so a vocabulary of 152k ids costs
two small matrices; only the ``(n, V)`` logits grow with the vocabulary, and the strategies bound
``n x V``. Logits come in the case's dtype (float32, bfloat16 or float16): computed in float64
and rounded once to that dtype.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import torch

__all__ = ["ToyCausalLM", "DTYPES"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@lru_cache(maxsize=16)
def _weights(vocab: int, seed: int, out_dim: int, hidden: int, max_pos: int, device: str):
    """The model's (read-only) weights: a case's runs and its oracle share them (152k-id heads are
    worth drawing once)."""
    gen = torch.Generator().manual_seed(10_007 + seed)
    embed = torch.randn(vocab, hidden, generator=gen).to(device)
    pos_embed = (0.5 * torch.randn(4, max_pos, hidden, generator=gen)).to(device)
    proj = (2.0 * torch.randn(hidden, out_dim, generator=gen)).to(device)
    return embed, pos_embed, proj, proj.double()


class ToyCausalLM:
    def __init__(self, vocab: int, *, seed: int, out_dim: int | None = None, hidden: int = 8,
                 max_pos: int = 97, device: torch.device | str = "cpu", dtype: str | None = None) -> None:
        self.vocab = vocab
        self.max_pos = max_pos
        #: the logits' dtype: given, else carried by the case's seed (spec.cases.ModelSeed), else float32
        self.dtype = DTYPES[dtype or getattr(seed, "logits_dtype", "float32")]
        self.embed, self.pos_embed, self.proj, self._proj64 = _weights(
            vocab, int(seed), out_dim or vocab, hidden, max_pos, str(torch.device(device)))

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(R, n, out)`` logits in :attr:`dtype` for ids ``(R, n)`` and positions ``(R, n)`` / ``(C, R, n)``.

        Computed in float64 and rounded once, so the logits of a sequence do not depend on
        how it was batched (packed, padded or alone) beyond that rounding.
        """
        return (self._hidden(input_ids, position_ids, attention_mask) @ self._proj64).to(self.dtype)

    def _hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(R, n, hidden)`` float64: the head's input, ``tanh(embedding + positions + causal mean)``."""
        x = self.embed[input_ids].double()
        axes = position_ids if position_ids.dim() == 3 else position_ids.unsqueeze(0)
        pos = sum(self.pos_embed[a][axes[a] % self.max_pos] for a in range(axes.shape[0])).double()
        keep = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(x.dtype).unsqueeze(-1)
        total = torch.cumsum(x * keep, dim=1)
        count = torch.cumsum(keep, dim=1)
        if attention_mask is None:  # packed: a sequence starts where the position restarts at 0
            steps = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            start = torch.cummax(torch.where(axes[0] == 0, steps, torch.zeros_like(steps)), dim=1).values
            before = (start - 1).clamp(min=0).unsqueeze(-1)
            has_before = (start > 0).unsqueeze(-1).to(x.dtype)
            total = total - has_before * torch.gather(total, 1, before.expand_as(total))
            count = count - has_before * torch.gather(count, 1, before.expand_as(count))
        ctx = total / count.clamp(min=1.0)
        return torch.tanh(x + pos + ctx)

    def sequence_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lens) -> torch.Tensor:
        """``(n, out)`` logits of each sequence run alone (no padding, no packing), concatenated: ids
        ``(n,)`` and positions ``(n,)`` / ``(C, n)`` of the sequences of ``lens`` back to back.

        One call for the whole batch: the sequences are laid out as the rows of a right-padded batch with
        the full-length mask, whose causal prefix sums are those of each sequence alone (the padding comes
        after every real token), then the head runs on the real tokens' rows only."""
        lens_t = torch.as_tensor([int(n) for n in lens], dtype=torch.int64)
        width = int(lens_t.max())
        row = torch.repeat_interleave(torch.arange(lens_t.shape[0]), lens_t)
        starts = torch.repeat_interleave(torch.cumsum(lens_t, 0) - lens_t, lens_t)
        col = torch.arange(row.shape[0]) - starts
        ids = input_ids.new_zeros((lens_t.shape[0], width))
        ids[row, col] = input_ids
        axes = position_ids if position_ids.dim() == 2 else position_ids.unsqueeze(0)
        pos = axes.new_zeros((axes.shape[0], lens_t.shape[0], width))
        pos[:, row, col] = axes
        mask = (torch.arange(width).unsqueeze(0) < lens_t.unsqueeze(1)).to(torch.int64)
        hidden = self._hidden(ids, pos if position_ids.dim() == 2 else pos[0], mask)[row, col]
        return (hidden @ self._proj64).to(self.dtype)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, *, temperature: float | None = None,
                 shift_labels: torch.Tensor | None = None, return_dict: bool = True,
                 **_ignored: object) -> SimpleNamespace:
        """HF-style call. With ``temperature`` (fused kernels) it also returns float32 ``log_probs`` and
        ``entropy``, scoring ``shift_labels`` or, when absent, the next id of each row."""
        logits = self.logits(input_ids, position_ids, attention_mask)
        out = SimpleNamespace(logits=logits)
        if temperature is not None:
            labels = shift_labels if shift_labels is not None else torch.roll(input_ids, -1, dims=-1)
            scaled = logits.float() / max(float(temperature), 1e-8)
            lsm = torch.log_softmax(scaled, dim=-1)
            out.log_probs = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            out.entropy = -(lsm.exp() * lsm).sum(-1)
        return out
