"""Invariants on prepare_model_outputs: keys, values against the oracle, leaks, temperature."""

from __future__ import annotations

import torch

from ..cases import EngineCase
from ..harness import POISONS
from .core import Ctx, close, close_sequence, fail, invariant, per_seq


def expected_keys(case: EngineCase) -> set[str]:
    if case.head == "value":
        return {"values"}
    keys = set() if case.distillation_only else {"log_probs"}
    keys |= {"entropy"} if case.calculate_entropy else set()
    keys |= {"sum_pi_squared"} if case.calculate_sum_pi_squared else set()
    return keys | set(case.distillation_keys)


def _both_modes(ctx: Ctx):
    packed = ctx.rerun(ctx.case.with_(use_remove_padding=True))
    padded = ctx.rerun(ctx.case.with_(use_remove_padding=False, sp_size=1, pad_to_length=None))
    return packed, padded


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    for key in sorted(want):
        if key not in got:
            fail(f"{what}: key {key!r} missing")
        for i, (x, y) in enumerate(zip(per_seq(got[key]), per_seq(want[key]))):
            close_sequence(key, x, y, f"{what}: {key!r} of sequence {i}")


@invariant("INV-KEYS-001", "output keys are exactly log_probs (unless distillation_only), entropy, "
           "sum_pi_squared and the processor's keys, as the flags ask", contract=3)
def keys_match_flags(ctx: Ctx) -> None:
    got, want = set(ctx.run.outputs), expected_keys(ctx.case)
    if got != want:
        fail(f"{ctx.case.mode} outputs have keys {sorted(got)}, the flags ask for {sorted(want)}"
             + (f" (missing {sorted(want - got)})" if want - got else ""))


@invariant("INV-KEYS-002", "packed and padded modes return the same set of keys", contract=3, modes=("both",))
def keys_symmetric(ctx: Ctx) -> None:
    packed, padded = _both_modes(ctx)
    if set(packed.outputs) != set(padded.outputs):
        fail(f"packed keys {sorted(packed.outputs)} != padded keys {sorted(padded.outputs)}")


@invariant("INV-KEYS-003", "packed and padded modes agree on every value, per key", contract=3, modes=("both",))
def values_symmetric(ctx: Ctx) -> None:
    packed, padded = _both_modes(ctx)
    _compare(padded.outputs, packed.outputs, "padded vs packed")


@invariant("INV-VAL-001", "log_probs equal the oracle's log_softmax(logits / T)[next token] inside "
           "every sequence", contract=2, adjust=lambda c: c.with_(distillation_only=False))
def log_probs_values(ctx: Ctx) -> None:
    got = per_seq(ctx.run.outputs["log_probs"])
    for i, want in enumerate(ctx.expected.log_probs):
        close(got[i][: len(want)], want, f"log_probs of sequence {i}")


@invariant("INV-VAL-002", "entropy equals the oracle's entropy of softmax(logits / T)", contract=2,
           adjust=lambda c: c.with_(calculate_entropy=True))
def entropy_values(ctx: Ctx) -> None:
    got = per_seq(ctx.run.outputs["entropy"])
    for i, want in enumerate(ctx.expected.entropy):
        close(got[i], want, f"entropy of sequence {i}")


@invariant("INV-VAL-003", "sum_pi_squared equals the oracle's sum(softmax(logits / T) ** 2)", contract=2,
           adjust=lambda c: c.with_(calculate_sum_pi_squared=True, use_fused_kernels=False))
def sum_pi_squared_values(ctx: Ctx) -> None:
    got = per_seq(ctx.run.outputs["sum_pi_squared"])
    for i, want in enumerate(ctx.expected.sum_pi_squared):
        close(got[i], want, f"sum_pi_squared of sequence {i}")


def _with_distillation(case: EngineCase) -> EngineCase:
    keys = case.distillation_keys or ("distillation_losses", "student_mass")
    return case.with_(distillation_keys=keys, use_fused_kernels=False, sp_size=1, pad_to_length=None)


@invariant("INV-VAL-004", "every distillation key equals the processor applied to the temperature-scaled "
           "logits, one value per token, in both modes", contract=3, needs=("distillation",),
           adjust=_with_distillation)
def distillation_values(ctx: Ctx) -> None:
    for key, wants in ctx.expected.distillation.items():
        if key not in ctx.run.outputs:
            fail(f"{ctx.case.mode} outputs lack distillation key {key!r} (keys: {sorted(ctx.run.outputs)})")
        got = per_seq(ctx.run.outputs[key])
        for i, want in enumerate(wants):
            close(got[i], want, f"{key} of sequence {i}")


@invariant("INV-VAL-005", "value head: one key, values, equal to the model's per-token output", contract=2,
           head="value", needs=("value",))
def value_head(ctx: Ctx) -> None:
    if set(ctx.run.outputs) != {"values"}:
        fail(f"value head keys {sorted(ctx.run.outputs)}, expected ['values']")
    got = per_seq(ctx.run.outputs["values"])
    for i, want in enumerate(ctx.expected.values):
        close(got[i], want, f"values of sequence {i}")


@invariant("INV-LAYOUT-001", "every output is nested (B, j) with offsets = cu_seqlens of input_ids",
           contract=2)
def nested_layout(ctx: Ctx) -> None:
    offsets = torch.tensor((0, *ctx.case.seq_lens)).cumsum(0)
    for key, value in ctx.run.outputs.items():
        if not (isinstance(value, torch.Tensor) and value.is_nested):
            fail(f"output {key!r} is not a nested tensor: {type(value).__name__} "
                 f"{tuple(value.shape) if isinstance(value, torch.Tensor) else ''}")
        if value.dim() != 2 or not torch.equal(value.offsets().cpu(), offsets):
            fail(f"output {key!r} has shape {tuple(value.shape)} and offsets {value.offsets().tolist()}, "
                 f"expected (B, j) with offsets {offsets.tolist()}")


@invariant("INV-DEV-001", "outputs live on the input's device as float32", contract=9)
def device_dtype(ctx: Ctx) -> None:
    want = torch.device(ctx.device).type
    for key, value in ctx.run.outputs.items():
        values = value.values() if value.is_nested else value
        if values.device.type != want:
            fail(f"output {key!r} is on {values.device}, the batch is on {ctx.device}")
        if values.dtype != torch.float32:
            fail(f"output {key!r} has dtype {values.dtype}, expected torch.float32")


@invariant("INV-LEAK-001", "NaN in every padded logit slot and in the packed tail never reaches an output",
           contract=4)
def no_nan_leak(ctx: Ctx) -> None:
    for r, outputs in enumerate(ctx.run.rank_outputs):
        for key, value in outputs.items():
            values = value.values() if value.is_nested else value
            if not bool(torch.isfinite(values).all()):
                bad = (~torch.isfinite(values)).nonzero()[0].tolist()
                fail(f"rank {r}: output {key!r} is not finite at {bad} (padding poisoned with NaN)")


@invariant("INV-LEAK-002", "huge values (+/-3e38) in the padding give bit-identical outputs to NaN padding",
           contract=4)
def no_value_leak(ctx: Ctx) -> None:
    base = ctx.run.outputs
    for name in ("huge", "neg"):
        other = ctx.rerun(poison=name).outputs
        for key in base:
            if not torch.equal(other[key].values(), base[key].values()):
                diff = (other[key].values() - base[key].values()).abs().nan_to_num(float("inf")).max()
                fail(f"output {key!r} changes when the padding holds {POISONS[name]:g} instead of NaN "
                     f"(max diff {float(diff):.3g})")


def _per_sample_case(case: EngineCase) -> EngineCase:
    return case.with_(use_fused_kernels=False, temperature=tuple(0.5 + 0.75 * i for i in range(case.batch_size)),
                      distillation_only=False)


@invariant("INV-TEMP-001", "temperature is applied per sample: distinct per-sample values match the oracle",
           contract=6, adjust=_per_sample_case)
def temperature_per_sample(ctx: Ctx) -> None:
    got = per_seq(ctx.run.outputs["log_probs"])
    for i, want in enumerate(ctx.expected.log_probs):
        close(got[i][: len(want)], want, f"log_probs of sequence {i} at T={ctx.case.temperatures()[i]}")


@invariant("INV-TEMP-002", "a float temperature and a (B,) tensor of the same value give the same outputs",
           contract=6, adjust=lambda c: c.with_(use_fused_kernels=False, temperature=c.temperatures()[0]))
def temperature_scalar_vs_tensor(ctx: Ctx) -> None:
    tensor_case = ctx.case.with_(temperature=ctx.case.temperatures())
    _compare(ctx.rerun(tensor_case).outputs, ctx.run.outputs, "tensor vs float temperature")


@invariant("INV-TEMP-003", "T = 1 is the identity: outputs equal the oracle on unscaled logits", contract=6,
           adjust=lambda c: c.with_(temperature=1.0, distillation_only=False))
def temperature_identity(ctx: Ctx) -> None:
    got = per_seq(ctx.run.outputs["log_probs"])
    for i, want in enumerate(ctx.expected.log_probs):
        close(got[i][: len(want)], want, f"log_probs of sequence {i} at T=1")
