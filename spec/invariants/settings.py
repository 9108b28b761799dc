"""Invariants on how an engine reads its flags and settings: defaults, encodings, and bad values.

A flag the micro-batch leaves out takes the contract's default; a flag spelled as a 0/1 int or a
numpy scalar means what the Python bool or int means (trainers build flags from configs and
arrays); a flag of the wrong type or an impossible value, and an impossible engine setting, is an
error, never a silently different run. The response-slice helpers keep every dtype exact (masks
are sliced as bool tensors).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from ..execute.attribution import engine_side, expect_engine_error
from ..execute.harness import Run, execute, processor_for
from ..cases.materialize import PadMode, materialize, materialize_dense
from ..protocol.profile import ROUTES_SWITCH, profile_of, routes_dtype
from ..truth import settings_checks as checks
from ..truth import slice_checks
from ..truth.routes import routes_of, without_last_routes
from ..truth.settings_checks import (BAD_FLAGS, BOOL_FLAGS, FLAG_DEFAULTS, SETTING_FEATURES, bad_settings,
                                     offered_settings, recode_flags)
from .core import Ctx, EveryFailure, fail, invariant
from .reproduction import Plan

__all__ = ["FLAG_DEFAULTS", "BOOL_FLAGS", "BAD_FLAGS", "bad_settings", "same_run", "recode_flags"]

def same_run(got: Run, want: Run, what: str) -> None:
    """``got`` prepared the same model inputs and output_args and returned the same outputs as ``want``."""
    checks.same_run(got.inputs, got.output_args, got.outputs, want.inputs, want.output_args, want.outputs, what)


@invariant("INV-FLAG-001", "a flag left out of the micro-batch takes the contract's default (same inputs, "
           "output_args and outputs as when it is given)", contract=10,
           protects="a trainer that omits a flag gets the contract's default behaviour, not a different mode or extra keys",
           repro=Plan(("flags_default",)))
def flags_default(ctx: Ctx) -> None:
    mb = materialize(ctx.case, ctx.device)
    dropped = checks.defaulted_flags(mb, ctx.case.response_lens)
    if not dropped:
        ctx.not_exercised("no flag holds its default")
        return
    for key in dropped:
        del mb[key]
    same_run(execute(ctx.engine, ctx.case, ctx.device, micro_batch=mb), ctx.run,
             f"without the flags {dropped} (at their defaults)")
    if "max_response_len" in dropped and "no_padding_2_padding" in _helpers(ctx):
        np2p = ctx.helper("no_padding_2_padding")
        if "log_probs" in ctx.run.outputs:
            checks.slice_without_width(np2p(ctx.run.outputs["log_probs"], mb),
                                       np2p(ctx.run.outputs["log_probs"], ctx.run.micro_batch))


def _helpers(ctx: Ctx) -> set[str]:
    return {name for name in ("no_padding_2_padding",) if ctx.engine.lacks(name) is None}


@invariant("INV-FLAG-002", "flags spelled as 0/1 ints, numpy bools or numpy ints, and pad_mode as a plain str, "
           "mean what the Python bools, ints and the str Enum mean", contract=10,
           protects="flags built from configs or arrays (1, numpy.True_) select the same mode and outputs as True",
           repro=Plan(("flags_recoded",)))
def flags_encodings(ctx: Ctx) -> None:
    mb = materialize(ctx.case, ctx.device)
    written = recode_flags(mb, ctx.case.seed % 2)
    same_run(execute(ctx.engine, ctx.case, ctx.device, micro_batch=mb), ctx.run,
             f"flags spelled as {', '.join(f'{k}={v!r}' for k, v in written.items())}")
    if ctx.case.max_response_len is not None and "no_padding_2_padding" in _helpers(ctx) \
            and "log_probs" in ctx.run.outputs:
        checks.slice_with_width(ctx.helper("no_padding_2_padding")(ctx.run.outputs["log_probs"], mb),
                                ctx.case.batch_size, ctx.case.max_response_len, written["max_response_len"])


@invariant("INV-FLAG-003", "a flag of the wrong type or an impossible value (a str, None or 2 for a bool flag, "
           "a float/str/bool pad_token_id, max_response_len < 1 or a float) is rejected", contract=10,
           protects="a typo such as calculate_entropy='False' fails loudly instead of silently switching a feature",
           repro=Plan(("bad_flags",)))
def flags_rejected(ctx: Ctx) -> None:
    # every bad value on every example (not one chosen by the seed, which left some never drawn), each on its
    # own shallow copy of one micro-batch (the keys are the copy's; materialising 24 times would cost 5x the
    # run); only the engine's own exception is a rejection (spec/execute/attribution.py)
    base = materialize(ctx.case, ctx.device)
    for key, bad in BAD_FLAGS:
        mb = base.copy()
        mb.set_non_tensor(key, bad)
        expect_engine_error(lambda: execute(ctx.engine, ctx.case, ctx.device, micro_batch=mb), f"flag {key}={bad!r}")


#: settings an engine's profile may declare unsupported (``EngineProfile.refuses``): INV-FLAG-004/005 hand it each
REFUSALS = {
    "pad_mode": "a pad_mode other than no_padding (left_right, right) on a micro-batch of nested tensors",
    "sum_pi_squared_fused": "calculate_sum_pi_squared with use_fused_kernels (fused kernels return no logits)",
    "bucket_distillation": "a static bucket (pad_to_length) with top-K distillation (the contract's forbidden pair)",
    "temperature_nonpositive": "a temperature <= 0 (0.0 and -1.0, one float): an engine that declares it refuses it "
                               "raises (impl does), never returns inf/NaN or an inverted distribution",
    "bucket_replay": "a static bucket (pad_to_length) with router replay (the case's routed experts replayed): the "
                     "engine raises, as verl's Megatron engine does",
    "routes_misaligned": "routed experts that miss a sample's (the micro-batch's last sample's dropped: routes of "
                         "another batch), where the case carries routes: the engine raises, never collates the "
                         "routes onto other tokens",
}


def _unsupported_refused(ctx: Ctx) -> None:
    """Each setting the engine's profile declares unsupported is refused by every call that reads it: the whole
    preparation; prepare_model_outputs alone, handed a valid run's model output and output_args; the micro-batch
    layer's postprocess_batch_func."""
    refuses = profile_of(ctx.engine).refuses
    if not refuses:
        ctx.not_exercised("the engine's profile declares no unsupported setting")
        return
    unknown = sorted(set(refuses) - set(REFUSALS))
    if unknown:
        raise ValueError(f"{ctx.engine.name}'s profile refuses {unknown}: no such setting in REFUSALS {sorted(REFUSALS)}")
    case, reuse = ctx.case, []
    run = execute(ctx.engine, case, ctx.device, reuse=reuse)
    eng, processor = reuse[0], processor_for(ctx.engine, case, 1, 0)
    if "pad_mode" in refuses:
        _, output_args = eng.prepare_model_inputs(run.micro_batch)  # a valid hand-off, whole, for the outputs step
        post = _layer_function(ctx.engine, "postprocess_batch_func")
        for mode in (PadMode.LEFT_RIGHT, PadMode.RIGHT):
            bad = run.micro_batch.copy()
            bad.set_non_tensor("pad_mode", mode)
            what = f"pad_mode={mode.value} ({refuses['pad_mode']})"
            expect_engine_error(lambda: eng.prepare_model_inputs(bad), f"prepare_model_inputs with {what}")
            expect_engine_error(lambda: eng.prepare_model_outputs(run.model_outputs[0], output_args, bad, processor),
                                f"prepare_model_outputs (a valid run's model output and output_args) with {what}")
            if post is not None and case.head == "lm":
                expect_engine_error(lambda: post(output_lst=[{"model_output": dict(run.outputs)}], indices=None,
                                                 data=bad), f"postprocess_batch_func with {what}")
    if "sum_pi_squared_fused" in refuses and case.head == "lm":
        bad = run.micro_batch.copy()
        bad.set_non_tensor("use_fused_kernels", True)
        bad.set_non_tensor("calculate_sum_pi_squared", True)
        expect_engine_error(lambda: execute(ctx.engine, case, ctx.device, micro_batch=bad),
                            f"use_fused_kernels with calculate_sum_pi_squared ({refuses['sum_pi_squared_fused']})")
    if "temperature_nonpositive" in refuses:
        for value in (0.0, -1.0):
            bad = run.micro_batch.copy()
            bad.set_non_tensor("temperature", value)
            expect_engine_error(lambda: execute(ctx.engine, case, ctx.device, micro_batch=bad),
                                f"temperature={value} ({refuses['temperature_nonpositive']})")
    if "routes_misaligned" in refuses and routes_of(run.micro_batch) is not None and case.batch_size > 1:
        expect_engine_error(lambda: execute(ctx.engine, case, ctx.device, micro_batch=without_last_routes(
            run.micro_batch)), f"routed experts missing the last sample's ({refuses['routes_misaligned']})")
    if "bucket_replay" in refuses and routes_dtype(case) is not None and case.head == "lm" and case.use_remove_padding:
        bucket = case.total_nnz + 1
        expect_engine_error(lambda: ctx.engine.make(case.head, pad_to_length=bucket, **{
            ROUTES_SWITCH: routes_dtype(case)}).prepare_model_inputs(run.micro_batch),
            f"pad_to_length={bucket} with router replay ({refuses['bucket_replay']})")
    if "bucket_distillation" in refuses and case.head == "lm" and case.use_remove_padding:
        bad = run.micro_batch.copy()
        bad.set_non_tensor("distillation_use_topk", True)
        bucket = case.total_nnz + 1
        expect_engine_error(lambda: ctx.engine.make(case.head, pad_to_length=bucket).prepare_model_inputs(bad),
                            f"pad_to_length={bucket} with distillation_use_topk ({refuses['bucket_distillation']})")


def _layer_function(engine: Any, name: str) -> Any:
    layer = engine.microbatch_layer() if hasattr(engine, "microbatch_layer") else None
    fn = layer.get(name) if layer is not None else None
    return engine_side(fn, name) if fn is not None else None


def _one_rank_scalar_temperature(case):
    """One rank (the engine object is called again directly) and one temperature (fused kernels take a scalar)."""
    return case.with_(sp_size=1, temperature=case.temperatures()[0] if case.per_sample_temperature else case.temperature)


for _id, _head in (("INV-FLAG-004", "lm"), ("INV-FLAG-005", "value")):
    invariant(_id, f"({_head} head) a setting the engine's profile declares unsupported (EngineProfile.refuses: a "
              "pad_mode other than no_padding, calculate_sum_pi_squared with use_fused_kernels, a static bucket with top-K "
              "distillation, a temperature <= 0) is refused with an "
              "exception by each call that reads it: the preparation, prepare_model_outputs alone (a valid run's "
              "model output and output_args), postprocess_batch_func", contract=10, modes=("packed", "padded"),
              head=_head, adjust=_one_rank_scalar_temperature, needs=("value",) if _head == "value" else (),
              protects="a trainer configured with a padding mode or feature the engine lacks fails loudly, never "
                       "gets tensors computed under another mode", repro=Plan(("refused",)))(_unsupported_refused)


@invariant("INV-SET-001", "an impossible engine setting (sp_size < 1, sp_rank outside [0, sp_size), a bucket "
           "or entropy chunk size < 1) is rejected, by the constructor or the first call (each of those settings "
           "the engine takes)", contract=10,
           modes=("packed",), needs_any=SETTING_FEATURES,
           protects="a misconfigured engine (chunk 0, rank out of range) fails at start, not with missing outputs",
           repro=Plan(("bad_settings",)))
def settings_rejected(ctx: Ctx) -> None:
    """Every impossible setting is tried (a record excusing one never hides another's acceptance)."""
    facts = EveryFailure()
    for bad in bad_settings(ctx.case, offered_settings(ctx.engine)):
        def build_and_call() -> None:
            ctx.engine.make(ctx.case.head, **bad).prepare_model_inputs(ctx.batch)
        # only the engine's own exception (its constructor's or its first call's) is a rejection: the suite's
        # own failure is not (spec/execute/attribution.py)
        with facts.each():
            expect_engine_error(build_and_call, f"engine settings {bad}")
    facts.raise_any()


@invariant("INV-DTYPE-001", "the response-slice helpers are exact for bool, int and float per-token tensors "
           "(bool masks included, with trailing dims): no_padding_2_padding pads with 0/False, "
           "response_to_nested inverts it", contract=2, modes=("any",),
           needs=("no_padding_2_padding", "response_from_nested", "response_to_nested"),
           protects="masks and ids sliced to the response shape keep their dtype and values (bool masks stay bool)",
           repro=Plan(("slice_dtypes",)))
def slice_dtypes(ctx: Ctx) -> None:
    case = ctx.case
    slice_checks.slice_dtypes(ctx.helper("no_padding_2_padding"), ctx.helper("response_to_nested"),
                              ctx.helper("response_from_nested"), ctx.batch, ctx.batch["response_mask"], case.seed,
                              case.prompt_lens, case.response_lens, case.response_width, ctx.device)


def _per_token(case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token values over a DenseCase's sequences, their offsets, and the expected response rows."""
    lens = [p + r for p, r in zip(case.prompt_lens, case.response_lens)]
    starts = torch.tensor((0, *lens)).cumsum(0)
    values = torch.randn(int(starts[-1]), generator=gen)
    want = torch.zeros(case.batch_size, max(case.response_lens))
    for i, (p, r) in enumerate(zip(case.prompt_lens, case.response_lens)):
        want[i, :r] = values[starts[i] + p - 1: starts[i] + p - 1 + r]
    return values, starts, want


def _check_slice(got: torch.Tensor, want: torch.Tensor, widths: tuple[int, ...], what: str) -> None:
    got = got.detach().cpu()
    if got.dim() != 2 or got.shape[0] != want.shape[0] or got.shape[1] not in widths:
        fail(f"{what}: shape {tuple(got.shape)}, expected ({want.shape[0]}, one of {sorted(set(widths))})")
    padded = torch.zeros(got.shape)
    padded[:, : want.shape[1]] = want
    if not torch.equal(got.float(), padded):
        fail(f"{what}: gave {got.tolist()}, expected {padded.tolist()}")


@invariant("INV-RESP-001", "no_padding_2_padding finds r_i in the batch itself: from nested responses alone "
           "(no response_mask or loss_mask, also in left_right_2_no_padding's batch), and in a trainer's dense "
           "batch from attention_mask over the response columns (holes in the response mask do not shorten a "
           "response)", contract=2,
           kind="dense", modes=("any",), needs=("no_padding_2_padding",),
           protects="log-probs sliced for a batch that carries only prompts/responses, or a dense batch, line "
                    "up with the response tokens")
def slice_response_lengths(ctx: Ctx) -> None:
    case = ctx.case
    values, starts, want = _per_token(case, torch.Generator().manual_seed(case.seed))
    nested = torch.nested.nested_tensor_from_jagged(values.to(ctx.device), starts.to(ctx.device))
    dense = materialize_dense(case, ctx.device)
    np2p = ctx.helper("no_padding_2_padding")
    rows = []
    for key, lens in (("prompts", case.prompt_lens), ("responses", case.response_lens)):
        part = dense[key]
        flat = torch.cat([part[i][part.shape[1] - n:] if key == "prompts" else part[i][:n] for i, n in enumerate(lens)])
        rows.append((key, torch.nested.nested_tensor_from_jagged(
            flat, torch.tensor((0, *lens), device=flat.device).cumsum(0))))
    only = TensorDict(dict(rows), batch_size=[case.batch_size])
    _check_slice(np2p(nested, only), want, (max(case.response_lens),),
                 "no_padding_2_padding with nested prompts/responses only")
    _check_slice(np2p(nested, dense), want, (max(case.response_lens), case.response_width),
                 f"no_padding_2_padding on the dense batch (response mask {dense['response_mask'].tolist()})")
    if ctx.engine.lacks("left_right_2_no_padding") is None:  # the converted batch, its masks dropped
        converted = ctx.helper("left_right_2_no_padding")(materialize_dense(case, ctx.device))
        for key in ("response_mask", "loss_mask"):
            if key in converted.keys():
                del converted[key]
        _check_slice(np2p(nested, converted), want, (max(case.response_lens), case.response_width),
                     "no_padding_2_padding on left_right_2_no_padding's batch without response_mask/loss_mask")
