"""The checks of the micro-batch layer, stated once: what a consumer reads of a nested tensor and a TensorDict, which
samples each micro-batch holds, the forced groups, the token budget, the count rules, the fixed path's chunks, the
restored order, one count on every data-parallel rank, and every sample's outputs end to end. The invariants
(spec/invariants/microbatch.py) call them on the suite's run; a standalone micro-batch reproducer calls the same
functions, vendored beside its own code (spec/repro/layer_helpers.py writes this module's source into the file). So
they take plain values (the case's facts, what the layer returned, a thunk that cuts) and fail by
:func:`~spec.truth.failing.fail`.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from .closeness import close
from .failing import fail
from .state_checks import same

__all__ = ["items", "check_nested", "check_sample_keys", "is_stack", "plain", "short", "brief", "check_index_lists", "check_partition",
           "micro_batch_samples", "groups_together", "token_budget", "count_rules", "fixed_size", "restore_order",
           "dp_same_count", "end_to_end_keys", "end_to_end_outputs", "offsets_of", "step_log_probs", "step_outputs",
           "training_step_outputs", "padded_cut", "metadata", "flags_of", "padded_helpers"]


def items(value: torch.Tensor, what: str) -> list[torch.Tensor]:
    """The samples of a nested tensor by its own values and offsets (what engines read), on its ragged dim."""
    ragged = getattr(value, "_ragged_idx", 1)
    values, offsets = value.values(), value.offsets().tolist()
    axis = ragged - 1
    if offsets[0] != 0 or offsets[-1] != values.shape[axis]:
        fail(f"{what}: offsets {offsets[:4]}..{offsets[-1]} do not span the values' {values.shape[axis]} tokens on "
             f"dim {axis} (shape {tuple(values.shape)})")
    return [values.narrow(axis, a, b - a) for a, b in zip(offsets[:-1], offsets[1:])]


def short(t: torch.Tensor) -> str:
    flat = t.reshape(-1).tolist()
    return f"{tuple(t.shape)} {flat[:8]}{'...' if len(flat) > 8 else ''}"


def brief(value: Any) -> str:
    """A per-sample stack's entries in one short line: a tensor by its shape and sum (a media dict's features)."""
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} sum {float(value.double().sum()):.4g}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {brief(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(brief(v) for v in value) + "]"
    return f"{value!r:.120}"


def is_stack(value: Any) -> bool:
    return type(value).__name__ == "NonTensorStack"


def plain(value: Any) -> Any:
    return getattr(value, "data", value)


def check_nested(got: Any, want: torch.Tensor, rows: list[int], what: str) -> None:
    """``got`` holds samples ``rows`` of the nested ``want``: nested, the same ragged dim and non-ragged sizes (mRoPE
    ``(b, 4, j)``, teacher ``(b, j, K)``, routed experts ``(b, j, L, K)``), offsets from each sample's length, exact
    values."""
    if not isinstance(got, torch.Tensor) or not got.is_nested:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        fail(f"{what}: {shape} (dense), expected a nested (jagged) tensor of {len(rows)} samples")
    ragged = getattr(want, "_ragged_idx", 1)
    if getattr(got, "_ragged_idx", None) != ragged:
        fail(f"{what}: ragged at dim {getattr(got, '_ragged_idx', None)}, expected dim {ragged}")
    if got.dim() != want.dim():
        fail(f"{what}: {got.dim()}-D, expected {want.dim()}-D like the mini-batch's")
    if int(got.size(0)) != len(rows):
        fail(f"{what}: {got.size(0)} samples, expected {len(rows)}")
    if got.offsets().dtype.is_floating_point or got.offsets().dtype == torch.bool:
        fail(f"{what}: offsets of dtype {got.offsets().dtype}, expected integers like the mini-batch's "
             f"{want.offsets().dtype} (a consumer hands them to varlen attention as cu_seqlens)")
    for d in range(1, want.dim()):
        if d != ragged:
            size = got.size(d)
            if not isinstance(size, int) or size != want.size(d):
                fail(f"{what}: size {size} at dim {d}, expected {want.size(d)} (shape {tuple(got.shape)}, the "
                     f"mini-batch's {tuple(want.shape)})")
    mine, theirs = items(got, what), items(want, what + " (mini-batch)")
    for j, row in enumerate(rows):
        if not torch.equal(mine[j], theirs[row]):
            fail(f"{what}: sample {j} holds {short(mine[j])}, expected mini-batch sample {row}'s {short(theirs[row])}")


def check_sample_keys(got: Any, mini: Any, rows: list[int], what: str) -> None:
    """Every key of the mini-batch, for samples ``rows``: nested keys by :func:`check_nested`, dense per-sample keys
    row by row, per-sample non-tensor stacks in order, flags (NonTensorData) equal."""
    missing = sorted(set(mini.keys()) - set(got.keys()))
    if missing:
        fail(f"{what}: keys {missing} of the mini-batch are missing (has {sorted(got.keys())})")
    if tuple(got.batch_size)[:1] != (len(rows),):
        fail(f"{what}: batch_size {tuple(got.batch_size)}, expected ({len(rows)},)")
    for key in mini.keys():
        want, value = mini.get(key), got.get(key)
        where = f"{what}: {key!r}"
        if isinstance(want, torch.Tensor) and want.is_nested:
            check_nested(value, want, rows, where)
        elif isinstance(want, torch.Tensor):
            if not isinstance(value, torch.Tensor) or value.is_nested or \
                    not torch.equal(value, want[torch.tensor(rows, dtype=torch.long)]):
                fail(f"{where}: {value!r:.120}, expected rows {rows[:8]} of the mini-batch's")
        elif is_stack(want):
            expect = [want.tolist()[i] for i in rows]
            if not is_stack(value) or not same(value.tolist(), expect):  # a media dict of tensors: compared exactly
                got_items = value.tolist() if is_stack(value) else plain(value)
                fail(f"{where}: {brief(got_items)}, expected the samples' {brief(expect[:8])}")
        elif plain(value) != plain(want):
            fail(f"{where}: flag {plain(value)!r}, expected the mini-batch's {plain(want)!r}")


def check_index_lists(micro: list, rows: list[list[int]], indices, dynamic: bool = False) -> None:
    """One index list per micro-batch (``rows``: :func:`spec.cases.microbatch.micro_batch_rows`); on the ``dynamic``
    path the layer's own (``indices``: what it returned)."""
    if dynamic and indices is None:
        fail("the dynamic path returned no batch_idx_list: the order cannot be restored")
    if len(rows) != len(micro):
        fail(f"{len(micro)} micro-batches but {len(rows)} index lists")


def check_partition(batch_size: int, rows: list[list[int]]) -> None:
    """Every one of the ``batch_size`` samples in exactly one micro-batch's index list."""
    flat = sorted(i for part in rows for i in part)
    if flat != list(range(batch_size)):
        seen = [i for part in rows for i in part]
        dup = sorted({i for i in seen if seen.count(i) > 1})[:5]
        lost = sorted(set(range(batch_size)) - set(seen))[:5]
        fail(f"micro-batch indices {rows if len(rows) < 6 else '...'} are no partition of the {batch_size} "
             f"samples: duplicated {dup}, missing {lost}")


def micro_batch_samples(mini: Any, micro: list, rows: list[list[int]]) -> None:
    """INV-MB-001: each micro-batch holds exactly the samples its index list names (their input_ids)."""
    ids = mini.get("input_ids")
    for k, (mb, part) in enumerate(zip(micro, rows)):
        check_nested(mb.get("input_ids"), ids, part, f"micro-batch {k}: 'input_ids'")


def groups_together(batch_size: int, group_size: int, rows: list[list[int]]) -> None:
    """INV-MB-002: each group of ``group_size`` consecutive samples lies in one micro-batch, whole."""
    where = {i: k for k, part in enumerate(rows) for i in part}
    for start in range(0, batch_size, group_size):
        homes = sorted({where[i] for i in range(start, start + group_size)})
        if len(homes) > 1:
            fail(f"group of samples {start}..{start + group_size - 1} (force_group_size={group_size}) split across "
                 f"micro-batches {homes}")


def _tokens(mb: Any, what: str) -> int:
    ids = mb.get("input_ids")
    if not isinstance(ids, torch.Tensor) or not ids.is_nested:
        fail(f"{what}: input_ids are not nested ({type(ids).__name__})")
    return sum(ids.offsets().diff().tolist())


def token_budget(cut, over_budget: bool, feasible, budget: int, longest_group: int, max_token_len: int, sp_size: int,
                 not_exercised) -> None:
    """INV-MB-003: ``cut()`` (the layer's prepare_micro_batches) gives no micro-batch over ``budget``; it accepts a
    mini-batch whose every group fits and refuses one with a group over it, naming max_token_len. ``feasible``:
    whether a count within the groups meets the count rules (else a refusal is INV-MB-004's)."""
    try:
        micro, _ = cut()
    except Exception as exc:  # noqa: BLE001 - a refusal is right only for an over-budget sample
        if over_budget and "max_token_len" in str(exc):
            return
        if over_budget:
            fail(f"refused a sample over the budget with {type(exc).__name__}: {exc} (the message must name "
                 "max_token_len)")
        if feasible is not True:
            not_exercised("no micro-batch count may meet the count rules within the groups (INV-MB-004)")
            return
        fail(f"refused a mini-batch whose every group fits the budget {budget} (longest group {longest_group} "
             f"tokens): {type(exc).__name__}: {str(exc)[:300]}")
    if over_budget:
        fail(f"accepted a sample (group) of {longest_group} tokens over the budget {budget}: {len(micro)} "
             "micro-batches")
    for k, mb in enumerate(micro):
        total = _tokens(mb, f"micro-batch {k}")
        if total > budget:
            fail(f"micro-batch {k} holds {total} tokens, over the budget {budget} "
                 f"(max_token_len_per_gpu={max_token_len} x sp_size={sp_size})")


def count_rules(cut, feasible, needed: int, num_groups: int, budget: int, longest_group: int, total_nnz: int,
                min_num_micro_batch, num_batches_divided_by) -> None:
    """INV-MB-004: at least min_num_micro_batch micro-batches, a multiple of num_batches_divided_by, exactly the
    minimum ``needed`` when the whole mini-batch fits one budget, none empty; more than the groups allow: a
    ValueError (``feasible`` is not True) or empty micro-batches."""
    try:
        micro, _ = cut()
    except ValueError as exc:
        if feasible is not True:
            return  # refused: no count within the groups meets the rules and the budget
        fail(f"refused although a count within the {num_groups} groups meets the rules and the budget {budget} "
             f"(longest group {longest_group} tokens): {type(exc).__name__}: {str(exc)[:300]}")
    count = len(micro)
    sizes = [int(mb.batch_size[0]) if mb.batch_size else 0 for mb in micro]
    if min_num_micro_batch and count < min_num_micro_batch:
        fail(f"{count} micro-batches, fewer than min_num_micro_batch={min_num_micro_batch}")
    if num_batches_divided_by and count % num_batches_divided_by:
        fail(f"{count} micro-batches, not a multiple of num_batches_divided_by={num_batches_divided_by}")
    if total_nnz <= budget and count != max(needed, 1) and needed <= num_groups:
        fail(f"the whole mini-batch ({total_nnz} tokens) fits the budget {budget}, yet {count} micro-batches "
             f"(sizes {sizes[:8]}); the count rules ask for {needed}")
    empty = [k for k, n in enumerate(sizes) if n == 0]
    if empty and feasible is True:
        fail(f"micro-batches {empty[:5]} are empty although the {num_groups} groups fill {count}")


def fixed_size(cut, mini: Any, divides: bool, batch_size: int, micro_batch_size: int, group_size: int) -> None:
    """INV-MB-006: the fixed path cuts consecutive chunks of micro_batch_size x force_group_size samples in order,
    every key kept, no indices; a batch size they do not divide (``divides`` False) is refused naming
    micro_batch_size."""
    try:
        micro, indices = cut()
    except Exception as exc:  # noqa: BLE001 - right only when the size does not divide
        if not divides and "micro_batch_size" in str(exc):
            return
        if not divides:
            fail(f"refused an indivisible batch with {type(exc).__name__}: {exc} (the message must name "
                 "micro_batch_size)")
        raise
    if not divides:
        fail(f"B={batch_size} is no multiple of micro_batch_size_per_gpu={micro_batch_size} x "
             f"force_group_size={group_size}, yet {len(micro)} micro-batches came back")
    if indices is not None:
        fail(f"the fixed path returned indices {indices!r:.80}: it keeps the order and returns None")
    size = micro_batch_size * group_size
    sizes = [int(mb.batch_size[0]) for mb in micro]
    if sizes != [size] * (batch_size // size):
        fail(f"micro-batch sizes {sizes[:8]}, expected {batch_size // size} of {size}")
    for k, mb in enumerate(micro):
        check_sample_keys(mb, mini, list(range(k * size, (k + 1) * size)), f"micro-batch {k}")


def offsets_of(lens: list[int]) -> torch.Tensor:
    """``[0, n_0, n_0 + n_1, ...]``: the offsets of nested samples of lengths ``lens``."""
    return torch.nn.functional.pad(torch.tensor(lens, dtype=torch.int64).cumsum(0), (1, 0))


def restore_order(restore, mini: Any, micro: list, indices) -> None:
    """INV-MB-007: ``restore`` (the layer's restore_dynamic_batch) brings the per-micro-batch results, concatenated in
    micro-batch order, back in the mini-batch's sample order, nested (each sample's own input ids) and dense (its
    first id)."""
    parts = [t for mb in micro for t in mb.get("input_ids").unbind()]
    joined = torch.nested.nested_tensor_from_jagged(torch.cat(parts), offsets_of([t.shape[0] for t in parts]))
    ids = mini.get("input_ids")
    check_nested(restore(joined, indices), ids, list(range(int(ids.size(0)))), "restored nested outputs")
    dense = torch.stack([t[0] for t in parts]).to(torch.float32)
    back = restore(dense, indices)
    want = torch.stack([t[0] for t in ids.unbind()]).to(torch.float32)
    if not isinstance(back, torch.Tensor) or back.shape != want.shape or not torch.equal(back, want):
        fail(f"restored dense outputs {back.tolist()[:8] if isinstance(back, torch.Tensor) else back!r}, expected "
             f"{want.tolist()[:8]} (the samples' first ids in mini-batch order)")


def dp_same_count(replies: list[dict], feasible, lower_count: int, ranks: list[dict]) -> None:
    """INV-MB-005: every data-parallel rank accepted (``replies``: per rank its ``count``, its count ``alone``, its
    index lists ``rows`` and micro-batch ``tokens``): one count on every rank, each rank's micro-batches a partition
    of its samples within its budget; unless no one count fits (``feasible`` False: ``lower_count`` exceeds a rank's
    groups). ``ranks``: per rank its ``batch_size``, ``budget`` and ``num_groups``."""
    if feasible is False:
        fail(f"the ranks need {lower_count} or more micro-batches but a rank has only "
             f"{min(r['num_groups'] for r in ranks)} groups, yet every rank accepted")
    counts = [r["count"] for r in replies]
    if len(set(counts)) > 1:
        fail(f"ranks got {counts} micro-batches (their own counts would be {[r['alone'] for r in replies]}); "
             "same_micro_num_in_dp asks for one count on every rank")
    for rank, (reply, mine) in enumerate(zip(replies, ranks)):
        check_partition(mine["batch_size"], reply["rows"] or [])
        over = [t for t in reply["tokens"] if t > mine["budget"]]
        if over:
            fail(f"rank {rank}: micro-batches of {over} tokens, over the budget {mine['budget']}")


def end_to_end_keys(calculate_entropy: bool, distillation_keys) -> list[str]:
    """The outputs INV-MB-015 compares: log_probs, entropy when asked, the distillation keys."""
    return ["log_probs"] + (["entropy"] if calculate_entropy else []) + list(distillation_keys)


def end_to_end_outputs(outputs: dict, keys, wants: dict, tols: dict, seq_lens, read, sizes) -> None:
    """INV-MB-015's comparison: every key after postprocess nested over the mini-batch's samples, each sample's values
    (by the nested tensor's own offsets) its own expectation ``wants[key][i]`` within ``tols[key][i]``, at the
    positions a consumer reads (``read[i]``: :func:`~spec.truth.rules.read_positions`; never a sequence's last
    token). ``sizes``: the micro-batches' sample counts (for the message)."""
    for key in keys:
        if key not in outputs:
            fail(f"output key {key!r} missing after postprocess (keys {sorted(outputs)})")
        got = outputs[key]
        if not isinstance(got, torch.Tensor) or not got.is_nested or int(got.size(0)) != len(seq_lens):
            fail(f"{key!r} after postprocess: {getattr(got, 'shape', type(got).__name__)}, expected nested over "
                 f"{len(seq_lens)} samples")
        for i, (actual, exp, tol) in enumerate(zip(items(got, key), wants[key], tols[key])):
            if actual.shape[0] != seq_lens[i]:
                fail(f"{key!r} of sample {i}: {actual.shape[0]} tokens, expected {seq_lens[i]} (another sample's?)")
            at = read[i]  # only what a consumer reads: never a sequence's last token
            close(actual[at], exp[at], f"{key!r} of sample {i} (micro-batches {list(sizes)})"
                  + ("" if at.numel() == 0 or int(at[0]) == 0 else f" (positions {at.tolist()})"), atol=tol[at])


def step_log_probs(ids: torch.Tensor) -> torch.Tensor:
    """A per-token output of the sample's own ids (what a step computes per sample, whatever micro-batch it sat in)."""
    return -(ids.to(torch.float32) + 1.0) / 7.0


def step_outputs(mb: Any, k: int, outputs: str) -> dict[str, Any]:
    """What micro-batch ``k``'s training step returns: its per-token outputs (not under ``loss_only``), and under
    ``train`` and ``loss_only`` its loss (a 0-d tensor) and metrics (a scalar per micro-batch, a list per sample)."""
    ids = mb.get("input_ids")
    lens = ids.offsets().diff()
    entry: dict[str, Any] = {}
    if outputs != "loss_only":
        entry["model_output"] = {"log_probs": torch.nested.nested_tensor_from_jagged(
            step_log_probs(ids.values()), ids.offsets())}
    if outputs != "model_output":
        entry["loss"] = ids.values().to(torch.float32).mean() + k
        entry["metrics"] = {"actor/pg_loss": float(k) + 0.25, "actor/response_length": lens.tolist()}
    return entry


def training_step_outputs(post, mini: Any, micro: list, indices, rows: list[list[int]], outputs: str) -> None:
    """INV-MB-017: ``post`` (the layer's postprocess_batch_func) on the micro-batches' step outputs
    (:func:`step_outputs`): 'loss' their losses in micro-batch order, 'metrics' each key's values in micro-batch order
    (a list extends, a scalar appends), 'model_output' the per-token outputs back in mini-batch order, or empty when
    no micro-batch returned one."""
    output_lst = [step_outputs(mb, k, outputs) for k, mb in enumerate(micro)]
    got = post(output_lst=output_lst, indices=indices, data=mini)
    for key in ("model_output", "loss", "metrics"):
        if key not in got:
            fail(f"postprocess_batch_func returned keys {sorted(got)}: {key!r} missing")
    losses = [o["loss"] for o in output_lst if "loss" in o]
    got_losses = list(got["loss"])
    if len(got_losses) != len(losses) or not all(
            isinstance(g, torch.Tensor) and torch.equal(g, w) for g, w in zip(got_losses, losses)):
        fail(f"'loss': {[float(g) for g in got_losses][:8]}, expected the {len(losses)} micro-batches' losses "
             f"{[float(w) for w in losses][:8]} in micro-batch order")
    want_metrics: dict[str, list] = {}
    for o in output_lst:
        for key, value in o.get("metrics", {}).items():
            want_metrics.setdefault(key, []).extend(value if isinstance(value, list) else [value])
    metrics = {key: list(value) for key, value in dict(got["metrics"]).items()}
    if metrics != want_metrics:
        fail(f"'metrics': {({k: v[:8] for k, v in metrics.items()})!r:.300}, expected each key's values in "
             f"micro-batch order {({k: v[:8] for k, v in want_metrics.items()})!r:.300}")
    model_output = dict(got["model_output"])
    if outputs == "loss_only":
        if model_output:
            fail(f"'model_output' has keys {sorted(model_output)} although no micro-batch returned one")
        return
    if sorted(model_output) != ["log_probs"]:
        fail(f"'model_output' keys {sorted(model_output)}, expected ['log_probs']")
    ids = mini.get("input_ids")
    want = torch.nested.nested_tensor_from_jagged(step_log_probs(ids.values()), ids.offsets())
    check_nested(model_output["log_probs"], want, list(range(int(ids.size(0)))),
                 f"'log_probs' after postprocess (micro-batches {[len(r) for r in rows]})")


def padded_cut(mini: Any, micro: list, rows: list[list[int]], dynamic: bool, budget: int) -> None:
    """INV-MB-018: every key's rows of each micro-batch of a padded mini-batch those of its samples; on the dynamic
    path each micro-batch's attention-mask tokens within ``budget``."""
    for k, (mb, part) in enumerate(zip(micro, rows)):
        check_sample_keys(mb, mini, part, f"micro-batch {k}")
        if dynamic:
            tokens = int(mb.get("attention_mask").sum())
            if tokens > budget:
                fail(f"micro-batch {k} holds {tokens} tokens (attention mask), over the budget {budget}")


def metadata(mini: Any, seed: int) -> Any:
    """The mini-batch's flags alone, as a TensorDict without a batch size (a trainer's meta info)."""
    meta = TensorDict({}, batch_size=[])
    for key in mini.keys():
        value = mini.get(key)
        if not isinstance(value, torch.Tensor) and not is_stack(value):
            meta.set_non_tensor(key, plain(value))
    meta.set_non_tensor("global_step", seed)
    return meta


def flags_of(td: Any) -> dict[str, Any]:
    return {key: plain(td.get(key)) for key in td.keys()
            if not isinstance(td.get(key), torch.Tensor) and not is_stack(td.get(key))}


def padded_helpers(concat, select, mini: Any, parts: list, part_rows: list[list[int]], seed: int) -> None:
    """INV-MB-019: ``concat`` (concat_tensordict) of a padded mini-batch's consecutive ``parts`` gives its rows back, of
    metadata-only TensorDicts their flags; ``select`` (index_select_tensor_dict) with a tensor of indices (from
    ``seed``) selects those rows, of a metadata-only TensorDict keeps every flag whole, of None gives None."""
    batch_size = int(mini.batch_size[0])
    got = concat(parts)
    check_sample_keys(got, mini, list(range(batch_size)), f"concat of padded parts {[len(r) for r in part_rows]}")
    meta = metadata(mini, seed)
    joined = concat([meta, meta.clone()])
    if flags_of(joined) != flags_of(meta):
        fail(f"concat of metadata-only TensorDicts: flags {flags_of(joined)!r:.200}, expected {flags_of(meta)!r:.200}")
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(batch_size, generator=gen)[: (seed % batch_size) + 1]
    picked = select(mini, rows)
    check_sample_keys(picked, mini, rows.tolist(), f"index_select by the tensor {rows.tolist()[:8]}")
    kept = select(meta, rows)
    if kept is None or flags_of(kept) != flags_of(meta):
        fail(f"index_select of a metadata-only TensorDict: {None if kept is None else flags_of(kept)!r:.200}, "
             f"expected its flags {flags_of(meta)!r:.200} whole")
    if select(None, rows) is not None:
        fail("index_select_tensor_dict(None, indices) returned a TensorDict, expected None")
