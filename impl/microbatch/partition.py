"""Balanced partitions of a mini-batch's samples (or groups) by verl's workload measure, vectorised.

verl partitions with Karmarkar-Karp's largest differencing method: a heap of B states
merged one pair at a time in Python (seconds at B = 1024, about a minute at B = 8192).
Here:

1. **Parallel differencing.** The workloads, sorted, are cut into rounds of ``k``; each
   round is a state of ``k`` sets. At each level every state is paired with its neighbour
   in order of spread (largest set minus smallest) and merged the differencing way (the
   largest set of one with the smallest of the other); ``log2(B / k)`` levels of tensor
   operations, no loop over samples.
2. **Exchanges.** Each set then holds about ``B / k`` items, which a skewed rollout (many
   short responses, a few at the maximum) needs unequal. Bounded passes of exchanges fix
   that and push the heaviest set down: (a) every heavy set against a light one at once,
   the best single swap or move of each pair (a batched ``searchsorted``); (b) the heaviest
   set against every other item and set; (c) the heaviest against the lightest with pairs
   of items (a finer grain, what differencing reaches with tiny spreads). Each accepted
   exchange lowers the heavier set of its pair below its old load, so the maximum never
   rises; the loops stop when none is found or the maximum reaches ``ceil(total / k)``.

3. **The token budget** (:func:`fit_budget`, called by ``rearrange_micro_batches``): equal
   workloads are not equal token sums (the ``s ** 2`` term), so with ``k = ceil(total /
   budget)`` a set can end a few tokens over, where verl would add a micro-batch. Exchanges
   bring every set within the budget, then exchanges that keep both sets within it win the
   workload balance back: single swaps and moves against the 64 lightest sets, pairs
   against the 8 lightest, up to ``20 k`` exchanges (near the budget each moves little).

The loops run over passes and over micro-batches, never over samples. On verl's own measure
(the largest micro-batch workload) the result is at least as good as verl's on the inputs
of ``tests/test_dropin_microbatch.py`` and of ``bench/microbatch.py`` (where the token
budget binds too, B >= 4096). It is a heuristic, like verl's, not an optimum.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import ShapeError

__all__ = ["calculate_workload", "ceildiv", "roundup_divisible", "balanced_bins", "fit_budget", "bins_to_partitions",
           "get_seqlen_balanced_partitions"]

_BIG = torch.iinfo(torch.int64).max // 4
#: within the token budget, pair exchanges are tried against this many of the lightest sets (unbounded: the lightest one)
PAIR_PARTNERS = 8
#: within the token budget each exchange moves little workload (the sets sit near the budget): more of them
BUDGET_EXCHANGES_PER_SET = 20


def calculate_workload(seqlen_list: torch.Tensor) -> torch.Tensor:
    """verl's workload estimate of a sequence: ``24576 * s + s ** 2`` (dense 7B-model FLOPs, up to a factor)."""
    return 24576 * seqlen_list + seqlen_list**2


def ceildiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints."""
    return -(a // -b)


def roundup_divisible(a: int, b: int) -> int:
    """The smallest multiple of ``b`` that is ``>= a``."""
    return ((a + b - 1) // b) * b


def _differencing(w: torch.Tensor, k: int) -> torch.Tensor:
    """Step 1: each item's set, by pairwise differencing of states level by level."""
    n = w.numel()
    order = torch.argsort(w, descending=True, stable=True)
    rounds = ceildiv(n, k)
    padded = torch.zeros(rounds * k, dtype=torch.int64)
    padded[:n] = w.index_select(0, order)
    sums = padded.view(rounds, k)  # each row sorted, largest first
    item_state = torch.arange(rounds * k) // k
    item_col = torch.arange(rounds * k) % k
    cols = torch.arange(k)
    while sums.shape[0] > 1:
        states = sums.shape[0]
        by_top = torch.argsort(sums[:, 0], descending=True, stable=True)
        spread = sums[:, 0] - sums[:, -1]
        ranked = by_top.index_select(0, torch.argsort(spread.index_select(0, by_top), descending=True, stable=True))
        pairs = states // 2
        a, b = ranked[0:2 * pairs:2], ranked[1:2 * pairs:2]
        merged = sums.index_select(0, a) + sums.index_select(0, b).flip(1)
        perm = torch.argsort(merged, dim=1, descending=True, stable=True)
        new_sums = merged.gather(1, perm)
        where = torch.empty_like(perm).scatter_(1, perm, cols.expand(pairs, k))  # column -> new column
        new_state = torch.empty(states, dtype=torch.int64)
        new_state[a] = torch.arange(pairs)
        new_state[b] = torch.arange(pairs)
        flipped = torch.zeros(states, dtype=torch.bool)
        flipped[b] = True
        if states % 2:
            rest = ranked[2 * pairs:]
            new_state[rest] = pairs
            new_sums = torch.cat([new_sums, sums.index_select(0, rest)])
            where = torch.cat([where, cols.unsqueeze(0)])
        col = torch.where(flipped.index_select(0, item_state), k - 1 - item_col, item_col)
        item_state = new_state.index_select(0, item_state)
        item_col = where[item_state, col]
        sums = new_sums
    bins = torch.empty(n, dtype=torch.int64)
    bins[order] = item_col[:n]
    return bins


def _members(bins: torch.Tensor, k: int) -> torch.Tensor:
    """``(k, max count)`` item indices of each set, ``-1`` padded."""
    order = torch.argsort(bins, stable=True)
    counts = torch.bincount(bins, minlength=k)
    starts = counts.cumsum(0) - counts
    sorted_bins = bins.index_select(0, order)
    slot = torch.arange(bins.numel()) - starts.index_select(0, sorted_bins)
    out = torch.full((k, int(counts.max())), -1, dtype=torch.int64)
    out[sorted_bins, slot] = order
    return out


def _paired_passes(w: torch.Tensor, bins: torch.Tensor, loads: torch.Tensor, k: int, moves: bool,
                   passes: int = 32) -> None:
    """Step 2a: heavy set i against light set i (or i + 1 on odd passes), best swap/move of each pair at once."""
    half = k // 2
    if half == 0:
        return
    w_pad = torch.cat([w, torch.tensor([_BIG])])  # index -1: an empty slot
    for it in range(passes):
        order = torch.argsort(loads, descending=True, stable=True)
        heavy = order[:half]
        light = order.flip(0)[:half]
        if it % 2:
            light = torch.roll(light, 1)
        gap = (loads.index_select(0, heavy) - loads.index_select(0, light)).unsqueeze(1)
        members = _members(bins, k)
        x_idx = members.index_select(0, heavy)
        y_idx = members.index_select(0, light)
        if moves:  # receiving nothing: a move
            y_idx = torch.cat([y_idx, torch.full((half, 1), -2, dtype=torch.int64)], 1)
        x = w_pad[x_idx]
        y = torch.where(y_idx == -2, 0, w_pad[y_idx])
        y_sorted, y_order = torch.sort(y, dim=1)
        at = torch.searchsorted(2 * y_sorted.clamp(max=_BIG // 4), (2 * x - gap).clamp(max=_BIG // 2))
        best, best_col = torch.full(x.shape, _BIG, dtype=torch.int64), torch.zeros(x.shape, dtype=torch.int64)
        for cand in (at - 1, at):
            cand = cand.clamp(0, y.shape[1] - 1)
            d = x - y_sorted.gather(1, cand)
            ok = (d > 0) & (d < gap) & (x < _BIG)
            score = torch.where(ok, (2 * d - gap).abs(), _BIG)
            better = score < best
            best, best_col = torch.where(better, score, best), torch.where(better, cand, best_col)
        score, at_x = best.min(1)
        rows = (score < _BIG).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        xi = x_idx[rows, at_x[rows]]
        yi = y_idx[rows, y_order[rows, best_col[rows, at_x[rows]]]]
        d = w[xi] - torch.where(yi >= 0, w[yi.clamp(min=0)], 0)
        bins[xi] = light[rows]
        swap = yi >= 0
        bins[yi[swap]] = heavy[rows][swap]
        loads.index_add_(0, heavy[rows], -d)
        loads.index_add_(0, light[rows], d)


def _pair_sets(items: torch.Tensor, w: torch.Tensor, cap: int, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Exchange candidates of one set: ``(first item, second item, workload)``, ``-1`` = none.

    ``sizes`` says which cardinalities (0, 1, 2) are offered; pairs are drawn from at most
    ``cap`` evenly spaced items (in workload order) to bound the work.
    """
    none = torch.tensor([-1])
    firsts, seconds = [], []
    if 0 in sizes:
        firsts.append(none)
        seconds.append(none)
    if 1 in sizes:
        firsts.append(items)
        seconds.append(torch.full_like(items, -1))
    if 2 in sizes and items.numel() >= 2:
        sub = items.index_select(0, torch.argsort(w.index_select(0, items)))
        if sub.numel() > cap:
            sub = sub.index_select(0, torch.linspace(0, sub.numel() - 1, cap).round().long())
        iu = torch.triu_indices(sub.numel(), sub.numel(), 1)
        firsts.append(sub.index_select(0, iu[0]))
        seconds.append(sub.index_select(0, iu[1]))
    a, b = torch.cat(firsts), torch.cat(seconds)
    w0 = torch.cat([w, torch.zeros(1, dtype=w.dtype)])  # index -1 weighs 0
    return a, b, w0[a] + w0[b]


def _heaviest_passes(w: torch.Tensor, bins: torch.Tensor, loads: torch.Tensor, k: int, moves: bool,
                     limit: int, cap: int = 64, target: int | None = None,
                     limits: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> None:
    """Steps 2b and 2c: the heaviest set against the lightest sets' items, then pairs against the lightest set.

    Stops when the heaviest set is at ``target`` (default: the lower bound ``ceil(total / k)``).
    With ``limits = (tokens, token_loads, budget)`` only exchanges that keep both sets within
    the token budget are made (single swaps and moves; ``token_loads`` updated in place).
    """
    lower = ceildiv(int(loads.sum()), k) if target is None else int(target)
    partners = min(k - 1, 32 if limits is None else 64)  # the lightest sets hold the useful exchanges
    pair_partners = 1 if limits is None else min(k - 1, PAIR_PARTNERS)
    for _ in range(limit):
        h = int(loads.argmax())
        top = int(loads[h])
        if top <= lower:
            return
        mine = (bins == h).nonzero().squeeze(1)
        x = w.index_select(0, mine)
        light_sets = torch.argsort(loads, stable=True)[:partners]
        theirs = torch.isin(bins, light_sets).nonzero().squeeze(1)
        y_idx = torch.cat([theirs, torch.full((partners,), -1)]) if moves else theirs
        y_w = torch.cat([w.index_select(0, theirs), torch.zeros(partners, dtype=torch.int64)]) if moves \
            else w.index_select(0, theirs)
        y_set = torch.cat([bins.index_select(0, theirs), light_sets]) if moves else bins.index_select(0, theirs)
        y_load = loads.index_select(0, y_set)
        d = x.unsqueeze(1) - y_w.unsqueeze(0)
        ok = (d > 0) & (d < (top - y_load).unsqueeze(0))
        if limits is not None:
            tokens, token_loads, budget = limits
            y_t = torch.where(y_idx >= 0, tokens.index_select(0, y_idx.clamp(min=0)), 0)
            dt = tokens.index_select(0, mine).unsqueeze(1) - y_t.unsqueeze(0)
            ok &= (token_loads[h] - dt <= budget) & (token_loads.index_select(0, y_set).unsqueeze(0) + dt <= budget)
        new_max = torch.where(ok, torch.maximum(top - d, y_load.unsqueeze(0) + d), _BIG)
        flat = int(new_max.argmin())
        if int(new_max.view(-1)[flat]) < top:
            i, j = divmod(flat, y_w.numel())
            step, other = int(d[i, j]), int(y_set[j])
            bins[mine[i]] = other
            if int(y_idx[j]) >= 0:
                bins[y_idx[j]] = h
            loads[h] -= step
            loads[other] += step
            if limits is not None:
                token_loads[h] -= int(dt[i, j])
                token_loads[other] += int(dt[i, j])
            continue
        found = None
        for light in torch.argsort(loads, stable=True)[:pair_partners].tolist():
            found = _pair_exchange(w, bins, loads, h, light, moves, cap, limits)
            if found is not None:
                break
        if found is None:
            return
        (i, j, step), (ha, hb, la, lb) = found
        moved = 0
        for t in (int(ha[i]), int(hb[i])):
            if t >= 0:
                bins[t] = light
                moved += int(limits[0][t]) if limits is not None else 0
        for t in (int(la[j]), int(lb[j])):
            if t >= 0:
                bins[t] = h
                moved -= int(limits[0][t]) if limits is not None else 0
        loads[h] -= step
        loads[light] += step
        if limits is not None:
            limits[1][h] -= moved
            limits[1][light] += moved


def _pair_exchange(w: torch.Tensor, bins: torch.Tensor, loads: torch.Tensor, h: int, light: int, moves: bool,
                   cap: int, limits: tuple[torch.Tensor, torch.Tensor, int] | None):
    """Step 2c for one pair of sets: the exchange of up to two items each way that lowers the heavier ``h``.

    Returns ``((heavy candidate, light candidate, workload step), (ha, hb, la, lb))`` or None.
    """
    top = int(loads[h])
    gap = top - int(loads[light])
    if gap <= 0:
        return None
    sizes = (0, 1, 2) if moves else (1, 2)
    ha, hb, hs = _pair_sets((bins == h).nonzero().squeeze(1), w, cap, sizes)
    la, lb, ls = _pair_sets((bins == light).nonzero().squeeze(1), w, cap, sizes)
    if not moves:  # same cardinality on both sides: compare pairs with pairs, singles with singles
        hs = hs + (hb >= 0) * (_BIG // 8)
        ls = ls + (lb >= 0) * (_BIG // 8)
    ls_sorted, ls_order = torch.sort(ls)
    at = torch.searchsorted(ls_sorted, hs - (gap + 1) // 2)
    if limits is not None:  # the token sums of the same candidate sets
        tokens, token_loads, budget = limits
        t0 = torch.cat([tokens, torch.zeros(1, dtype=tokens.dtype)])
        h_tok, l_tok = t0[ha] + t0[hb], (t0[la] + t0[lb]).index_select(0, ls_order)
    best_score, best = _BIG, None
    for cand in (at - 1, at):
        cand = cand.clamp(0, ls.numel() - 1)
        dd = hs - ls_sorted.index_select(0, cand)
        valid = (dd > 0) & (dd < gap)
        if limits is not None:
            dt = h_tok - l_tok.index_select(0, cand)
            valid &= (token_loads[h] - dt <= budget) & (token_loads[light] + dt <= budget)
        score = torch.where(valid, (2 * dd - gap).abs(), _BIG)
        i = int(score.argmin())
        if int(score[i]) < best_score:
            best_score, best = int(score[i]), (i, int(ls_order[cand[i]]), int(dd[i]))
    return None if best is None else (best, (ha, hb, la, lb))


def balanced_bins(workloads: torch.Tensor, k: int, equal_size: bool = False) -> torch.Tensor:
    """``(n,)`` int64: the set in ``[0, k)`` of each item, balancing the sets' workload sums.

    Every set is non-empty (``n >= k``); with ``equal_size`` every set holds ``n / k`` items.
    """
    w = torch.as_tensor(workloads).to(device="cpu", dtype=torch.int64).reshape(-1)
    n = w.numel()
    if k < 1 or n < k:
        raise ShapeError(f"cannot split {n} items into {k} non-empty partitions")
    if equal_size and n % k:
        raise ShapeError(f"equal_size: {n} items do not split into {k} partitions of equal size")
    if k == 1:
        return torch.zeros(n, dtype=torch.int64)
    bins = _differencing(w, k)
    loads = torch.zeros(k, dtype=torch.int64).index_add_(0, bins, w)
    _paired_passes(w, bins, loads, k, moves=not equal_size)
    _heaviest_passes(w, bins, loads, k, moves=not equal_size, limit=2 * k + 32)
    return bins


def fit_budget(tokens: torch.Tensor, workloads: torch.Tensor, bins: torch.Tensor, k: int, budget: int) -> bool:
    """Exchange items (in place in ``bins``) until no set holds more than ``budget`` tokens; True if reached.

    Balancing the workloads does not balance the token sums exactly (the ``s ** 2`` term):
    with ``k = ceil(total / budget)`` a set can end a few tokens over, where verl would add a
    micro-batch. Each step takes the set most over the budget and makes the single swap or
    move (against every other item and set) that brings it within the budget without
    pushing its partner over, choosing, among those, the one that keeps the pair's larger
    workload smallest. Loops over the sets over budget, never over samples.
    """
    t = tokens.to(device="cpu", dtype=torch.int64).reshape(-1)
    w = workloads.to(device="cpu", dtype=torch.int64).reshape(-1)
    n = t.numel()
    tok = torch.zeros(k, dtype=torch.int64).index_add_(0, bins, t)
    load = torch.zeros(k, dtype=torch.int64).index_add_(0, bins, w)
    sets = torch.arange(k)
    y_t = torch.cat([t, torch.zeros(k, dtype=torch.int64)])
    y_w = torch.cat([w, torch.zeros(k, dtype=torch.int64)])
    for _ in range(2 * k + 32):
        h = int(tok.argmax())
        need = int(tok[h]) - budget
        if need <= 0:  # within the budget: win back the workload balance without leaving it
            _heaviest_passes(w, bins, load, k, moves=True, limit=BUDGET_EXCHANGES_PER_SET * k + 32,
                              limits=(t, tok, budget))
            return True
        mine = (bins == h).nonzero().squeeze(1)
        y_set = torch.cat([bins, sets])
        dt = t.index_select(0, mine).unsqueeze(1) - y_t.unsqueeze(0)
        dw = w.index_select(0, mine).unsqueeze(1) - y_w.unsqueeze(0)
        ok = (dt >= need) & (tok.index_select(0, y_set).unsqueeze(0) + dt <= budget) & (y_set != h).unsqueeze(0)
        score = torch.where(ok, torch.maximum(load[h] - dw, load.index_select(0, y_set).unsqueeze(0) + dw), _BIG)
        flat = int(score.argmin())
        if int(score.view(-1)[flat]) >= _BIG:
            return False
        i, j = divmod(flat, y_t.numel())
        other = int(y_set[j])
        bins[mine[i]] = other
        if j < n:
            bins[j] = h
        step_t, step_w = int(dt[i, j]), int(dw[i, j])
        tok[h] -= step_t
        tok[other] += step_t
        load[h] -= step_w
        load[other] += step_w
    return bool(int(tok.max()) <= budget)


def bins_to_partitions(bins: torch.Tensor, k: int) -> list[list[int]]:
    """``k`` lists of item indices (ascending) from each item's set."""
    order = torch.argsort(bins, stable=True)
    counts = torch.bincount(bins, minlength=k).tolist()
    return [part.tolist() for part in order.split(counts)]


def get_seqlen_balanced_partitions(seqlen_list: Sequence[int] | torch.Tensor, k_partitions: int,
                                   equal_size: bool) -> list[list[int]]:
    """verl's ``get_seqlen_balanced_partitions``: ``k_partitions`` non-empty sorted index lists balancing the sums.

    Same contract as verl's (every index once, each list sorted, none empty, equal sizes with
    ``equal_size``); the sets come from :func:`balanced_bins`, not from Karmarkar-Karp, so
    they may differ from verl's while balancing at least as well on verl's measure.
    """
    values = torch.as_tensor(seqlen_list, dtype=torch.int64).reshape(-1)
    if values.numel() < k_partitions:
        raise ShapeError(f"number of items [{values.numel()}] < k_partitions [{k_partitions}]")
    return bins_to_partitions(balanced_bins(values, k_partitions, equal_size), k_partitions)
