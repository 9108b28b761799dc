"""The micro-batch layer (contract clauses MB-1 .. MB-15, docs/contract.md (Micro-batch layer); MB-16 .. MB-19 in
:mod:`.microbatch_trainer`): from a trainer's mini-batch to micro-batches and back.

Each check draws a :class:`spec.cases.microbatch.MiniBatchCase` and calls the engine's layer
(``engine.microbatch_layer()``, verl 0.9.1's names) through the attribution boundary, so what the layer raises
counts as the engine's. What a check reads is what a consumer of the layer reads: which samples each micro-batch
holds (values, by their own offsets), the token total of each micro-batch, the count, every key and its nested
layout (``values()`` / ``offsets()`` / the sizes of the non-ragged dims), the flags, and the outputs after
order restoration. ``INV-MB-015`` runs the whole way: micro-batching, the engine's
``prepare_model_inputs``/``prepare_model_outputs`` with the toy model, ``postprocess_batch_func``, and the
per-sequence oracle.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import TensorDict

from ..cases.materialize import draws
from ..cases.microbatch import MiniBatchCase, materialize_minibatch, micro_batch_rows, minibatch_cases
from ..execute.attribution import engine_side
from ..execute.handoff import execution_context
from ..protocol.profile import profile_of
from ..execute.harness import execute, model_for
from ..execute.microbatch import dp_micro_batch_counts
from ..execute.step import step_layer_of
from ..protocol.engine import OutputSpan
from ..protocol.microbatch import MicroBatchLayer
from ..truth import microbatch_checks as checks
from ..truth.microbatch_checks import check_nested, check_sample_keys, is_stack, items, offsets_of, plain
from ..truth.oracle import expected
from ..truth.rules import read_positions
from .core import CATALOGUE, Ctx, InvariantInfo, fail, held, same
from .microbatch_step import BRIDGED, bridge_skip_reason, fit, step_microbatch_layer
from .reproduction import LayerCheck

__all__ = ["MicroBatchInfo", "PINNED"]

CONTRACT = 13  # the micro-batch layer's clause in docs/contract.md (its sub-clauses 13.1-13.19: Micro-batch layer)
NESTED_KEYS = ("input_ids", "position_ids", "prompts", "responses", "loss_mask", "response_mask", "teacher_ids",
               "teacher_logprobs", "routed_experts")

#: worked examples pinned on every micro-batch invariant: two samples (lengths 5 and 3) under a budget that splits
#: them; an equal-length GRPO group of two with mRoPE positions (verl #7661/#7899); one sample (B = 1)
PINNED = (
    MiniBatchCase((3, 2), (2, 1), max_token_len=5),
    MiniBatchCase((2, 2), (3, 3), max_token_len=10, force_group_size=2, mrope=True, topk=2, routed_experts=True,
                  style="all_max"),
    MiniBatchCase((2,), (3,), max_token_len=5, mrope=True),
)


@dataclass(frozen=True)
class MicroBatchInfo(InvariantInfo):
    """An invariant on the micro-batch layer: its cases are mini-batches, ``functions`` the layer functions it calls
    (an engine whose layer lacks one skips it, with the reason)."""

    functions: tuple[str, ...] = ()
    #: the share of a profile's examples each micro-batch invariant draws (every example cuts a whole mini-batch:
    #: 40 under ci, 16 under default, 400 under thorough)
    example_share: float = 0.4

    def cases(self, mode, engine):  # noqa: ARG002 - the mode (end to end) is set by ``adjust``
        kwargs = {"positions": tuple(profile_of(engine).positions), "media": tuple(profile_of(engine).media),
                  **self.strategy_kwargs}  # what it accepts
        if "engine" in self.needs:  # end to end: engine-level features only where the engine's own records allow
            kwargs.update(engine_extras(engine))
        strategy = minibatch_cases(**kwargs)
        strategy = strategy.map(self.adjust) if self.adjust else strategy
        step = _bridged_step(engine)
        return strategy.map(lambda case: fit(case, step)) if step is not None else strategy

    def skip_reason_for(self, engine) -> str | None:
        layer = engine.microbatch_layer()
        if layer is not None:
            return layer.lacks(self.functions)
        reason = engine.lacks("microbatch")
        step = step_layer_of(engine)
        if step is not None:  # its own cut and restore, by its own names
            why = bridge_skip_reason(self.id, step)
            if why is None:
                return None
            reason += (f"; not run through its step layer ({why}); the engine's own cut, padding and restore are "
                       "checked by INV-STEP-* (its step_layer)")
        return reason

    def pinned(self, mode: str, engine=None) -> list[MiniBatchCase]:
        kwargs = self.strategy_kwargs
        extras = engine_extras(engine) if engine is not None and "engine" in self.needs else {}
        cases = []
        for case in PINNED:
            if extras and not extras["allow_topk"]:
                case = case.with_(topk=0)
            if extras and not extras["allow_temperature"]:
                case = case.with_(per_sample_temperature=False)
            if kwargs.get("dynamic") is False:
                case = case.with_(use_dynamic_bsz=False, micro_batch_size=1)
            if mode in ("packed", "padded"):
                case = case.with_(use_remove_padding=mode == "packed")
            if kwargs.get("world", 1) > 1:
                g = case.force_group_size
                case = case.with_(other_ranks=((case.prompt_lens[:g], case.response_lens[:g]),))
            if kwargs.get("min_group_size", 1) > 1 and case.batch_size % 2 == 0:
                case = case.with_(force_group_size=2, max_token_len=max(case.max_token_len, max(case.group_tokens)))
            cases.append(case)
        step = _bridged_step(engine) if engine is not None else None
        return [fit(case, step) for case in cases] if step is not None else cases


def _bridged_step(engine):
    """The engine's step layer where its micro-batch checks run through it (no micro-batch layer of verl's names)."""
    return step_layer_of(engine) if engine.microbatch_layer() is None else None


def engine_extras(engine) -> dict[str, bool]:
    """What the end-to-end mini-batches may ask of the engine itself: top-K teacher tensors where its strategy limits
    allow distillation, a per-sample temperature where it has no known failure of its own on per-sample temperatures
    (INV-TEMP-001): those are the engine's findings, not the layer's, and are reported there."""
    limits = engine.strategy_limits()
    records = getattr(engine, "known_failures", ()) or ()
    own_temperature_bug = any(getattr(r, "invariant", None) == "INV-TEMP-001" for r in records)
    return {"allow_topk": bool(limits.get("allow_distillation", True)), "allow_temperature": not own_temperature_bug}


def mb_invariant(id: str, title: str, *, functions: tuple[str, ...], protects: str, modes=("any",),
                 needs: tuple[str, ...] = ("microbatch",), adjust=None, example_share: float = 0.4,
                 repro: LayerCheck | None = None, **strategy_kwargs: Any):
    if id in BRIDGED:  # an engine without verl's layer may answer it with its step layer (skip_reason_for decides)
        needs = tuple(need for need in needs if need != "microbatch")

    def register(check):
        if id in CATALOGUE:
            raise ValueError(f"duplicate invariant id {id}")
        CATALOGUE[id] = MicroBatchInfo(id=id, title=title, contract=CONTRACT, check=check, modes=modes, needs=needs,
                                       kind="microbatch", strategy_kwargs=strategy_kwargs, adjust=adjust,
                                       protects=protects, functions=functions, example_share=example_share,
                                       repro=repro)
        return check
    return register


# -- reading what the layer returns ---------------------------------------------------------------------------------

def layer(ctx: Ctx) -> MicroBatchLayer:
    """The engine's layer with each function tagged as the engine's (what it raises is the engine's failure), each
    called in the case's autograd context (a trainer cuts the mini-batch of an old-policy or reference pass under
    ``no_grad`` or ``inference_mode``, of a policy update with grad on)."""
    raw = ctx.engine.microbatch_layer() or step_microbatch_layer(step_layer_of(ctx.engine))
    return MicroBatchLayer(raw.name, {name: _in_context(engine_side(fn, name), ctx.case)
                                      for name, fn in raw.functions.items()}, dict(raw.missing))


def _in_context(fn: Callable[..., Any], case: MiniBatchCase) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        with execution_context(case):
            return fn(*args, **kwargs)
    return call


def refusable_case(case: MiniBatchCase) -> bool:
    if case.use_dynamic_bsz:
        return case.over_budget or case.count_feasible() is not True
    return not case.fixed_divides


def refusable(ctx: Ctx) -> bool:
    """Whether the layer may refuse the case (a sample over the budget, no count meeting the rules, or a wrong size on
    the fixed path): such cases belong to INV-MB-003/004/006 and are not exercised elsewhere."""
    refused = refusable_case(ctx.case)
    if refused:
        ctx.not_exercised("a mini-batch the layer may refuse (INV-MB-003/004/006)")
    return refused


def cut(ctx: Ctx, case: MiniBatchCase | None = None, mini: TensorDict | None = None, **kwargs: Any):
    """``prepare_micro_batches`` on the case's mini-batch (``mini``, default a fresh one), with the case's count
    settings; (mini, micro, indices)."""
    case = case or ctx.case
    mini = materialize_minibatch(case, ctx.device) if mini is None else mini
    micro, indices = layer(ctx).get("prepare_micro_batches")(
        mini, num_batches_divided_by=case.num_batches_divided_by, min_num_micro_batch=case.min_num_micro_batch,
        use_dynamic_bsz_balance=case.balance, **kwargs)
    return mini, list(micro), indices


def rows_of(case: MiniBatchCase, micro: list, indices) -> list[list[int]]:
    """Which mini-batch samples each micro-batch holds: the returned indices (dynamic path), or consecutive chunks
    of each micro-batch's size (fixed path: no indices, the order is kept)."""
    rows = micro_batch_rows(micro, indices)
    checks.check_index_lists(micro, rows, indices)
    return rows


def check_partition(case: MiniBatchCase, rows: list[list[int]]) -> None:
    checks.check_partition(case.batch_size, rows)


# -- the invariants ------------------------------------------------------------------------------------------------

@mb_invariant(
    "INV-MB-001", "prepare_micro_batches (token budget): every sample in exactly one micro-batch, and each "
    "micro-batch holds exactly the samples its index list names", functions=("prepare_micro_batches",),
    dynamic=True, allow_large=True,
    protects="no sample is dropped, duplicated or handed under another sample's index", repro=LayerCheck("partition"))
def partition(ctx: Ctx) -> None:
    if refusable(ctx):
        return
    mini, micro, indices = cut(ctx)
    checks.check_index_lists(micro, micro_batch_rows(micro, indices), indices, dynamic=True)
    rows = rows_of(ctx.case, micro, indices)
    check_partition(ctx.case, rows)
    checks.micro_batch_samples(mini, micro, rows)


@mb_invariant(
    "INV-MB-002", "prepare_micro_batches with force_group_size g: each group of g consecutive samples lies in one "
    "micro-batch, whole", functions=("prepare_micro_batches",), dynamic=True, max_group_size=4, min_group_size=2,
    protects="samples a loss compares (a reward model's chosen/rejected pair, a GRPO group) are never split",
    repro=LayerCheck("groups"))
def groups_together(ctx: Ctx) -> None:
    case = ctx.case
    if refusable(ctx):
        return
    if case.force_group_size == 1:
        ctx.not_exercised("force_group_size = 1")
    _, micro, indices = cut(ctx)
    rows = rows_of(case, micro, indices)
    check_partition(case, rows)
    checks.groups_together(case.batch_size, case.force_group_size, rows)


@mb_invariant(
    "INV-MB-003", "prepare_micro_batches: no micro-batch over the token budget max_token_len_per_gpu x sp_size; a "
    "mini-batch whose every sample (group) fits is accepted, one whose sample (group) alone exceeds it is refused "
    "with an error naming max_token_len", functions=("prepare_micro_batches",), dynamic=True, allow_over=True,
    allow_large=True,
    protects="no micro-batch runs out of memory on the GPU it was sized for, and none is silently truncated",
    repro=LayerCheck("budget"))
def token_budget(ctx: Ctx) -> None:
    case = ctx.case
    checks.token_budget(lambda: cut(ctx)[1:], case.over_budget, case.count_feasible(), case.budget,
                        max(case.group_tokens), case.max_token_len, case.sp_size, ctx.not_exercised)


@mb_invariant(
    "INV-MB-004", "prepare_micro_batches count rules: at least min_num_micro_batch, a multiple of "
    "num_batches_divided_by, exactly that minimum when the whole mini-batch fits one budget, never an empty "
    "micro-batch; more than the groups allow: empty micro-batches or a ValueError", functions=("prepare_micro_batches",),
    dynamic=True, refusals=True, protects="pipeline schedules (virtual stages) get the micro-batch count they require, and no "
    "micro-batch is empty or split more than the budget needs", repro=LayerCheck("count"))
def count_rules(ctx: Ctx) -> None:
    case = ctx.case
    if case.over_budget:
        ctx.not_exercised("a sample over the budget (INV-MB-003)")
        return
    checks.count_rules(lambda: cut(ctx)[1:], case.count_feasible(), case.required_count(), case.num_groups,
                       case.budget, max(case.group_tokens), case.total_nnz, case.min_num_micro_batch,
                       case.num_batches_divided_by)


@mb_invariant(
    "INV-MB-005", "prepare_micro_batches on data-parallel ranks (a gloo group, same_micro_num_in_dp): every rank "
    "gets the same number of micro-batches, each rank's still a partition within its budget",
    functions=("prepare_micro_batches",), needs=("microbatch", "real_ranks"), dynamic=True, world=2, extras=False,
    count_rules=False,
    protects="ranks run the same number of forward/backward steps: none hangs in a collective "
    "the others never join", repro=LayerCheck(on="ranks"))
def dp_same_count(ctx: Ctx) -> None:
    case = ctx.case
    feasible = dp_count_feasible(case)
    if feasible is None:
        ctx.not_exercised("whether one count fits every rank's groups cannot be told from the bounds")
        return
    try:
        replies = dp_micro_batch_counts(ctx.engine, case, ctx.device)
    except ValueError:
        if feasible is False:
            return  # the count every rank needs exceeds a rank's groups: refused on every rank
        raise
    ranks_ = [case.rank_case(r) for r in range(case.world)]
    checks.dp_same_count(replies, feasible, dp_lower_count(case), [
        {"batch_size": rc.batch_size, "budget": rc.budget, "num_groups": rc.num_groups} for rc in ranks_])


@mb_invariant(
    "INV-MB-006", "prepare_micro_batches fixed size (use_dynamic_bsz=False): consecutive chunks of "
    "micro_batch_size_per_gpu x force_group_size samples in order, every key kept, no indices; a batch size they do "
    "not divide is refused with an error naming micro_batch_size", functions=("prepare_micro_batches",),
    dynamic=False, fixed_divides=None, protects="the fixed path keeps the sample order (outputs need no restoring) "
    "and never drops the remainder of a mini-batch", repro=LayerCheck("fixed"))
def fixed_size(ctx: Ctx) -> None:
    case = ctx.case
    mini = materialize_minibatch(case, ctx.device)
    checks.fixed_size(lambda: cut(ctx, mini=mini)[1:], mini, case.fixed_divides, case.batch_size, case.micro_batch_size,
                      case.force_group_size)


@mb_invariant(
    "INV-MB-007", "restore_dynamic_batch: the per-micro-batch results, concatenated in micro-batch order, come back "
    "in the mini-batch's sample order (nested and dense), whatever the balancing reordered",
    functions=("prepare_micro_batches", "restore_dynamic_batch"), dynamic=True, allow_large=True,
    protects="each sample's log-probs come back under its own index", repro=LayerCheck("restore"))
def restore_order(ctx: Ctx) -> None:
    if refusable(ctx):
        return
    mini, micro, indices = cut(ctx)
    rows = rows_of(ctx.case, micro, indices)
    check_partition(ctx.case, rows)
    checks.restore_order(layer(ctx).get("restore_dynamic_batch"), mini, micro, indices)


def dp_lower_count(case: MiniBatchCase) -> int:
    """The fewest micro-batches the ranks can agree on: no rank's tokens fit fewer budgets."""
    return max(-(-case.rank_case(r).total_nnz // case.budget) for r in range(case.world))


def dp_count_feasible(case: MiniBatchCase) -> bool | None:
    """Whether one count fits every rank (True), none can (False), or the bounds cannot tell (None): a count k fits
    a rank when its bin-packing optimum <= k <= its groups."""
    ranks_ = [case.rank_case(r) for r in range(case.world)]
    if any(rc.over_budget for rc in ranks_):
        return None
    fewest = min(rc.num_groups for rc in ranks_)
    if dp_lower_count(case) > fewest:
        return False
    return True if max(_ffd(rc) for rc in ranks_) <= fewest else None


def _ffd(case: MiniBatchCase) -> int:
    sizes, bins = sorted(case.group_tokens, reverse=True), []
    for size in sizes:
        for i, used in enumerate(bins):
            if used + size <= case.budget:
                bins[i] += size
                break
        else:
            bins.append(size)
    return len(bins)


@mb_invariant(
    "INV-MB-008", "prepare_micro_batches: every micro-batch carries every key of the mini-batch for its samples, "
    "nested layouts kept (2-D ids, (b, 4, j) mRoPE positions, (b, j, K) teacher top-K, (b, j, L, K) routed experts), "
    "dense per-sample keys and uid stacks by row, flags equal; the mini-batch is left unchanged",
    functions=("prepare_micro_batches",),
    protects="the engine gets well-formed positions, teacher tensors, routed experts and its flags in every micro-batch",
    repro=LayerCheck("keys", on="helpers"))
def keys_and_layouts(ctx: Ctx) -> None:
    case = ctx.case
    if refusable(ctx):
        return
    mini = materialize_minibatch(case, ctx.device)
    before = _snapshot(mini)
    micro, indices = layer(ctx).get("prepare_micro_batches")(
        mini, num_batches_divided_by=case.num_batches_divided_by, min_num_micro_batch=case.min_num_micro_batch,
        use_dynamic_bsz_balance=case.balance)
    micro = list(micro)
    after = _snapshot(mini)
    changed = [key for key in before if key not in after or not same(after[key], before[key])]
    if changed or set(after) != set(before):
        fail(f"the mini-batch was changed: keys {changed or sorted(set(mini.keys()) ^ set(before))}")
    for k, (mb, part) in enumerate(zip(micro, rows_of(case, micro, indices))):
        check_sample_keys(mb, mini, part, f"micro-batch {k}")


def _snapshot(td: TensorDict) -> dict[str, Any]:
    """What a caller holds in ``td``: tensors cloned, stacks as lists, flags as their plain values."""
    out = {}
    for key in td.keys():
        value = td.get(key)
        out[key] = held(value) if isinstance(value, torch.Tensor) else (
            value.tolist() if is_stack(value) else plain(value))
    return out


def _chunk_count(case: MiniBatchCase) -> int:
    """A drawn divisor of B (from the seed: the case stays structure only)."""
    divisors = [c for c in range(1, case.batch_size + 1) if case.batch_size % c == 0]
    return divisors[case.seed % len(divisors)]


@mb_invariant(
    "INV-MB-009", "chunk_tensordict: c chunks of B/c consecutive samples, every key, nested layout, flag and value "
    "kept (equal lengths and B = 1 included)", functions=("chunk_tensordict",),
    protects="fixed-size micro-batches carry the samples and layouts of the mini-batch",
    repro=LayerCheck("chunk", on="helpers"))
def chunk(ctx: Ctx) -> None:
    case = ctx.case
    mini = materialize_minibatch(case, ctx.device)
    chunks = _chunk_count(case)
    parts = list(layer(ctx).get("chunk_tensordict")(mini, chunks))
    if len(parts) != chunks:
        fail(f"chunk_tensordict(td of {case.batch_size}, {chunks}) gave {len(parts)} chunks")
    size = case.batch_size // chunks
    for k, part in enumerate(parts):
        check_sample_keys(part, mini, list(range(k * size, (k + 1) * size)), f"chunk {k} of {chunks}")


def _suite_parts(mini: TensorDict, case: MiniBatchCase) -> list[tuple[TensorDict, list[int]]]:
    """The mini-batch cut by the suite itself (not the layer) into consecutive parts, sizes from the seed."""
    gen = torch.Generator().manual_seed(case.seed)
    cuts = sorted(set(torch.randint(1, case.batch_size + 1, (min(3, case.batch_size),), generator=gen).tolist())
                  | {case.batch_size})
    parts, start = [], 0
    for stop in cuts:
        rows = list(range(start, stop))
        parts.append((_select(mini, rows), rows))
        start = stop
    return parts


def _select(mini: TensorDict, rows: list[int]) -> TensorDict:
    """Samples ``rows`` of the mini-batch, built by the suite: nested tensors from their values and offsets."""
    out = TensorDict({}, batch_size=[len(rows)])
    for key in mini.keys():
        value = mini.get(key)
        if isinstance(value, torch.Tensor) and value.is_nested:
            ragged = getattr(value, "_ragged_idx", 1)
            samples = items(value, key)
            picked = [samples[i] for i in rows]
            out.set(key, torch.nested.nested_tensor_from_jagged(
                torch.cat(picked, dim=ragged - 1), offsets_of([t.shape[ragged - 1] for t in picked]), jagged_dim=ragged))
        elif isinstance(value, torch.Tensor):
            out.set(key, value[torch.tensor(rows, dtype=torch.long)])
        elif is_stack(value):
            out.set(key, type(value).from_list([value.tolist()[i] for i in rows]))
        else:
            out.set_non_tensor(key, plain(value))
    return out


@mb_invariant(
    "INV-MB-010", "concat_tensordict: consecutive parts of a mini-batch concatenate back to it, every key, nested "
    "layout, flag and value (equal lengths and B = 1 included)", functions=("concat_tensordict",),
    protects="outputs and batches gathered from micro-batches are the mini-batch's, sample by sample",
    repro=LayerCheck("concat", on="helpers"))
def concat(ctx: Ctx) -> None:
    case = ctx.case
    mini = materialize_minibatch(case, ctx.device)
    parts = _suite_parts(mini, case)
    got = layer(ctx).get("concat_tensordict")([p for p, _ in parts])
    check_sample_keys(got, mini, list(range(case.batch_size)), f"concat of parts {[len(r) for _, r in parts]}")


def _selection(case: MiniBatchCase) -> list[int]:
    """A subset of the samples in a seeded order (a permutation, a single sample, or all of them)."""
    gen = torch.Generator().manual_seed(case.seed)
    order = torch.randperm(case.batch_size, generator=gen).tolist()
    size = (case.seed % case.batch_size) + 1
    return order[:size]


@mb_invariant(
    "INV-MB-011", "index_select_tensor_dict: the selected samples in the given order, every key, nested layout, "
    "flag and value kept (a single sample and equal lengths included)", functions=("index_select_tensor_dict",),
    protects="a balanced micro-batch carries exactly the samples the partition picked",
    repro=LayerCheck("index_select", on="helpers"))
def index_select(ctx: Ctx) -> None:
    case = ctx.case
    mini = materialize_minibatch(case, ctx.device)
    rows = _selection(case)
    got = layer(ctx).get("index_select_tensor_dict")(mini, rows)
    check_sample_keys(got, mini, rows, f"index_select of {rows[:8]}")


@mb_invariant(
    "INV-MB-012", "nested_tensor_from_tensor_list and concat_nested_tensors: per-sample tensors ((n,), (4, n) with "
    "ragged_idx=2, (n, K), (n, L, K)) become one nested tensor of shape (B, ..., j, ...) with offsets from their "
    "lengths and their exact values (equal lengths and B = 1 included; (n,) and (4, n) also without ragged_idx, "
    "ragged on their last dim by default)",
    functions=("nested_tensor_from_tensor_list", "concat_nested_tensors"),
    protects="micro-batches rebuilt from samples have well-formed nested tensors an engine can read",
    repro=LayerCheck("nested", on="helpers"))
def nested_builders(ctx: Ctx) -> None:
    case = ctx.case
    mini = materialize_minibatch(case, ctx.device)
    fns = layer(ctx)
    build, join = fns.get("nested_tensor_from_tensor_list"), fns.get("concat_nested_tensors")
    rows = list(range(case.batch_size))
    for key in NESTED_KEYS:
        if key not in mini.keys():
            continue
        want = mini.get(key)
        ragged = getattr(want, "_ragged_idx", 1)
        samples = items(want, key)
        check_nested(build([t.clone() for t in samples], ragged_idx=ragged), want, rows,
                     f"nested_tensor_from_tensor_list({key!r} items, ragged_idx={ragged})")
        if ragged == want.dim() - 1:  # ragged on the items' last dim: the default a dataset collator relies on
            check_nested(build([t.clone() for t in samples]), want, rows,
                         f"nested_tensor_from_tensor_list({key!r} items) (ragged_idx by default)")
        if want.dim() >= 2:
            parts = [_select(mini, r).get(key) for r in _halves(case.batch_size)]
            check_nested(join(parts), want, rows, f"concat_nested_tensors({key!r} halves)")


def _halves(batch: int) -> list[list[int]]:
    half = max(1, batch // 2)
    return [list(range(half)), list(range(half, batch))] if batch > 1 else [[0]]


def _sample_dicts(mini: TensorDict, case: MiniBatchCase) -> list[dict[str, Any]]:
    keys = [k for k in ("input_ids", "position_ids", "responses", "teacher_ids", "routed_experts") if k in mini.keys()]
    per_key = {k: items(mini.get(k), k) for k in keys}
    return [{**{k: per_key[k][i].clone() for k in keys}, "score": torch.tensor(float(i)), "uid": f"u{i}"}
            for i in range(case.batch_size)]


@mb_invariant(
    "INV-MB-013", "list_of_dict_to_tensordict: per-sample dicts become a TensorDict of B samples: per-token tensors "
    "nested on their sequence dim ((B, j), (B, 4, j) mRoPE, (B, j, K), (B, j, L, K)) even when every sample has the "
    "same length or B = 1, 0-d tensors stacked (B,), other values a per-sample stack in order",
    functions=("list_of_dict_to_tensordict",),
    protects="a batch built from samples whose lengths happen to agree (a GRPO group all at the maximum length) is "
             "still nested, so .offsets() works (verl #7661)", repro=LayerCheck("from_samples", on="helpers"))
def from_samples(ctx: Ctx) -> None:
    case = ctx.case
    mini = materialize_minibatch(case, ctx.device)
    samples = _sample_dicts(mini, case)
    got = layer(ctx).get("list_of_dict_to_tensordict")(samples)
    rows = list(range(case.batch_size))
    if tuple(got.batch_size)[:1] != (case.batch_size,):
        fail(f"batch_size {tuple(got.batch_size)}, expected ({case.batch_size},)")
    for key in samples[0]:
        value = got.get(key)
        if key == "score":
            want = torch.tensor([float(i) for i in rows])
            if not isinstance(value, torch.Tensor) or value.is_nested or not torch.equal(value, want):
                fail(f"'score' (0-d per sample): {value!r:.100}, expected the dense (B,) {want.tolist()[:8]}")
        elif key == "uid":
            if _plain_list(value) != [f"u{i}" for i in rows]:
                fail(f"'uid': {value!r:.100}, expected the samples' uids in order")
        else:
            check_nested(value, mini.get(key), rows, f"{key!r} built from {case.batch_size} samples")


def _plain_list(value: Any) -> Any:
    return value.tolist() if hasattr(value, "tolist") else value


@mb_invariant(
    "INV-MB-014", "maybe_fix_3d_position_ids: after a consolidate + pickle round trip, mRoPE position_ids read as "
    "(B, 4, j) with each sample's (4, n) positions; 2-D positions and every other key are left as they are",
    functions=("maybe_fix_3d_position_ids",),
    protects="vision-language batches that crossed a process boundary keep readable positions",
    repro=LayerCheck("fix_3d", on="helpers"))
def fix_3d_positions(ctx: Ctx) -> None:
    case = ctx.case
    mini = materialize_minibatch(case, ctx.device)
    tensors = TensorDict({k: mini.get(k) for k in mini.keys() if isinstance(mini.get(k), torch.Tensor)},
                         batch_size=mini.batch_size)
    try:
        moved = pickle.loads(pickle.dumps(tensors.consolidate()))
    except Exception as exc:  # noqa: BLE001 - this tensordict cannot round-trip nested tensors: nothing to fix
        ctx.not_exercised(f"consolidate/pickle unavailable here: {type(exc).__name__}")
        return
    others = {k: held(moved.get(k)) for k in moved.keys() if k != "position_ids" or not case.mrope}
    layer(ctx).get("maybe_fix_3d_position_ids")(moved)
    rows = list(range(case.batch_size))
    check_nested(moved.get("position_ids"), mini.get("position_ids"), rows, "position_ids after the round trip and fix")
    for key, before in others.items():
        if not same(held(moved.get(key)), before):
            fail(f"{key!r} changed by maybe_fix_3d_position_ids")


def _e2e(case: MiniBatchCase) -> MiniBatchCase:
    """End to end: a batch the engine's toy model is cheap on (vocabulary 16), entropy asked for half the time."""
    return case.with_(calculate_entropy=case.seed % 2 == 1, uid=False)


@mb_invariant(
    "INV-MB-015", "end to end: a mini-batch cut by prepare_micro_batches, each micro-batch through the engine's "
    "prepare_model_inputs / the model / prepare_model_outputs, and postprocess_batch_func give every sample the "
    "per-sequence oracle's outputs in mini-batch order, whatever the partition, budget and balancing",
    functions=("prepare_micro_batches",), needs=("microbatch", "engine"), modes=("packed", "padded"),
    max_groups=6, count_rules=True, adjust=_e2e,
    protects="each sample's log-probs and entropy after micro-batching are its own, in its place",
    repro=LayerCheck(on="engine"))
def end_to_end(ctx: Ctx) -> None:
    case = ctx.case
    if refusable(ctx):
        return
    whole = case.engine_case()
    mini, micro, indices = cut(ctx, case)
    rows = rows_of(case, micro, indices)
    check_partition(case, rows)
    reuse: list = []  # one engine object for the whole mini-batch, as a trainer keeps it
    output_lst = []
    for part, mb in zip(rows, micro):
        run = execute(ctx.engine, whole.subset(part), ctx.device, micro_batch=mb, reuse=reuse)
        output_lst.append({"model_output": dict(run.outputs)})
    post = layer(ctx).get("postprocess_batch_func")
    if post is not None:
        outputs = post(output_lst=output_lst, indices=indices, data=mini)["model_output"]
    else:
        outputs = _concat_restore(ctx, output_lst, indices)
    want = expected(whole, model_for(whole, "cpu"), draws(whole))
    keys = checks.end_to_end_keys(whole.calculate_entropy, whole.distillation_keys)
    read = read_positions(whole.prompt_lens, whole.response_lens, getattr(ctx.engine, "output_span",
                                                                             OutputSpan.SEQUENCE))
    checks.end_to_end_outputs(outputs, keys, {key: want.of(key) for key in keys},
                              {key: want.tolerance[key] for key in keys}, case.seq_lens, read,
                              [len(r) for r in rows])


def _concat_restore(ctx: Ctx, output_lst: list[dict], indices) -> dict[str, torch.Tensor]:
    """What postprocess_batch_func does, from the layer's own concat and restore (a layer without it)."""
    fns = layer(ctx)
    out = {}
    for key in output_lst[0]["model_output"]:
        joined = fns.get("concat_nested_tensors")([o["model_output"][key] for o in output_lst])
        out[key] = joined if indices is None else fns.get("restore_dynamic_batch")(joined, indices)
    return out
