"""The checks of what each sequence-parallel rank hands over, stated once: its share of the padded row (pad_size, its
token count, the tail's positions and temperature, outputs of exactly the real tokens), the shapes it hands the model
and its own output step, its labels against its slice of the global row rolled by one. The invariants
(spec/invariants/ranks.py) call them on the suite's real ranks; the real-rank reproducer calls the same functions on
its own gloo ranks' results (``repro_suite.py``; spec/repro/vendored/real_ranks.py). So they take plain values: per
rank the tensors its view of the hand-off carries, in rank order, and fail by :func:`~spec.truth.failing.fail`.
"""

from __future__ import annotations

import torch

from .failing import fail

__all__ = ["count", "replicated", "joined_row", "restarts", "scored", "rank_labels", "rank_pad_and_tail", "rank_shapes"]


def count(tensor) -> int:
    """Tokens a per-token hand-off tensor holds, whatever its shape (-1 when the engine hands none)."""
    return -1 if not isinstance(tensor, torch.Tensor) else tensor.numel()


def replicated(ids, labels) -> bool:
    """Every rank was handed the whole padded row (verl's vision-language path, where the model slices after its
    embedding) rather than its slice: ``ids``, ``labels`` per rank."""
    ids = [x.detach().cpu() for x in ids]
    local = sum(count(x) for x in labels)
    return len(ids) > 1 and ids[0].shape[-1] == local and all(torch.equal(x, ids[0]) for x in ids[1:])


def joined_row(parts, whole: bool) -> torch.Tensor:
    """A model input over the whole padded row: the ranks' slices ``parts`` joined, or (``whole``: every rank got
    it) the first rank's."""
    parts = [p.detach().cpu() for p in parts]
    return parts[0] if whole else torch.cat(parts, dim=-1)


def restarts(tail: torch.Tensor) -> bool:
    """Tail positions start at 0 and each is 0 or its left neighbour + 1, on every axis: the pad is its own
    sequence(s), never part of the last real one. One run (impl) or a run per pad (verl restarts at 0 for
    the sp pad after the bucket pad) are both fine: the contract leaves the count open."""
    if tail.shape[-1] == 0:
        return True
    first_ok = bool((tail[..., 0] == 0).all())
    steps = tail[..., 1:]
    return first_ok and bool(((steps == 0) | (steps == tail[..., :-1] + 1)).all())


def scored(seq_lens, padded: int) -> torch.Tensor:
    """Over the padded global row: True where a position's label is read (it scores the next token of its own
    sequence); each sequence's last token and the tail padding score nothing a consumer reads."""
    total = sum(seq_lens)
    out = torch.zeros(padded, dtype=torch.bool)
    out[:total] = True
    out[torch.tensor(list(seq_lens)).cumsum(0) - 1] = False
    return out


def rank_labels(labels, model_labels, ids, seq_lens, padded: int, sp_size: int, fused: bool, exact: bool) -> None:
    """INV-RANK-002/008: each rank's labels (and fused shift_labels) against its slice of the global packed row
    ``ids`` rolled by one, then zeros to ``padded``: at the positions whose label is read, or (``exact``) everywhere,
    the unread wrap and the zero tail included."""
    ids = ids.cpu()
    want = torch.cat([torch.roll(ids, -1), ids.new_zeros(padded - ids.shape[0])])
    check = torch.ones(padded, dtype=torch.bool) if exact else scored(seq_lens, padded)
    local = padded // sp_size
    for r, (got, shift) in enumerate(zip(labels, model_labels)):
        if got is None:
            fail(f"sp={sp_size} rank {r}: the engine hands no labels to its output step")
        got = got.reshape(-1).cpu()
        mine, at = want[r * local:(r + 1) * local], check[r * local:(r + 1) * local]
        what = "its slice of the global row" if exact else "at the positions whose label is read (its slice of the global row"
        if got.shape != mine.shape or not torch.equal(got[at], mine[at]):
            edge = [k for k in range(min(len(got), len(mine))) if at[k] and got[k] != mine[k]]
            fail(f"sp={sp_size} rank {r}: rolled labels {got.tolist()}, expected {mine.tolist()} ({what} "
                 f"{ids.tolist()} rolled by one" + ("" if exact else ")")
                 + (f"; first wrong at local position {edge[0]})" if edge else ")"))
        if fused and (shift is None or tuple(shift.shape) != (1, local) or not torch.equal(shift[0].cpu()[at], mine[at])):
            fail(f"sp={sp_size} rank {r}: fused shift_labels "
                 f"{None if shift is None else shift.tolist()}, expected [{mine.tolist()}] ({what})")


def _token_temperature(sp_size: int, rank: int, temperature) -> torch.Tensor:
    """The per-token temperature one rank hands its output step, flat on the CPU."""
    if not isinstance(temperature, torch.Tensor):
        fail(f"sp={sp_size} rank {rank}: the hand-off carries temperature {temperature!r}, expected one per token")
    return temperature.reshape(-1).cpu()


def rank_pad_and_tail(ids, positions, labels, temperatures, pad_sizes, rank_outputs, seq_lens, padded: int,
                      sp_size: int, bucket, mrope: bool, leaked) -> None:
    """INV-RANK-003: pad_size = the bucket and sequence-parallel pad (``padded`` - total_nnz), each rank holds
    ``padded / sp`` tokens, the tail's positions restart at 0 with temperature 1 (``temperatures`` None: an engine that
    hands its output step no temperature), and every rank's outputs hold exactly the real tokens;
    ``leaked(key, value)``: the (sequence, position) pairs of an output a consumer reads that
    are not finite where they should be (what the poisoned tail put there)."""
    total = sum(seq_lens)
    pad, local = padded - total, padded // sp_size
    whole = replicated(ids, labels)
    for r, (rank_ids, rolled, pad_size) in enumerate(zip(ids, labels, pad_sizes)):
        if pad_size != pad:
            fail(f"sp={sp_size} rank {r}: pad_size {pad_size!r}, expected {pad} (total_nnz={total}, bucket={bucket})")
        rolled = (count(rolled),)
        width = rank_ids.shape[-1]
        if rolled != (local,) or rank_ids.shape[0] != 1 or not (width == local or (whole and width == local * sp_size)):
            fail(f"sp={sp_size} rank {r}: input_ids {tuple(rank_ids.shape)}, rolled labels {rolled}, "
                 f"expected {local} tokens = (total_nnz {total} + pad {pad}) / sp (input_ids may be the whole "
                 "padded row when every rank gets it)")
    row = joined_row(ids, whole)[0]
    pos = joined_row(positions, whole)
    tail_temps = None if temperatures is None else torch.cat(  # None: the engine hands over none
        [_token_temperature(sp_size, r, t) for r, t in enumerate(temperatures)])[total:]
    tail_pos = pos[..., 0, total:] if mrope else pos[0, total:]
    if row.shape[0] != padded or not restarts(tail_pos) or \
            (tail_temps is not None and not torch.equal(tail_temps, torch.ones(pad))):
        fail(f"sp={sp_size}: packed row of {row.shape[0]} tokens (expected {padded}), tail positions "
             f"{tail_pos.tolist()}, temperature {'none handed over' if tail_temps is None else tail_temps.tolist()}; "
             "expected positions from 0 on every axis (runs 0, 1, 2, ...) and ones")
    offsets = torch.tensor((0, *seq_lens)).cumsum(0)
    for r, outputs in enumerate(rank_outputs):
        for key, value in outputs.items():
            if not value.is_nested or not torch.equal(value.offsets().cpu(), offsets) \
                    or value.values().shape[0] != total:
                fail(f"sp={sp_size} rank {r}: output {key!r} holds {value.values().shape[0]} tokens "
                     f"(offsets {value.offsets().tolist() if value.is_nested else '-'}), expected the {total} real ones")
            bad = leaked(key, value)  # at the positions a consumer reads, not a NaN of the engine's own
            if bad:
                fail(f"sp={sp_size} rank {r}: output {key!r} is not finite at (sequence, position) {bad[:4]} "
                     "with the tail poisoned, and finite there when the sample runs alone unpadded")


def rank_shapes(ids, positions, labels, temperatures, model_labels, pad_sizes, total_nnz: int, sp_size: int,
                mrope_axes, fused: bool) -> None:
    """INV-RANK-006: each rank's model inputs are (1, n) ids and (1, n) or (C, 1, n) positions (``mrope_axes`` C, or
    None), the labels and temperature it hands its output step (whatever their private shape; ``temperatures`` None:
    an engine that hands over none) and fused shift_labels have the n tokens the model returns, and
    n * sp = total_nnz + pad_size, n the same on every rank."""
    whole = replicated(ids, labels)
    temperatures = [None] * len(ids) if temperatures is None else temperatures
    widths = set()
    for r, (rank_ids, pos, rolled, temp, shift, pad_size) in enumerate(zip(ids, positions, labels, temperatures,
                                                                          model_labels, pad_sizes)):
        # the model returns one row per input token, or per token of its slice when every rank is handed
        # the whole row (verl's vision-language path: the model slices after its embedding)
        width = rank_ids.shape[-1]
        n = width // sp_size if whole else width
        widths.add(n)
        shapes = {"input_ids": (tuple(rank_ids.shape), (1, width)),
                  "position_ids": (None if pos is None else tuple(pos.shape),
                                   (mrope_axes, 1, width) if mrope_axes else (1, width)),
                  # the hand-off to the output step: only its token count is part of the contract
                  "labels": ((count(rolled),), (n,))}
        if temp is not None:
            shapes["temperature"] = ((count(temp),), (n,))
        if fused:
            shapes["shift_labels"] = (None if shift is None else tuple(shift.shape), (1, n))
        for key, (got, want) in shapes.items():
            if got != want:
                fail(f"sp={sp_size} rank {r}: {key} has shape {got}, expected {want} (the rank's model "
                     f"input and output hold {n} tokens)")
        if n * sp_size != total_nnz + pad_size:
            fail(f"sp={sp_size} rank {r}: {n} tokens x {sp_size} ranks != total_nnz {total_nnz} + "
                 f"pad_size {pad_size}")
    if len(widths) != 1:
        fail(f"sp={sp_size}: ranks hold different numbers of tokens {sorted(widths)}")
