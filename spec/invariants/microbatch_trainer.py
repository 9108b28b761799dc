"""The micro-batch layer as a trainer calls it beyond the no-padding forward pass (contract clauses 13.16-13.19,
docs/contract.md (Micro-batch layer)): the data-parallel balance of a whole batch
(``get_seqlen_balanced_partitions`` with ``equal_size``), a training step's micro-batch outputs (loss and
metrics, with or without ``model_output``) through ``postprocess_batch_func``, a padded (dense) mini-batch cut by
``prepare_micro_batches``, and the TensorDict helpers on the padded and metadata-only TensorDicts a trainer hands
them. Each check draws a :class:`spec.cases.microbatch.MiniBatchCase` whose structure says which of these it is
(``k_partitions``/``equal_size``, ``outputs``, ``layout``) and reads every value the layer returns.
"""

from __future__ import annotations

from ..cases.microbatch import TIE_STYLES, MiniBatchCase, materialize_minibatch
from ..truth import microbatch_checks as checks
from .core import Ctx, fail
from .microbatch import _suite_parts, check_partition, cut, layer, mb_invariant, refusable, rows_of
from .reproduction import LayerCheck

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

@mb_invariant(
    "INV-MB-017", "postprocess_batch_func on a training step's micro-batch outputs: 'loss' the micro-batches' losses "
    "in micro-batch order, 'metrics' each key's values in micro-batch order (a list extends, a scalar appends), "
    "'model_output' the per-token outputs back in mini-batch order, or empty when no micro-batch returned one",
    functions=("prepare_micro_batches", "postprocess_batch_func"), outputs=("model_output", "train", "loss_only"),
    protects="the trainer's logged losses and metrics are every micro-batch's, each once and in order, and a "
             "loss-only step still returns its losses", repro=LayerCheck("step_outputs", on="helpers"))
def training_step_outputs(ctx: Ctx) -> None:
    case = ctx.case
    if (cut_ := _partitioned(ctx)) is None:
        return
    mini, micro, indices, rows = cut_
    checks.training_step_outputs(layer(ctx).get("postprocess_batch_func"), mini, micro, indices, rows, case.outputs)


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
             "budget, no row lost, duplicated or mixed with another's mask",
    repro=LayerCheck("padded_cut", on="helpers"))
def padded_minibatch_cut(ctx: Ctx) -> None:
    case = ctx.case
    if (cut_ := _partitioned(ctx)) is None:
        return
    mini, micro, _, rows = cut_
    checks.padded_cut(mini, micro, rows, case.use_dynamic_bsz, case.budget)


# -- INV-MB-019: TensorDict helpers on padded and metadata-only TensorDicts -----------------------------------------

@mb_invariant(
    "INV-MB-019", "concat_tensordict of a padded mini-batch's consecutive parts (no nested key) gives its rows back; "
    "of metadata-only TensorDicts (no batch size) their flags; index_select_tensor_dict with a tensor of indices "
    "selects those rows, of a metadata-only TensorDict keeps every flag whole, of None gives None",
    functions=("concat_tensordict", "index_select_tensor_dict"), layouts=("padded",), adjust=_padded_budget,
    protects="gathered padded outputs and a trainer's meta info come back whole: no row reordered, no flag lost",
    repro=LayerCheck("padded_helpers", on="helpers"))
def metadata_and_padded_helpers(ctx: Ctx) -> None:
    case = ctx.case
    fns = layer(ctx)
    mini = materialize_minibatch(case, ctx.device)
    parts = _suite_parts(mini, case)
    checks.padded_helpers(fns.get("concat_tensordict"), fns.get("index_select_tensor_dict"), mini,
                          [p for p, _ in parts], [r for _, r in parts], case.seed)
