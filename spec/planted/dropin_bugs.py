"""Planted bugs in left_right_2_no_padding on the batches verl accepts beyond the trainer layout."""

from __future__ import annotations

import warnings

import torch

import impl


def _quiet(data):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return impl.left_right_2_no_padding(data)


def left_right_runs_from_column_counts(data):
    """left_right_2_no_padding assumes the left-right layout: row i's tokens are the columns
    [P - p_i, P + r_i) for the valid counts p_i, r_i of the prompt and response columns."""
    out = _quiet(data)
    mask = data["attention_mask"].bool()
    width = data["response_mask"].shape[1]
    prompt_width = mask.shape[1] - width
    p, r = mask[:, :prompt_width].sum(1), mask[:, prompt_width:].sum(1)
    rows = [(row[prompt_width - a:prompt_width + b], pos[prompt_width - a:prompt_width + b])
            for row, pos, a, b in zip(data["input_ids"], data["position_ids"], p.tolist(), r.tolist())]
    offsets = torch.nn.functional.pad((p + r).cumsum(0), (1, 0))
    out["input_ids"] = torch.nested.nested_tensor_from_jagged(torch.cat([t for t, _ in rows]), offsets)
    out["position_ids"] = torch.nested.nested_tensor_from_jagged(torch.cat([q for _, q in rows]), offsets)
    return out


def left_right_split_from_columns(data):
    """left_right_2_no_padding ignores the nested prompts/responses the batch carries and splits each
    row by the valid tokens among the response columns."""
    keep = [k for k in data.keys() if k not in ("prompts", "responses")]
    return _quiet(data.select(*keep))


def left_right_loss_mask_keeps_stray_marks(data):
    """left_right_2_no_padding nests response_mask up to its last mark, so marks on padding columns
    become response tokens of the loss mask."""
    out = _quiet(data)
    resp = data["response_mask"]
    cols = torch.arange(resp.shape[1]).unsqueeze(0)
    last = torch.where(resp.bool(), cols + 1, 0).amax(1)
    lens = torch.maximum(out["loss_mask"].offsets().diff(), last)
    values = resp[cols < lens.unsqueeze(1)]
    loss = torch.nested.nested_tensor_from_jagged(values, torch.nn.functional.pad(lens.cumsum(0), (1, 0)))
    out["loss_mask"] = loss
    out["response_mask"] = loss
    return out
