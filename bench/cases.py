"""Seeded benchmark inputs: jagged micro-batches, dense left-right batches, logits.

Every builder is deterministic in its ``seed``: impl, verl and the floor see the very
same tensors (the same Python objects) in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import TensorDict

__all__ = ["Geometry", "HelperCase", "OutputCase", "make_geometry", "micro_batch", "left_right_batch",
           "packed_logits", "padded_logits", "HELPER_CASES", "OUTPUT_CASES", "QUICK_HELPER_CASES",
           "QUICK_OUTPUT_CASES"]


@dataclass(frozen=True)
class HelperCase:
    batch: int
    max_prompt: int
    max_response: int
    seed: int = 0

    @property
    def name(self) -> str:
        return f"B={self.batch} P,R<={self.max_prompt},{self.max_response}"


@dataclass(frozen=True)
class OutputCase:
    batch: int
    max_prompt: int
    max_response: int
    vocab: int
    seed: int = 0

    @property
    def name(self) -> str:
        return f"B={self.batch} P,R<={self.max_prompt},{self.max_response} V={self.vocab}"


# Prompt and response lengths are uniform in [1, max] (seeded).
HELPER_CASES = [HelperCase(8, 2048, 2048), HelperCase(64, 2048, 2048), HelperCase(256, 2048, 2048)]
# Logit tensors of ~0.25 GiB (float32): big enough that the per-token math dominates, small
# enough that verl's padded path (which works on the whole padded batch) stays within a few
# GiB on a 24 GiB machine and a full run fits in ~15 minutes on 2 cores.
OUTPUT_CASES = [OutputCase(8, 256, 256, 32768), OutputCase(64, 512, 512, 2048)]
QUICK_HELPER_CASES = [HelperCase(8, 512, 512), HelperCase(256, 64, 64)]
QUICK_OUTPUT_CASES = [OutputCase(8, 64, 64, 4096)]


@dataclass
class Geometry:
    prompt_lens: torch.Tensor  # (B,) int64
    response_lens: torch.Tensor  # (B,) int64
    vocab: int
    seed: int

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prompt_lens + self.response_lens

    @property
    def total(self) -> int:
        return int(self.seq_lens.sum())

    @property
    def max_seq(self) -> int:
        return int(self.seq_lens.max())

    @property
    def batch(self) -> int:
        return int(self.prompt_lens.numel())


def make_geometry(batch: int, max_prompt: int, max_response: int, vocab: int = 32000, seed: int = 0) -> Geometry:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, max_prompt + 1, (batch,), generator=g)
    response = torch.randint(1, max_response + 1, (batch,), generator=g)
    return Geometry(prompt, response, vocab, seed)


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0))


def _nested(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    return torch.nested.nested_tensor_from_jagged(values, _offsets(lengths))


def micro_batch(geo: Geometry, *, use_remove_padding: bool = True, calculate_entropy: bool = False,
                pad_mode: object = "no_padding") -> TensorDict:
    """A jagged micro-batch with the keys both engines read.

    ``temperature`` is a per-sample ``(B,)`` tensor in [0.5, 1.5] (so the scaling is real
    work in both engines); ``pad_mode`` is verl's ``DatasetPadMode.NO_PADDING`` when verl
    is importable (a ``str`` Enum) and the plain string otherwise.
    """
    g = torch.Generator().manual_seed(geo.seed + 1)
    prompts = torch.randint(1, geo.vocab, (int(geo.prompt_lens.sum()),), generator=g)
    responses = torch.randint(1, geo.vocab, (int(geo.response_lens.sum()),), generator=g)
    p_parts = prompts.split(geo.prompt_lens.tolist())
    r_parts = responses.split(geo.response_lens.tolist())
    ids = torch.cat([t for pair in zip(p_parts, r_parts) for t in pair])
    seq_off = _offsets(geo.seq_lens)
    positions = torch.arange(geo.total) - torch.repeat_interleave(seq_off[:-1], geo.seq_lens)
    td = TensorDict(
        {
            "input_ids": _nested(ids, geo.seq_lens),
            "position_ids": _nested(positions, geo.seq_lens),
            "prompts": _nested(prompts, geo.prompt_lens),
            "responses": _nested(responses, geo.response_lens),
            "loss_mask": _nested(torch.ones(int(geo.response_lens.sum()), dtype=torch.int64), geo.response_lens),
            "temperature": 0.5 + torch.rand(geo.batch, generator=g),
        },
        batch_size=[geo.batch],
    )
    td.set_non_tensor("use_remove_padding", use_remove_padding)
    td.set_non_tensor("pad_mode", pad_mode)
    td.set_non_tensor("use_fused_kernels", False)
    td.set_non_tensor("pad_token_id", 0)
    td.set_non_tensor("calculate_entropy", calculate_entropy)
    td.set_non_tensor("max_response_len", int(geo.response_lens.max()))
    return td


def left_right_batch(geo: Geometry) -> TensorDict:
    """The same sequences as a dense left-right padded batch (prompt left-, response right-padded)."""
    g = torch.Generator().manual_seed(geo.seed + 2)
    width_p, width_r = int(geo.prompt_lens.max()), int(geo.response_lens.max())
    cols_p, cols_r = torch.arange(width_p), torch.arange(width_r)
    prompt_mask = cols_p.unsqueeze(0) >= (width_p - geo.prompt_lens).unsqueeze(1)
    resp_mask = cols_r.unsqueeze(0) < geo.response_lens.unsqueeze(1)
    mask = torch.cat([prompt_mask, resp_mask], 1)
    ids = torch.randint(1, geo.vocab, mask.shape, generator=g) * mask
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    return TensorDict(
        {
            "input_ids": ids,
            "attention_mask": mask.to(torch.int64),
            "response_mask": resp_mask.to(torch.int64),
            "position_ids": positions,
        },
        batch_size=[geo.batch],
    )


def packed_logits(geo: Geometry, dtype: torch.dtype) -> torch.Tensor:
    """``(1, total_nnz, V)`` random logits (scale 3, so the softmax is not flat)."""
    g = torch.Generator().manual_seed(geo.seed + 3)
    out = torch.empty(1, geo.total, geo.vocab, dtype=dtype)
    for chunk in out[0].split(4096):  # bounded float32 temporaries for bf16 output
        chunk.copy_(torch.randn(chunk.shape, generator=g).mul_(3))
    return out


def padded_logits(geo: Geometry, dtype: torch.dtype) -> torch.Tensor:
    """``(B, max_seq_len, V)`` random logits, random (finite) values in the padding too."""
    g = torch.Generator().manual_seed(geo.seed + 3)
    out = torch.empty(geo.batch, geo.max_seq, geo.vocab, dtype=dtype)
    for chunk in out.view(-1, geo.vocab).split(4096):
        chunk.copy_(torch.randn(chunk.shape, generator=g).mul_(3))
    return out
