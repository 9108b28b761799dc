"""A tiny deterministic causal model that honours the attention mask and packed boundaries.

Token t's output depends on its own id and position and on the mean embedding of the
tokens it may attend to: earlier tokens of the same sequence that the attention mask
keeps. Packed rows (no mask) are split into sequences at the ``cu_seqlens`` the model is handed (verl's and
TorchTitan's name, or Hugging Face's flash-attention keyword ``cu_seq_lens_q``) when they describe the row in hand
(their last boundary its length), as a varlen flash-attention kernel splits them; otherwise where the (first-axis)
position restarts at 0, as Hugging Face's packed flash-attention models find them. A wrong mask or wrong boundaries
change the logits, as they changed verl's KL.

The head is low rank: ``logits = tanh(hidden(8)) @ proj(8, V)``, so a vocabulary of 152k ids costs
two small matrices; only the ``(n, V)`` logits grow with the vocabulary, and the strategies bound
``n x V``. Logits come in the case's dtype (float32, bfloat16 or float16): computed in float64
and rounded once to that dtype.

The fused-head protocol (``head_input="hidden"``, :class:`spec.protocol.HeadInput`): for engines that compute
log-probs from hidden states and the LM-head weight (TRL's ``add_fused_lm_head``, Liger, verl's fused kernels),
the model hands ``hidden_states`` ``(R, n, 8)`` and ``lm_head_weight`` ``(V, 8)`` instead of logits, both in the
case's dtype, and never materialises the ``(n, V)`` logits, so every size tier stays cheap. Both are quantised
(hidden states to multiples of 2^-6 in [-1, 1], the weight to multiples of 2^-4 in (-8, 8): exact in bfloat16),
so the logits ``hidden_states.float() @ lm_head_weight.float().T`` are exact in float32 in any summation order;
they are what :meth:`ToyCausalLM.logits` returns (float32) for the oracle.

The stand-in vision tower (:mod:`spec.truth.vision`): handed ``pixel_values``/``image_grid_thw`` (and the video
keys), as a Qwen2-VL model is, the model embeds each merged group of patches and puts the embeddings at the image
(video) tokens' rows in order, before the causal mean: a feature dropped, reordered, handed under another grid or
placed at other tokens changes the logits of its tokens and of every later token of the sequence. Without them a
media token is a token like any other. The stand-in audio tower (:mod:`spec.truth.audio`) does the same for
``input_features``/``feature_attention_mask`` at the audio tokens: each clip's frames under its mask, every
``AUDIO_STRIDE`` of them one token.
"""

from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

import torch

from .audio import AUDIO_KEYS, audio_token_id, audio_weights, embed_audio
from .vision import MEDIA_KEYS, embed_media, media_token_ids, place_media, tower_weights

__all__ = ["POSITION_AXES", "ToyCausalLM", "DTYPES", "HEAD_WEIGHT", "HIDDEN_STATES", "rope_positions"]

#: the most position axes (mRoPE sections) the model embeds: positions are (R, n) or (C, R, n), C <= this
POSITION_AXES = 4

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: the fused-head protocol's output fields
HIDDEN_STATES, HEAD_WEIGHT = "hidden_states", "lm_head_weight"
_HIDDEN_STEP, _WEIGHT_STEP, _WEIGHT_MAX = 2.0 ** -6, 2.0 ** -4, 8.0 - 2.0 ** -4


@lru_cache(maxsize=16)
def _weights(vocab: int, seed: int, out_dim: int, hidden: int, max_pos: int, device: str):
    """The model's (read-only) weights: a case's runs and its oracle share them (152k-id heads are
    worth drawing once)."""
    gen = torch.Generator().manual_seed(10_007 + seed)
    embed = torch.randn(vocab, hidden, generator=gen).to(device)
    pos_embed = (0.5 * torch.randn(POSITION_AXES, max_pos, hidden, generator=gen)).to(device)
    proj = (2.0 * torch.randn(hidden, out_dim, generator=gen)).to(device)
    proj64 = proj.double()
    # the fused head's (V, H) LM-head weight: the projection quantised, exact in every logits dtype
    weight64 = ((proj64.T / _WEIGHT_STEP).round() * _WEIGHT_STEP).clamp(-_WEIGHT_MAX, _WEIGHT_MAX)
    return embed, pos_embed, proj, proj64, weight64


def _row_bounds(cu_seqlens: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor | None:
    """The handed ``cu_seqlens`` as the one packed row's boundaries (int64, on its device), where they describe that
    row: one row, its length their last boundary (a shard of a longer row, or no boundaries: None)."""
    if cu_seqlens is None or input_ids.shape[0] != 1:
        return None
    bounds = cu_seqlens.reshape(-1).to(device=input_ids.device, dtype=torch.int64)
    if bounds.numel() < 2 or int(bounds[-1]) != input_ids.shape[1]:
        return None
    return bounds


def rope_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The positions a RoPE model handed no ``position_ids`` works with: Hugging Face's models take ``arange`` over
    each row (their cache positions), and rotary attention depends only on the distance between two tokens, so a
    row's tokens are seen at their distance from its first attended token: ``cumsum(mask) - 1`` (0 before it) for a
    padded row, ``arange`` over a row without a mask (a packed row is then one sequence: its boundaries were in the
    positions the engine did not hand)."""
    if attention_mask is None:
        return torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    keep = (attention_mask != 0).to(torch.int64)
    return (keep.cumsum(-1) - 1).clamp(min=0)


class ToyCausalLM:
    def __init__(self, vocab: int, *, seed: int, out_dim: int | None = None, hidden: int = 8,
                 max_pos: int = 97, device: torch.device | str = "cpu", dtype: str | None = None,
                 head_input: str = "logits") -> None:
        self.vocab = vocab
        self.max_pos = max_pos
        #: the logits' dtype: given, else carried by the case's seed (spec.cases.ModelSeed), else float32
        self.dtype = DTYPES[dtype or getattr(seed, "logits_dtype", "float32")]
        if head_input not in ("logits", "hidden"):
            raise ValueError(f"head_input must be 'logits' or 'hidden', got {head_input!r}")
        #: "hidden": the fused-head protocol (hidden states and the LM-head weight, no logits)
        self.head_input = head_input
        self.embed, self.pos_embed, self.proj, self._proj64, self._weight64 = _weights(
            vocab, int(seed), out_dim or vocab, hidden, max_pos, str(torch.device(device)))
        self._seed, self._hidden, self._device = int(seed), hidden, str(torch.device(device))

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The fused-head protocol's ``(V, H)`` LM-head weight, in :attr:`dtype`."""
        return self._weight64.to(self.dtype, copy=True)  # the cached weight is shared: never hand it out

    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
                      **media: torch.Tensor) -> torch.Tensor:
        """The fused-head protocol's ``(R, n, H)`` hidden states in :attr:`dtype` (quantised: exact in it)."""
        return self._hidden64(input_ids, position_ids, attention_mask, media, cu_seqlens).to(self.dtype)

    def _hidden64(self, input_ids, position_ids, attention_mask, media=None, cu_seqlens=None) -> torch.Tensor:
        features = self._features(input_ids, position_ids, attention_mask, media, cu_seqlens)
        return (features / _HIDDEN_STEP).round() * _HIDDEN_STEP

    def _embed(self, input_ids: torch.Tensor, media: dict | None) -> torch.Tensor:
        """The tokens' float64 embeddings, each media token's replaced by its merged group's (the vision tower)."""
        x = self.embed[input_ids].double()
        if not media:
            return x
        weights = tower_weights(self._seed, self._hidden, self._device)
        for kind, (token_id, (features, grids)) in enumerate(zip(media_token_ids(self.vocab), MEDIA_KEYS.values())):
            if media.get(features) is not None:
                embeds = embed_media(media[features], media.get(grids), weights, kind)
                x = place_media(x, input_ids, token_id, embeds)
        features, mask = AUDIO_KEYS
        if media.get(features) is not None:  # the audio tower (spec.truth.audio)
            embeds = embed_audio(media[features], media.get(mask), audio_weights(self._seed, self._hidden, self._device))
            x = place_media(x, input_ids, audio_token_id(self.vocab), embeds)
        return x

    def logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | None = None, *, cu_seqlens: torch.Tensor | None = None,
               **media: torch.Tensor) -> torch.Tensor:
        """``(R, n, out)`` logits in :attr:`dtype` for ids ``(R, n)`` and positions ``(R, n)`` / ``(C, R, n)``.

        Computed in float64 and rounded once, so the logits of a sequence do not depend on
        how it was batched (packed, padded or alone) beyond that rounding. With the fused head
        (``head_input="hidden"``): ``hidden_states @ lm_head_weight.T``, exact, as float32.
        """
        if self.head_input == "hidden":
            hidden = self._hidden64(input_ids, position_ids, attention_mask, media, cu_seqlens)
            return (hidden @ self._weight64.T).float()
        features = self._features(input_ids, position_ids, attention_mask, media, cu_seqlens)
        return (features @ self._proj64).to(self.dtype)

    def _features(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None = None, media: dict | None = None,
                  cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """``tanh(x + pos + ctx)`` in float64, ``(R, n, H)``: the head's input (``x``: the embeddings, media placed)."""
        x = self._embed(input_ids, media)
        axes = position_ids if position_ids.dim() == 3 else position_ids.unsqueeze(0)
        pos = sum(self.pos_embed[a][axes[a] % self.max_pos] for a in range(axes.shape[0])).double()
        keep = (torch.ones_like(input_ids) if attention_mask is None else attention_mask).to(x.dtype).unsqueeze(-1)
        total = torch.cumsum(x * keep, dim=1)
        count = torch.cumsum(keep, dim=1)
        if attention_mask is None:  # packed: a sequence starts at a handed boundary, or where the position restarts at 0
            steps = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            bounds = _row_bounds(cu_seqlens, input_ids)
            if bounds is not None:  # the varlen kernel's segments: the last boundary at or before each token
                start = bounds[(torch.searchsorted(bounds, steps[0], right=True) - 1).clamp(min=0)].expand_as(steps)
            else:
                start = torch.cummax(torch.where(axes[0] == 0, steps, torch.zeros_like(steps)), dim=1).values
            before = (start - 1).clamp(min=0).unsqueeze(-1)
            has_before = (start > 0).unsqueeze(-1).to(x.dtype)
            total = total - has_before * torch.gather(total, 1, before.expand_as(total))
            count = count - has_before * torch.gather(count, 1, before.expand_as(count))
        ctx = total / count.clamp(min=1.0)
        return torch.tanh(x + pos + ctx)

    def sequence_logits(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lens,
                        **media: torch.Tensor) -> torch.Tensor:
        """``(n, out)`` logits of each sequence run alone (no padding, no packing), concatenated: ids
        ``(n,)`` and positions ``(n,)`` / ``(C, n)`` of the sequences of ``lens`` back to back.

        One call for the whole batch: the sequences are laid out as the rows of a right-padded batch with
        the full-length mask, whose causal prefix sums are those of each sequence alone (the padding comes
        after every real token), then the head runs on the real tokens' rows only."""
        if self.head_input == "hidden":
            return (self._sequence_rows(input_ids, position_ids, lens, self._hidden64, media) @ self._weight64.T).float()
        return (self.sequence_features(input_ids, position_ids, lens, **media) @ self._proj64).to(self.dtype)

    def sequence_features(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lens,
                          **media: torch.Tensor) -> torch.Tensor:
        """``(n, H)`` float64: the head's input of each sequence run alone (:meth:`sequence_logits` before the head;
        a parameterised head, spec/truth/step_model.py, multiplies it by its own weight)."""
        return self._sequence_rows(input_ids, position_ids, lens, self._features, media)

    def _sequence_rows(self, input_ids, position_ids, lens, rows_of, media) -> torch.Tensor:
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
        return rows_of(ids, pos if position_ids.dim() == 2 else pos[0], mask, media)[row, col]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, *, temperature: float | None = None,
                 cu_seqlens: torch.Tensor | None = None, cu_seq_lens_q: torch.Tensor | None = None,
                 shift_labels: torch.Tensor | None = None, return_dict: bool = True,
                 pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                 pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                 input_features: torch.Tensor | None = None, feature_attention_mask: torch.Tensor | None = None,
                 **_ignored: object) -> SimpleNamespace:
        """HF-style call. With ``temperature`` (fused kernels) it also returns float32 ``log_probs`` and
        ``entropy``, scoring ``shift_labels`` or, when absent, the next id of each row. With the fused head
        (``head_input="hidden"``) it returns ``hidden_states`` and ``lm_head_weight`` instead of ``logits``. The media
        keys feed the vision tower (module doc). Without ``position_ids`` it computes them as a RoPE model does
        (:func:`rope_positions`). A packed row's ``cu_seqlens`` (``cu_seq_lens_q``) split its sequences (module doc)."""
        if cu_seqlens is None:
            cu_seqlens = cu_seq_lens_q
        media = {key: value for key, value in (("pixel_values", pixel_values), ("image_grid_thw", image_grid_thw),
                                               ("pixel_values_videos", pixel_values_videos),
                                               ("video_grid_thw", video_grid_thw), ("input_features", input_features),
                                               ("feature_attention_mask", feature_attention_mask)) if value is not None}
        if position_ids is None:
            position_ids = rope_positions(input_ids, attention_mask)
        if self.head_input == "hidden":
            out = SimpleNamespace(**{HIDDEN_STATES: self.hidden_states(input_ids, position_ids, attention_mask,
                                                                       cu_seqlens=cu_seqlens, **media),
                                     HEAD_WEIGHT: self.lm_head_weight})
        else:
            out = SimpleNamespace(logits=self.logits(input_ids, position_ids, attention_mask, cu_seqlens=cu_seqlens,
                                                     **media))
        if temperature is not None:
            logits = self.logits(input_ids, position_ids, attention_mask, cu_seqlens=cu_seqlens, **media)
            labels = shift_labels if shift_labels is not None else torch.roll(input_ids, -1, dims=-1)
            scaled = logits.float() / max(float(temperature), 1e-8)
            lsm = torch.log_softmax(scaled, dim=-1)
            out.log_probs = lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            out.entropy = -(lsm.exp() * lsm).sum(-1)
        return out
