"""The contract and the conventions, apart(docs/contract.md, "Conventions").

A correct engine that keeps none of verl's conventions (a bool attention mask, non-zero positions on padding, no
``cu_seqlens_cpu`` copy, the model's logits scaled in place after it has read them) passes the contract: the
invariants of a convention are skipped for it with the convention's name, and the contract's own checks pass. The
same engine declaring verl's conventions in its profile fails them: a promised convention is asserted. No known
failure record of any registered engine excuses a convention.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import impl
from spec.cases import EngineCase
from spec.engines.impl.adapter import ImplEngine
from spec.execute.attribution import AttributedEngine
from spec.invariants import CATALOGUE, Ctx
from spec.invariants import core
from spec.protocol.known import as_records
from spec.protocol.profile import DEFAULT_PROFILE, VERL_CONVENTIONS, Convention
from spec.run.registry import ENGINES
from spec.run.runner import run_invariant, skip_reason

UNEQUAL = EngineCase(prompt_lens=(2, 3), response_lens=(2, 1), vocab=5, temperature=0.7, calculate_entropy=True,
                     seed=3)


class _NeutralLM(impl.LMHeadEngine):
    """impl with none of verl's conventions: a bool mask, position 7 on padding, no host copy of cu_seqlens, and
    the model's logits divided in place once the outputs are computed (nobody reads them afterwards)."""

    def prepare_model_inputs(self, micro_batch):
        inputs, args = super().prepare_model_inputs(micro_batch)
        inputs.pop("cu_seqlens_cpu", None)
        mask = inputs.get("attention_mask")
        if mask is not None:
            inputs["attention_mask"] = mask.bool()
            positions = inputs["position_ids"].clone()
            positions[..., mask == 0] = 7
            inputs["position_ids"] = positions
        return inputs, args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None, **kwargs):
        out = super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func, **kwargs)
        with torch.no_grad():
            output.logits.div_(3.0)
        return out


class NeutralEngine(ImplEngine):
    """A correct engine that declares no convention."""

    name = "tests.test_conventions:NeutralEngine"
    profile = DEFAULT_PROFILE
    engine_classes = {"lm": _NeutralLM, "value": impl.ValueHeadEngine}


class PromisingNeutralEngine(NeutralEngine):
    """The same engine declaring verl's conventions it does not keep."""

    name = "tests.test_conventions:PromisingNeutralEngine"
    profile = replace(DEFAULT_PROFILE, conventions=VERL_CONVENTIONS)


class _FloatMaskLM(impl.LMHeadEngine):
    def prepare_model_inputs(self, micro_batch):
        inputs, args = super().prepare_model_inputs(micro_batch)
        if inputs.get("attention_mask") is not None:  # Hugging Face's additive form: 0 to keep, -inf to mask
            inputs["attention_mask"] = torch.where(inputs["attention_mask"].bool(), 0.0, float("-inf"))
        return inputs, args


class FloatMaskEngine(NeutralEngine):
    name = "tests.test_conventions:FloatMaskEngine"
    engine_classes = {"lm": _FloatMaskLM, "value": impl.ValueHeadEngine}


def check(eng, invariant: str, case: EngineCase) -> None:
    info = CATALOGUE[invariant]
    case = info.adjust(case) if info.adjust else case
    case = core.honour_engine(case, eng)
    mode = case.mode if set(info.modes) & {"packed", "padded"} else info.modes[0]
    info.check(Ctx(AttributedEngine(eng), case, "cpu", mode))


#: the contract's checks the neutral engine's differences touch: each must pass it
CONTRACT = ["INV-MASK-001", "INV-MASK-002", "INV-MASK-003", "INV-POS-001", "INV-VAL-001", "INV-VAL-002",
            "INV-LEAK-001", "INV-LEAK-002", "INV-KEYS-003", "INV-MUT-001"]
#: the invariants that are one engine's convention as a whole
CONVENTION_ONLY = {"INV-POS-003": Convention.PADDING_POSITION_ZERO, "INV-CU-002": Convention.CU_SEQLENS_HOST_COPY,
                   "INV-MUT-002": Convention.LOGITS_UNTOUCHED}


@pytest.mark.parametrize("invariant, mode", [(inv, mode) for inv in CONTRACT for mode in ("packed", "padded")
                                             if {mode, "both"} & set(CATALOGUE[inv].modes)])
def test_an_engine_without_conventions_passes_the_contract(invariant, mode) -> None:
    check(NeutralEngine(), invariant, UNEQUAL.with_(use_remove_padding=mode == "packed"))


@pytest.mark.parametrize("invariant", ["INV-MASK-002", "INV-MASK-001", "INV-VAL-001"])
def test_its_verdict_passes(invariant) -> None:
    info = CATALOGUE[invariant]
    for mode in info.modes:
        outcome = run_invariant(info, NeutralEngine(), mode, "cpu", profile="dev", max_examples=8)
        assert outcome.status == "pass", (outcome.counterexample, outcome.error)


@pytest.mark.parametrize("invariant, convention", sorted(CONVENTION_ONLY.items()))
def test_a_convention_not_declared_is_skipped_with_its_name(invariant, convention) -> None:
    info = CATALOGUE[invariant]
    assert info.convention is convention
    outcome = run_invariant(info, NeutralEngine(), info.modes[0], "cpu", profile="dev", max_examples=4)
    assert outcome.status == "skip" and convention.value in outcome.reason, outcome


@pytest.mark.parametrize("invariant, case", [
    ("INV-MASK-002", UNEQUAL.with_(use_remove_padding=False)),
    ("INV-POS-003", UNEQUAL.with_(use_remove_padding=False)),
    ("INV-CU-002", UNEQUAL.with_(use_remove_padding=True, pass_cu_seqlens=True)),
    ("INV-MUT-002", UNEQUAL.with_(use_remove_padding=True)),
])
def test_a_declared_convention_is_asserted(invariant, case) -> None:
    info = CATALOGUE[invariant]
    if info.convention is None:  # the contract part runs for every engine, the convention's only when promised
        check(NeutralEngine(), invariant, case)
    else:  # not declared: skipped (the engine's choice); declared: run
        assert skip_reason(info, NeutralEngine(), "cpu") and skip_reason(info, PromisingNeutralEngine(), "cpu") is None
    with pytest.raises(AssertionError):
        check(PromisingNeutralEngine(), invariant, case)


def test_an_additive_float_mask_is_no_mask_under_any_profile() -> None:
    """A float mask of 0/-inf (an additive bias) is no 0/1 mask under any profile (a 2-D 0.0/1.0 float mask is one:
    tests/test_new_users.py)."""
    lengths = UNEQUAL.with_(use_remove_padding=False, response_lens=(2, 2))  # rows of 4 and 5 tokens: padding to mask
    with pytest.raises(AssertionError, match="0/1 keep-flags"):
        check(FloatMaskEngine(), "INV-MASK-002", lengths)


def test_verl_and_impl_declare_verl_conventions() -> None:
    from spec.engines.verl.adapter import VerlEngine

    assert VERL_CONVENTIONS == frozenset(Convention)
    assert ImplEngine.profile.conventions == VERL_CONVENTIONS
    assert VerlEngine.profile.conventions == VERL_CONVENTIONS
    assert ImplEngine().profile.promises(Convention.INT32_ATTENTION_MASK)


def test_every_convention_is_checked_somewhere() -> None:
    gated = {info.convention for info in CATALOGUE.values() if info.convention is not None}
    assert gated | {Convention.INT32_ATTENTION_MASK} == set(Convention)  # INV-MASK-002 reads Ctx.promises


def _static_records() -> dict[str, tuple]:
    """The record tables of verl's engines, for a machine without verl (they assemble their records from these when
    built): every version's."""
    from spec.engines.automodel import adapter as automodel
    from spec.engines.megatron import adapter as megatron
    from spec.engines.megatron.records import MEGATRON_ENGINE_RECORDS
    from spec.engines.torchtitan import adapter as torchtitan
    from spec.engines.veomni import adapter as veomni
    from spec.engines.verl import records as verl
    from spec.engines.verl.microbatch_records import MICROBATCH_RECORDS

    micro = tuple(r for records in MICROBATCH_RECORDS.values() for r in records)
    bugs = tuple(r for records in verl.KNOWN_BUGS.values() for r in records) + micro + verl.fp16_clamp_cast_records() \
        + (verl.OVERLAP_COUNT_INT64, verl.STUDENT_MASS_LOW_PRECISION, verl.SUM_PI_SQUARED_CANCELLATION)
    return {"verl": bugs, "verl-veomni": bugs + tuple(as_records(veomni.KNOWN_FAILURES)),
            "verl-torchtitan": torchtitan.KNOWN_RECORDS, "verl-automodel": automodel.KNOWN_RECORDS,
            "verl-megatron": megatron.MegatronEngine.KNOWN + MEGATRON_ENGINE_RECORDS + micro}


def _records():
    """Every registered engine's records and the conventions it declares: the engine's own where it builds here,
    else (verl's engines without verl) the tables they come from, under the class's profile."""
    from spec.engines.verl import records as verl
    from spec.engines.verl.adapter import VerlEngine

    static = _static_records()
    for name, (make, _) in ENGINES.items():
        try:
            engine = make()
        except ImportError:
            yield name, static[name], make.profile.conventions
        else:
            yield name, tuple(as_records(engine.known_failures)), engine.profile.conventions
    for version, records in verl.KNOWN_BUGS.items():
        yield f"verl {version}", records, VerlEngine.profile.conventions


def test_every_registered_engine_is_checked() -> None:
    assert set(ENGINES) <= {engine for engine, _, _ in _records()}


def test_no_record_excuses_a_convention() -> None:
    for engine, records, promised in _records():
        for record in records:
            convention = CONVENTION_ONLY.get(record.invariant)
            assert convention is None or convention in promised, \
                f"{engine}: {record.key} excuses {convention.value}, a convention the engine does not declare"
            assert "int32" not in record.matches, f"{engine}: {record.key} excuses a mask dtype ({record.matches})"
