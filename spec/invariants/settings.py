"""Invariants on how an engine reads its flags and settings: defaults, encodings, and bad values.

A flag the micro-batch leaves out takes the contract's default; a flag spelled as a 0/1 int or a
numpy scalar means what the Python bool or int means (trainers build flags from configs and
arrays); a flag of the wrong type or an impossible value, and an impossible engine setting, is an
error, never a silently different run. The response-slice helpers keep every dtype exact (masks
are sliced as bool tensors).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from tensordict import TensorDict

from ..execute.attribution import engine_side, expect_engine_error
from ..execute.harness import Run, execute, processor_for
from ..cases.materialize import PadMode, materialize, materialize_dense
from ..protocol.profile import profile_of
from .core import Ctx, fail, invariant, same

__all__ = ["FLAG_DEFAULTS", "BOOL_FLAGS", "BAD_FLAGS", "bad_settings", "same_run", "recode_flags"]

#: every per-batch flag of the contract with its default (pad_mode: NO_PADDING, compared by value)
FLAG_DEFAULTS: dict[str, Any] = {
    "use_remove_padding": True, "pad_mode": "no_padding", "use_fused_kernels": False, "pad_token_id": 0,
    "calculate_entropy": False, "calculate_sum_pi_squared": False, "distillation_use_topk": False,
    "distillation_only": False,
}
BOOL_FLAGS = tuple(k for k, v in FLAG_DEFAULTS.items() if isinstance(v, bool))


def _flag(mb: TensorDict, key: str) -> Any:
    value = mb.get(key)
    return getattr(value, "data", value)


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # a str Enum (verl's DatasetPadMode) by its value


def _tensors(obj: Any, where: str) -> dict[str, Any]:
    """Every tensor (nested as values + offsets) and plain value of a dict or a namespace-like result."""
    items = obj.items() if isinstance(obj, dict) else vars(obj).items()
    out = {}
    for key, value in items:
        if isinstance(value, torch.Tensor) and value.is_nested:
            out[f"{where}[{key!r}]"] = (value.values().detach().cpu(), value.offsets().cpu())
        elif isinstance(value, torch.Tensor):
            out[f"{where}[{key!r}]"] = value.detach().cpu()
        else:
            out[f"{where}[{key!r}]"] = value
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point():  # NaN == NaN here: the padding of a model input may hold NaN in both runs
            return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))
        return torch.equal(a, b)
    if _plain_value(a) and _plain_value(b):
        return a == b
    # an engine's own object (an output_args entry the contract does not define): never compared with ``==`` or
    # ``bool()``, which an object holding tensors answers ambiguously; only its type is the suite's to compare
    return type(a) is type(b)


def _plain_value(value: Any) -> bool:
    """A value the suite can compare with ``==``: None, a bool, number, str, bytes, dtype or device, or a tuple or
    list of them (numpy scalars included)."""
    if isinstance(value, (tuple, list)):
        return all(_plain_value(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                                               np.generic))


def same_run(got: Run, want: Run, what: str) -> None:
    """``got`` prepared the same model inputs and output_args and returned the same outputs as ``want``."""
    pairs = [(f"model_inputs of rank {r}", g, w) for r, (g, w) in enumerate(zip(got.inputs, want.inputs))]
    pairs += [(f"output_args of rank {r}", g, w) for r, (g, w) in enumerate(zip(got.output_args, want.output_args))]
    pairs.append(("outputs", got.outputs, want.outputs))
    for where, g, w in pairs:
        a, b = _tensors(g, where), _tensors(w, where)
        if set(a) != set(b):
            fail(f"{what}: {where} keys {sorted(a)}, expected {sorted(b)}")
        for key in a:
            if not _equal(a[key], b[key]):
                fail(f"{what}: {key} differs ({a[key]!r:.200} vs {b[key]!r:.200})")


def recode_flags(mb: TensorDict, style: int) -> dict[str, Any]:
    """Set every flag of ``mb`` to an equivalent spelling; return what was written.

    ``style`` 0: bools as 0/1 ints, pad_mode as a plain str; 1: numpy bools and numpy int64 ints."""
    written = {}
    for key in (*BOOL_FLAGS, "pad_token_id", "max_response_len", "pad_mode"):
        if key not in mb.keys():
            continue
        value = _plain(_flag(mb, key))
        if key == "pad_mode":
            new: Any = str(value)
        elif isinstance(value, bool):
            new = int(value) if style == 0 else np.bool_(value)
        else:
            new = int(value) if style == 0 else np.int64(value)
        mb.set_non_tensor(key, new)
        written[key] = new
    return written


@invariant("INV-FLAG-001", "a flag left out of the micro-batch takes the contract's default (same inputs, "
           "output_args and outputs as when it is given)", contract=10,
           protects="a trainer that omits a flag gets the contract's default behaviour, not a different mode or extra keys")
def flags_default(ctx: Ctx) -> None:
    mb = materialize(ctx.case, ctx.device)
    dropped = [key for key, default in FLAG_DEFAULTS.items()
               if key in mb.keys() and _plain(_flag(mb, key)) == default]
    if "max_response_len" in mb.keys() and ctx.case.max_response_len == max(ctx.case.response_lens):
        dropped.append("max_response_len")  # its default is max(r_i)
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
            got, want = np2p(ctx.run.outputs["log_probs"], mb), np2p(ctx.run.outputs["log_probs"], ctx.run.micro_batch)
            if not same(got, want):  # NaN equal to NaN in the same place: a NaN both give is the value checks'
                fail(f"no_padding_2_padding without max_response_len gave shape {tuple(got.shape)} "
                     f"({'other values' if tuple(got.shape) == tuple(want.shape) else 'another shape'}), "
                     f"expected {tuple(want.shape)} as with it (the flag equalled max(r_i))")


def _helpers(ctx: Ctx) -> set[str]:
    return {name for name in ("no_padding_2_padding",) if ctx.engine.lacks(name) is None}


@invariant("INV-FLAG-002", "flags spelled as 0/1 ints, numpy bools or numpy ints, and pad_mode as a plain str, "
           "mean what the Python bools, ints and the str Enum mean", contract=10,
           protects="flags built from configs or arrays (1, numpy.True_) select the same mode and outputs as True")
def flags_encodings(ctx: Ctx) -> None:
    mb = materialize(ctx.case, ctx.device)
    written = recode_flags(mb, ctx.case.seed % 2)
    same_run(execute(ctx.engine, ctx.case, ctx.device, micro_batch=mb), ctx.run,
             f"flags spelled as {', '.join(f'{k}={v!r}' for k, v in written.items())}")
    if ctx.case.max_response_len is not None and "no_padding_2_padding" in _helpers(ctx) \
            and "log_probs" in ctx.run.outputs:
        sliced = ctx.helper("no_padding_2_padding")(ctx.run.outputs["log_probs"], mb)
        want = (ctx.case.batch_size, ctx.case.max_response_len)
        if tuple(sliced.shape) != want:
            fail(f"no_padding_2_padding with max_response_len={written['max_response_len']!r} gave shape "
                 f"{tuple(sliced.shape)}, expected {want}")


#: every wrong-typed or impossible flag value INV-FLAG-003 hands an engine: each example tries all of them
BAD_FLAGS: tuple[tuple[str, Any], ...] = (
    *((key, bad) for key in BOOL_FLAGS for bad in ("False", 2, None)),
    ("pad_token_id", 1.5), ("pad_token_id", "0"), ("pad_token_id", True),
    ("max_response_len", 0), ("max_response_len", -1), ("max_response_len", 2.0),
)


@invariant("INV-FLAG-003", "a flag of the wrong type or an impossible value (a str, None or 2 for a bool flag, "
           "a float/str/bool pad_token_id, max_response_len < 1 or a float) is rejected", contract=10,
           protects="a typo such as calculate_entropy='False' fails loudly instead of silently switching a feature")
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
              "distillation) is refused with an "
              "exception by each call that reads it: the preparation, prepare_model_outputs alone (a valid run's "
              "model output and output_args), postprocess_batch_func", contract=10, modes=("packed", "padded"),
              head=_head, adjust=_one_rank_scalar_temperature, needs=("value",) if _head == "value" else (),
              protects="a trainer configured with a padding mode or feature the engine lacks fails loudly, never "
                       "gets tensors computed under another mode")(_unsupported_refused)


def bad_settings(case) -> tuple[dict[str, Any], ...]:
    """Every impossible engine setting INV-SET-001 tries (at the case's sp size, or 2)."""
    sp = max(case.sp_size, 2)
    return ({"sp_size": 0, "sp_rank": 0}, {"sp_size": sp, "sp_rank": sp}, {"sp_size": sp, "sp_rank": -1},
            {"pad_to_length": 0}, {"pad_to_length": -8}, {"entropy_chunk_size": 0}, {"entropy_chunk_size": -1})


@invariant("INV-SET-001", "an impossible engine setting (sp_size < 1, sp_rank outside [0, sp_size), a bucket "
           "or entropy chunk size < 1) is rejected, by the constructor or the first call", contract=10,
           modes=("packed",), needs=("sp", "bucket", "chunking"),
           protects="a misconfigured engine (chunk 0, rank out of range) fails at start, not with missing outputs")
def settings_rejected(ctx: Ctx) -> None:
    for bad in bad_settings(ctx.case):
        def build_and_call() -> None:
            ctx.engine.make(ctx.case.head, **bad).prepare_model_inputs(ctx.batch)
        # only the engine's own exception (its constructor's or its first call's) is a rejection: the suite's
        # own failure is not (spec/execute/attribution.py)
        expect_engine_error(build_and_call, f"engine settings {bad}")


_DTYPES = (torch.bool, torch.int64, torch.int32, torch.float32, torch.bfloat16)


@invariant("INV-DTYPE-001", "the response-slice helpers are exact for bool, int and float per-token tensors "
           "(bool masks included, with trailing dims): no_padding_2_padding pads with 0/False, "
           "response_to_nested inverts it", contract=2, modes=("any",),
           needs=("no_padding_2_padding", "response_from_nested", "response_to_nested"),
           protects="masks and ids sliced to the response shape keep their dtype and values (bool masks stay bool)")
def slice_dtypes(ctx: Ctx) -> None:
    case = ctx.case
    gen = torch.Generator().manual_seed(case.seed)
    starts = torch.tensor((0, *case.seq_lens)).cumsum(0)
    mask = ctx.batch["response_mask"]
    for dtype in _DTYPES:
        for trailing in ((), (3,)):
            base = torch.randint(0, 4, (case.total_nnz, *trailing), generator=gen)
            values = (base > 1) if dtype == torch.bool else base.to(dtype)
            want = torch.zeros(case.batch_size, case.response_width, *trailing, dtype=dtype)
            for i, (p, r) in enumerate(zip(case.prompt_lens, case.response_lens)):
                want[i, :r] = values[starts[i] + p - 1: starts[i] + p - 1 + r]
            nested = torch.nested.nested_tensor_from_jagged(values.to(ctx.device), starts.to(ctx.device))
            got = ctx.helper("no_padding_2_padding")(nested, ctx.batch)
            if got.dtype != dtype or tuple(got.shape) != tuple(want.shape) or not torch.equal(got.cpu(), want):
                fail(f"no_padding_2_padding of a {dtype} tensor {tuple(values.shape)} gave {got.dtype} "
                     f"{got.tolist()}, expected {want.tolist()}")
            back = ctx.helper("response_to_nested")(got, mask)
            direct = ctx.helper("response_from_nested")(nested, mask)
            for name, value in (("response_to_nested", back), ("response_from_nested", direct)):
                rows = [t.cpu() for t in value.unbind()]
                for i, r in enumerate(case.response_lens):
                    if rows[i].dtype != dtype or tuple(rows[i].shape) != (r, *trailing) \
                            or not torch.equal(rows[i], want[i, :r]):
                        fail(f"{name} of a {dtype} tensor {tuple(values.shape)}: row {i} is {rows[i].tolist()}, "
                             f"expected {want[i, :r].tolist()}")


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
