"""The micro-batch layer as a trainer calls it beyond the no-padding forward pass (contract clauses 13.16-13.19,
docs/contract.md (Micro-batch layer)): the data-parallel balance of a whole batch
(``get_seqlen_balanced_partitions`` with ``equal_size``), a training step's micro-batch outputs (loss and
metrics, with or without ``model_output``) through ``postprocess_batch_func``, a padded (dense) mini-batch cut by
``prepare_micro_batches``, and the TensorDict helpers on the padded and metadata-only TensorDicts a trainer hands
them. Each check draws a :class:`spec.cases.microbatch.MiniBatchCase` whose structure says which of these it is
(``k_partitions``/``equal_size``, ``outputs``, ``layout``) and reads every value the layer returns.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from ..cases.microbatch import TIE_STYLES, MiniBatchCase, materialize_minibatch
from .core import Ctx, fail
from .microbatch import (plain, _suite_parts, check_nested, check_partition, check_sample_keys, cut, layer,
                         mb_invariant, refusable, rows_of)

__all__ = ["balanced_dp_partitions", "training_step_outputs", "padded_minibatch_cut", "metadata_and_padded_helpers"]


# -- INV-MB-016: the data-parallel balance ---------------------------------------------------------------------------

def _with_partitions(case: MiniBatchCase) -> MiniBatchCase:
    """A pinned mini-batch gets a balance to draw too (k = 2 where B allows, equal sizes where they divide)."""
    if case.k_partitions:
        return case
    k = min(2, case.batch_size)
    return case.with_(k_partitions=k, equal_size=case.batch_size % k == 0)


@mb_invariant(
    "INV-MB-016", "get_seqlen_balanced_partitions(lengths, k, equal_size): k non-empty parts that partition the "
    "samples; with equal_size every part holds B/k samples; token sums within the largest differencing method's "
    "bound (max - min <= the longest sequence, with equal_size <= the longest minus the shortest), ties and equal "
    "lengths included", functions=("get_seqlen_balanced_partitions",), styles=TIE_STYLES, partitions=True,
    extras=False, adjust=_with_partitions, example_share=1.0,  # one balance call per example: the full count
    protects="a trainer's balance_batch gives every data-parallel rank its share of the samples (the same count "
             "with equal_size), none twice or lost, and no rank far more tokens than another")
def balanced_dp_partitions(ctx: Ctx) -> None:
    case = ctx.case
    lengths = list(case.seq_lens)
    k, n = case.k_partitions, case.batch_size
    parts = layer(ctx).get("get_seqlen_balanced_partitions")(lengths, k, case.equal_size)
    parts = [[int(i) for i in part] for part in parts]
    if len(parts) != k:
        fail(f"{len(parts)} partitions, expected k_partitions={k}")
    check_partition(case, parts)
    empty = [i for i, part in enumerate(parts) if not part]
    if empty:
        fail(f"partitions {empty[:5]} are empty ({n} samples into {k})")
    if case.equal_size:
        sizes = [len(part) for part in parts]
        if set(sizes) != {n // k}:
            fail(f"equal_size: partition sizes {sizes[:8]}, expected {k} of {n // k}")
    sums = [sum(lengths[i] for i in part) for part in parts]
    spread = max(sums) - min(sums)
    bound = max(lengths) - min(lengths) if case.equal_size else max(lengths)
    if spread > bound:
        fail(f"token sums {sums[:8]} spread {spread}, over the bound {bound} "
             f"({'longest - shortest' if case.equal_size else 'longest'} sequence)")


def _partitioned(ctx: Ctx):
    """``(mini, micro, indices, rows)`` of the case's mini-batch cut by ``prepare_micro_batches``, the rows checked to
    partition the samples; None for a mini-batch the layer may refuse (INV-MB-003/004/006)."""
    if refusable(ctx):
        return None
    mini, micro, indices = cut(ctx)
    rows = rows_of(ctx.case, micro, indices)
    check_partition(ctx.case, rows)
    return mini, micro, indices, rows


# -- INV-MB-017: a training step's outputs ---------------------------------------------------------------------------

def _log_probs_of(ids: torch.Tensor) -> torch.Tensor:
    """A per-token output of the sample's own ids (what a step computes per sample, whatever micro-batch it sat in)."""
    return -(ids.to(torch.float32) + 1.0) / 7.0


def _step(mb: TensorDict, k: int, outputs: str) -> dict[str, Any]:
    """What micro-batch ``k``'s step returns: its per-token outputs (not under ``loss_only``), and under ``train`` and
    ``loss_only`` its loss (a 0-d tensor) and metrics (a scalar per micro-batch, a list per sample)."""
    ids = mb.get("input_ids")
    lens = ids.offsets().diff()
    entry: dict[str, Any] = {}
    if outputs != "loss_only":
        entry["model_output"] = {"log_probs": torch.nested.nested_tensor_from_jagged(
            _log_probs_of(ids.values()), ids.offsets())}
    if outputs != "model_output":
        entry["loss"] = ids.values().to(torch.float32).mean() + k
        entry["metrics"] = {"actor/pg_loss": float(k) + 0.25, "actor/response_length": lens.tolist()}
    return entry


@mb_invariant(
    "INV-MB-017", "postprocess_batch_func on a training step's micro-batch outputs: 'loss' the micro-batches' losses "
    "in micro-batch order, 'metrics' each key's values in micro-batch order (a list extends, a scalar appends), "
    "'model_output' the per-token outputs back in mini-batch order, or empty when no micro-batch returned one",
    functions=("prepare_micro_batches", "postprocess_batch_func"), outputs=("model_output", "train", "loss_only"),
    protects="the trainer's logged losses and metrics are every micro-batch's, each once and in order, and a "
             "loss-only step still returns its losses")
def training_step_outputs(ctx: Ctx) -> None:
    case = ctx.case
    if (cut_ := _partitioned(ctx)) is None:
        return
    mini, micro, indices, rows = cut_
    output_lst = [_step(mb, k, case.outputs) for k, mb in enumerate(micro)]
    got = layer(ctx).get("postprocess_batch_func")(output_lst=output_lst, indices=indices, data=mini)
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
    if case.outputs == "loss_only":
        if model_output:
            fail(f"'model_output' has keys {sorted(model_output)} although no micro-batch returned one")
        return
    if sorted(model_output) != ["log_probs"]:
        fail(f"'model_output' keys {sorted(model_output)}, expected ['log_probs']")
    ids = mini.get("input_ids")
    want = torch.nested.nested_tensor_from_jagged(_log_probs_of(ids.values()), ids.offsets())
    check_nested(model_output["log_probs"], want, list(range(case.batch_size)),
                 f"'log_probs' after postprocess (micro-batches {[len(r) for r in rows]})")


# -- INV-MB-018: a padded mini-batch ---------------------------------------------------------------------------------

def _padded_budget(case: MiniBatchCase) -> MiniBatchCase:
    """The padded layout, under a budget that holds its padded width (a padded row is checked at its full width)."""
    case = case.with_(layout="padded")
    if not case.use_dynamic_bsz:
        return case
    return case.with_(max_token_len=max(case.max_token_len, -(-case.padded_width // case.sp_size)))


@mb_invariant(
    "INV-MB-018", "prepare_micro_batches on a padded mini-batch (dense input_ids and an attention_mask, left-padded "
    "prompts, right-padded responses): a partition of the rows, each micro-batch's attention-mask tokens within the "
    "budget, every key's rows (dense by row, uid stacks, flags) those of its samples",
    functions=("prepare_micro_batches",), layouts=("padded",), adjust=_padded_budget,
    protects="a trainer that hands its rollout batch padded gets micro-batches of whole rows within the token "
             "budget, no row lost, duplicated or mixed with another's mask")
def padded_minibatch_cut(ctx: Ctx) -> None:
    case = ctx.case
    if (cut_ := _partitioned(ctx)) is None:
        return
    mini, micro, _, rows = cut_
    for k, (mb, part) in enumerate(zip(micro, rows)):
        check_sample_keys(mb, mini, part, f"micro-batch {k}")
        if case.use_dynamic_bsz:
            tokens = int(mb.get("attention_mask").sum())
            if tokens > case.budget:
                fail(f"micro-batch {k} holds {tokens} tokens (attention mask), over the budget {case.budget}")


# -- INV-MB-019: TensorDict helpers on padded and metadata-only TensorDicts -----------------------------------------

def _metadata(case: MiniBatchCase, mini: TensorDict) -> TensorDict:
    """The mini-batch's flags alone, as a TensorDict without a batch size (a trainer's meta info)."""
    meta = TensorDict({}, batch_size=[])
    for key in mini.keys():
        value = mini.get(key)
        if not isinstance(value, torch.Tensor) and type(value).__name__ != "NonTensorStack":
            meta.set_non_tensor(key, plain(value))
    meta.set_non_tensor("global_step", case.seed)
    return meta


def _flags(td: TensorDict) -> dict[str, Any]:
    return {key: plain(td.get(key)) for key in td.keys()
            if not isinstance(td.get(key), torch.Tensor) and type(td.get(key)).__name__ != "NonTensorStack"}


@mb_invariant(
    "INV-MB-019", "concat_tensordict of a padded mini-batch's consecutive parts (no nested key) gives its rows back; "
    "of metadata-only TensorDicts (no batch size) their flags; index_select_tensor_dict with a tensor of indices "
    "selects those rows, of a metadata-only TensorDict keeps every flag whole, of None gives None",
    functions=("concat_tensordict", "index_select_tensor_dict"), layouts=("padded",), adjust=_padded_budget,
    protects="gathered padded outputs and a trainer's meta info come back whole: no row reordered, no flag lost")
def metadata_and_padded_helpers(ctx: Ctx) -> None:
    case = ctx.case
    fns = layer(ctx)
    concat, select = fns.get("concat_tensordict"), fns.get("index_select_tensor_dict")
    mini = materialize_minibatch(case, ctx.device)
    parts = _suite_parts(mini, case)
    got = concat([p for p, _ in parts])
    check_sample_keys(got, mini, list(range(case.batch_size)), f"concat of padded parts {[len(r) for _, r in parts]}")
    meta = _metadata(case, mini)
    joined = concat([meta, meta.clone()])
    if _flags(joined) != _flags(meta):
        fail(f"concat of metadata-only TensorDicts: flags {_flags(joined)!r:.200}, expected {_flags(meta)!r:.200}")
    gen = torch.Generator().manual_seed(case.seed)
    rows = torch.randperm(case.batch_size, generator=gen)[: (case.seed % case.batch_size) + 1]
    picked = select(mini, rows)
    check_sample_keys(picked, mini, rows.tolist(), f"index_select by the tensor {rows.tolist()[:8]}")
    kept = select(meta, rows)
    if kept is None or _flags(kept) != _flags(meta):
        fail(f"index_select of a metadata-only TensorDict: {None if kept is None else _flags(kept)!r:.200}, "
             f"expected its flags {_flags(meta)!r:.200} whole")
    if select(None, rows) is not None:
        fail("index_select_tensor_dict(None, indices) returned a TensorDict, expected None")

