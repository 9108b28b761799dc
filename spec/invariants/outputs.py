"""Invariants on prepare_model_outputs: keys, values against the oracle, leaks, temperature."""

from __future__ import annotations

import torch

from ..cases.structure import EngineCase
from ..cases.materialize import select_rows
from ..execute.harness import FUSED_AUX_KEYS, POISONS, execute
from ..protocol.profile import padded_layout_of, profile_of
from ..truth import outputs_checks as checks
from ..truth.rules import distinct_temperatures, layout_mask, offsets
from .core import (VALUE_FACTS, Ctx, EveryFailure, fail, invariant, match_oracle, match_runs, per_seq,
                   same)
from .reproduction import VALUES, Plan, both_modes, float_and_tensor


def expected_keys(case: EngineCase) -> set[str]:
    return checks.expected_keys(case.head, case.distillation_only, case.calculate_entropy,
                                case.calculate_sum_pi_squared, case.distillation_keys)


def _both_modes(ctx: Ctx):
    packed = ctx.rerun(ctx.case.with_(use_remove_padding=True))
    padded = ctx.rerun(ctx.case.with_(use_remove_padding=False, sp_size=1, pad_to_length=None))
    return packed, padded


@invariant("INV-KEYS-001", "output keys are exactly log_probs (unless distillation_only), entropy, "
           "sum_pi_squared and the processor's keys, as the flags ask", contract=3,
           protects="a trainer finds exactly the outputs its flags asked for (no KeyError, no stray keys)",
           repro=VALUES)
def keys_match_flags(ctx: Ctx) -> None:
    checks.output_keys(ctx.run.outputs, expected_keys(ctx.case), f"{ctx.case.mode} outputs")


@invariant("INV-KEYS-002", "packed and padded modes return the same set of keys", contract=3,
           protects="switching padding mode never drops an output key (verl #6293)", modes=("both",),
           repro=Plan(("keys", "values"), both_modes))
def keys_symmetric(ctx: Ctx) -> None:
    packed, padded = _both_modes(ctx)
    if set(packed.outputs) != set(padded.outputs):
        fail(f"packed keys {sorted(packed.outputs)} != padded keys {sorted(padded.outputs)}")


@invariant("INV-KEYS-003", "packed and padded modes agree on every value, per key", contract=3, facts=VALUE_FACTS,
           protects="switching padding mode never changes an output value", modes=("both",),
           repro=Plan(("keys", "values"), both_modes))
def values_symmetric(ctx: Ctx) -> None:
    packed, padded = _both_modes(ctx)
    match_runs(ctx, padded.outputs, packed.outputs, "padded vs packed")


@invariant("INV-VAL-001", "log_probs equal the oracle's log_softmax(logits / T)[next token] inside "
           "every sequence", contract=2, facts=VALUE_FACTS,
           protects="the log-probs a PPO/GRPO loss reads are the model's log-probs of the sampled tokens at temperature T", adjust=lambda c: c.with_(distillation_only=False),
           repro=Plan(("keys", "values"), keys=("log_probs",)))
def log_probs_values(ctx: Ctx) -> None:
    match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"])


@invariant("INV-VAL-002", "entropy equals the oracle's entropy of softmax(logits / T)", contract=2,
           facts=VALUE_FACTS,
           protects="the entropy bonus/metric is the entropy of the tempered distribution at every token",
           adjust=lambda c: c.with_(calculate_entropy=True), repro=Plan(("keys", "values"), keys=("entropy",)))
def entropy_values(ctx: Ctx) -> None:
    match_oracle(ctx, "entropy", ctx.run.outputs["entropy"])


@invariant("INV-VAL-003", "sum_pi_squared equals the oracle's sum(softmax(logits / T) ** 2)", contract=2,
           facts=VALUE_FACTS,
           protects="sum_pi_squared (used for variance/KL estimates) is that of the tempered distribution",
           needs=("sum_pi_squared",),
           adjust=lambda c: c.with_(calculate_sum_pi_squared=True, use_fused_kernels=False),
           repro=Plan(("keys", "values"), keys=("sum_pi_squared",)))
def sum_pi_squared_values(ctx: Ctx) -> None:
    match_oracle(ctx, "sum_pi_squared", ctx.run.outputs["sum_pi_squared"])


def _with_distillation(case: EngineCase) -> EngineCase:
    keys = case.distillation_keys or ("distillation_losses", "student_mass")
    return case.with_(distillation_keys=keys, use_fused_kernels=False, sp_size=1, pad_to_length=None)


@invariant("INV-VAL-004", "every distillation key equals the processor applied to the temperature-scaled "
           "logits, one value per token, in both modes", contract=3, facts=VALUE_FACTS,
           protects="top-K distillation losses and masses are the processor's values on the tempered logits, per token", needs=("distillation",),
           adjust=_with_distillation, repro=VALUES)
def distillation_values(ctx: Ctx) -> None:
    facts = EveryFailure()
    for key in ctx.case.distillation_keys:
        with facts.each():
            if key not in ctx.run.outputs:
                fail(f"{ctx.case.mode} outputs lack distillation key {key!r} (keys: {sorted(ctx.run.outputs)})",
                     key=key)
            match_oracle(ctx, key, ctx.run.outputs[key])
    facts.raise_any()


def _fused_distillation(case: EngineCase) -> EngineCase:
    """Fused kernels with top-K distillation, the three terms a fused kernel computes (FUSED_AUX_KEYS), one
    temperature, one rank, no bucket, no sum_pi_squared; ``distillation_only`` as drawn, or by the seed."""
    return case.with_(use_fused_kernels=True, temperature=case.temperatures()[0], distillation_keys=FUSED_AUX_KEYS,
                      distillation_only=case.distillation_only or case.seed % 2 == 1, sp_size=1, pad_to_length=None,
                      calculate_sum_pi_squared=False)


@invariant("INV-FUSED-003", "fused kernels with top-K distillation (the model's fused kernel computes the terms "
           "itself, fused_linear_aux, as VeOmni's chunk_topk_distill, or, one case in four, it does not: then from "
           "the logits): every distillation key equals the processor "
           "on the tempered logits (distillation_losses, student_mass, teacher_mass: the terms a fused kernel "
           "computes), log_probs the model's unless distillation_only (then absent), entropy when asked",
           contract=3, facts=VALUE_FACTS, needs=("fused", "distillation"), adjust=_fused_distillation,
           protects="a fused-kernel distillation run gets its distillation losses and masses per token, and a "
                    "distillation-only run no policy log-probs", repro=Plan(("keys", "values")))
def fused_distillation_values(ctx: Ctx) -> None:
    outputs, case = ctx.run.outputs, ctx.case
    # the terms a fused kernel computes (an engine's own processor may ask more, which need the logits)
    want = (set(case.distillation_keys) & set(FUSED_AUX_KEYS)) | ({"entropy"} if case.calculate_entropy else set()) | (
        set() if case.distillation_only else {"log_probs"})
    missing = sorted(want - set(outputs))
    if missing:
        fail(f"{case.mode} outputs lack {missing} (keys: {sorted(outputs)})")
    if case.distillation_only and "log_probs" in outputs:
        fail(f"distillation_only, yet log_probs in the {case.mode} outputs")
    facts = EveryFailure()
    for key in sorted(want):
        with facts.each():
            match_oracle(ctx, key, outputs[key])
    facts.raise_any()


@invariant("INV-VAL-005", "value head: one key, values, equal to the model's per-token output", contract=2,
           facts=VALUE_FACTS,
           protects="a critic's values are the value head's per-token outputs, nested over full sequences",
           head="value", needs=("value",), repro=Plan(("keys", "values"), keys=("values",)))
def value_head(ctx: Ctx) -> None:
    if set(ctx.run.outputs) != {"values"}:
        fail(f"value head keys {sorted(ctx.run.outputs)}, expected ['values']")
    match_oracle(ctx, "values", ctx.run.outputs["values"])


@invariant("INV-LAYOUT-001", "every output is nested (B, j) with offsets = cu_seqlens of input_ids",
           contract=2,
           protects="every output splits into the samples' full sequences (offsets = cu_seqlens)", repro=VALUES)
def nested_layout(ctx: Ctx) -> None:
    want_offsets = offsets(ctx.case.seq_lens)
    for key, value in ctx.run.outputs.items():
        if not (isinstance(value, torch.Tensor) and value.is_nested):
            fail(f"output {key!r} is not a nested tensor: {type(value).__name__} "
                 f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        if value.dim() != 2 or not torch.equal(value.offsets().cpu().long(), want_offsets):
            fail(f"output {key!r} has shape {tuple(value.shape)} and offsets {value.offsets().tolist()}, "
                 f"expected (B, j) with offsets {want_offsets.tolist()}")


@invariant("INV-DEV-001", "outputs live on the input's device as float32", contract=9,
           protects="outputs are float32 on the batch's device, whatever the logits' dtype", facts=("key",),
           repro=Plan(("keys", "values", "float32")))
def device_dtype(ctx: Ctx) -> None:
    """Every output is looked at (spec.truth.outputs_checks.outputs_device_dtype): an excused bf16 ``log_probs``
    never hides an undeclared bf16 ``entropy`` in the same example."""
    facts = EveryFailure()
    checks.outputs_device_dtype(ctx.run.outputs, ctx.device, each=facts.each)
    facts.raise_any()


def _has_padding(ctx: Ctx) -> bool:
    """Whether the run had padded logit slots to poison (else the example is recorded as not exercised)."""
    case = ctx.case
    if case.use_remove_padding:
        widths = sum(view.input_ids.shape[-1] for view in ctx.run.views)
        has = widths > case.total_nnz
    else:
        layout = padded_layout_of(ctx.engine, case)
        has = bool((layout_mask(case.prompt_lens, case.response_lens, layout) == 0).any())
    if not has:
        ctx.not_exercised("no padding to poison")
    return has


def alone_nonfinite(ctx: Ctx, i: int) -> dict[str, torch.Tensor]:
    """Per output key, where sample ``i`` run alone, unpadded (one packed sequence: no padded slot, no tail), has
    non-finite values: NaN the engine computes from finite inputs, which no padding can explain. Cached per
    example."""
    cache = ctx.__dict__.setdefault("_alone_nonfinite", {})
    if i not in cache:
        profile = profile_of(ctx.engine)  # a padded-only engine (or a VLM that refuses packing): one row, no padding
        packed = profile.takes("packed", mrope=ctx.case.mrope, media=bool(ctx.case.media))
        mb = select_rows(ctx.run.micro_batch, [i])
        mb.set_non_tensor("use_remove_padding", packed)
        alone = ctx.case.subset([i]).with_(use_remove_padding=packed, sp_size=1, pad_to_length=None,
                                           pass_cu_seqlens=packed and ctx.case.pass_cu_seqlens)
        outputs = execute(ctx.engine, alone, ctx.device, micro_batch=mb).outputs
        cache[i] = {key: ~torch.isfinite(value.values() if value.is_nested else value).cpu()
                    for key, value in outputs.items() if isinstance(value, torch.Tensor)}
    return cache[i]


def leaked(ctx: Ctx, key: str, value: torch.Tensor) -> list[tuple[int, int]]:
    """(sequence, position) of every non-finite value of output ``key`` at a position a consumer reads that is
    finite when its sample runs alone, unpadded: what the poisoned padding (and only it) put there."""
    seqs = per_seq(value) if isinstance(value, torch.Tensor) and value.is_nested else None
    if seqs is None or len(seqs) != ctx.case.batch_size:
        fail(f"output {key!r} is not a nested tensor of {ctx.case.batch_size} sequences")
    bad = []
    for i, seq in enumerate(seqs):
        at = ctx.read[i]
        at = at[at < seq.shape[0]]
        nonfinite = at[~torch.isfinite(seq[at])]
        if nonfinite.numel():
            own = alone_nonfinite(ctx, i).get(key)
            own = own[nonfinite] if own is not None and own.shape[0] == seq.shape[0] else torch.zeros_like(nonfinite,
                                                                                                         dtype=torch.bool)
            bad += [(i, int(k)) for k in nonfinite[~own]]
    return bad


@invariant("INV-LEAK-001", "NaN in every padded logit slot and in the packed tail never reaches an output",
           contract=4, facts=("key", "position"), strategy_kwargs={"padding": True},
           protects="no NaN from padding reaches a loss", repro=VALUES)
def no_nan_leak(ctx: Ctx) -> None:
    """At every position a consumer reads, an output is finite unless the same sample run alone, unpadded, gives
    the same non-finite value there (a NaN the engine computes from finite inputs is the value invariants'
    finding, not a leak)."""
    _has_padding(ctx)
    facts = EveryFailure()
    for r, outputs in enumerate(ctx.run.rank_outputs):
        for key, value in outputs.items():
            with facts.each():
                bad = leaked(ctx, key, value)
                if bad:
                    fail(f"rank {r}: output {key!r} is not finite at (sequence, position) {bad[:4]} with the padding "
                         f"poisoned with NaN, and finite there when the sample runs alone unpadded: the padding "
                         "leaked", key=key, sequence=bad[0][0], position=bad[0][1])
    facts.raise_any()


@invariant("INV-LEAK-002", "huge values (+/-3e38) in the padding give bit-identical outputs to NaN padding",
           contract=4, facts=("key", "position"), strategy_kwargs={"padding": True},
           protects="values in padding never change an output", adjust=lambda c: c.with_(logits_dtype="bfloat16") if c.logits_dtype == "float16" else c,
           repro=Plan(("keys", "values"), poison="huge"))
def no_value_leak(ctx: Ctx) -> None:
    """At every position a consumer reads (NaN equal to NaN: a NaN the engine computes whatever the padding is
    the value invariants' finding)."""
    _has_padding(ctx)
    base = ctx.run.outputs
    facts = EveryFailure()
    for name in ("huge", "neg"):
        other = ctx.rerun(poison=name).outputs
        for key in base:
            with facts.each():
                _same_under_poison(ctx, key, base, other, name)
    facts.raise_any()


def _same_under_poison(ctx: Ctx, key: str, base: dict, other: dict, name: str) -> None:
    """INV-LEAK-002 for one output key and one poison."""
    if key not in other:
        fail(f"output {key!r} is missing when the padding holds {POISONS[name]:g} (keys {sorted(other)})", key=key)
    if not (base[key].is_nested and other[key].is_nested):
        fail(f"output {key!r} is a dense {tuple(base[key].shape)} tensor, expected nested sequences", key=key)
    for i, (a, b) in enumerate(zip(other[key].unbind(), base[key].unbind())):
        at = ctx.read[i]
        if a.shape != b.shape:
            fail(f"output {key!r} of sequence {i} has shape {tuple(a.shape)} when the padding holds "
                 f"{POISONS[name]:g}, {tuple(b.shape)} with NaN", key=key, sequence=i)
        if not same(a[at], b[at]):
            diff = float((a[at] - b[at]).abs().nan_to_num(float("inf")).max())
            differs = (a[at] != b[at]) & ~(a[at].isnan() & b[at].isnan())
            fail(f"output {key!r} of sequence {i} changes when the padding holds {POISONS[name]:g} instead of "
                 f"NaN (max diff {diff:.3g})", key=key, sequence=i, position=int(at[differs.nonzero()[0, 0]]))


def _per_sample_case(case: EngineCase) -> EngineCase:
    case = case.with_(use_fused_kernels=False, distillation_only=False)
    if case.batch_size == 1:  # two samples, so "per sample" means something
        case = case.with_(prompt_lens=case.prompt_lens * 2, response_lens=case.response_lens * 2)
    return distinct_temperatures(case)


@invariant("INV-TEMP-001", "temperature is applied per sample: distinct per-sample values match the oracle",
           contract=6, facts=VALUE_FACTS,
           protects="each sample's outputs use its own temperature", adjust=_per_sample_case, repro=VALUES)
def temperature_per_sample(ctx: Ctx) -> None:
    match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"], f"at T={list(ctx.case.temperatures())}")


@invariant("INV-TEMP-002", "a float temperature and a (B,) tensor of the same value give the same outputs",
           contract=6, facts=VALUE_FACTS,
           protects="a float temperature and a (B,) tensor of it give the same outputs",
           needs=("per_sample_temperature",), adjust=lambda c: c.with_(use_fused_kernels=False, temperature=c.temperatures()[0]),
           repro=Plan(("keys", "values"), float_and_tensor))
def temperature_scalar_vs_tensor(ctx: Ctx) -> None:
    tensor_case = ctx.case.with_(temperature=ctx.case.temperatures())
    match_runs(ctx, ctx.rerun(tensor_case).outputs, ctx.run.outputs, "tensor vs float temperature")


@invariant("INV-TEMP-003", "T = 1 is the identity: outputs equal the oracle on unscaled logits", contract=6,
           facts=VALUE_FACTS,
           protects="T = 1 gives the untempered log-probs",
           adjust=lambda c: c.with_(temperature=1.0, distillation_only=False), repro=VALUES)
def temperature_identity(ctx: Ctx) -> None:
    match_oracle(ctx, "log_probs", ctx.run.outputs["log_probs"], "at T=1")
