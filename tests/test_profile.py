"""An engine's profile (spec.protocol.profile.EngineProfile): the suite draws exactly what it declares and
asserts nothing of what it does not run. Each test engine is in tests/profile_engines.py; each is correct where its
profile says it runs, and refuses the rest, so a case outside its profile would fail here."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from spec.cases import EngineCase
from spec.cases.structure import Media
from spec.cases.microbatch import minibatch_cases
from spec.cases.strategies import engine_cases, profile_draws, within_limits
from spec.execute.attribution import AttributedEngine
from spec.execute.harness import execute
from spec.invariants import CATALOGUE, Ctx
from spec.invariants.core import honour_engine, in_context
from spec.protocol import EngineProfile, PaddedLayout, sequences_from_rows
from spec.protocol.engine import EngineUnderTest
from spec.protocol.profile import layout_starts, token_columns
from spec.repro import run_reproducer, write_reproducer
from spec.run import profiles  # noqa: F401 - registers the hypothesis profiles ("dev")
from spec.run.registry import load_engine
from spec.run.runner import _seed_examples, run_invariant, skip_reason
from spec.truth.rules import layout_columns, layout_mask, layout_width, padded_length

ENGINES = "tests.profile_engines"
UNEQUAL = EngineCase(prompt_lens=(3, 1, 2), response_lens=(1, 2, 2), vocab=7, calculate_entropy=True,
                     use_remove_padding=False, seed=5)  # lengths 4, 3, 4: padding in every layout


def engine(name: str):
    return load_engine(f"{ENGINES}:{name}")


def check(eng, invariant: str, case: EngineCase) -> None:
    """One invariant's check on ``case`` as the runner runs it (its adjust, then the engine's profile and limits)."""
    info = CATALOGUE[invariant]
    case = honour_engine(info.adjust(case) if info.adjust else case, eng)
    mode = case.mode if set(info.modes) & {"packed", "padded"} else info.modes[0]
    info.check(Ctx(AttributedEngine(eng), case, "cpu", mode))


def verdict(eng, invariants: list[str], examples: int = 8) -> dict:
    return {f"{inv}/{mode}": run_invariant(CATALOGUE[inv], eng, mode, "cpu", profile="dev", max_examples=examples)
            for inv in invariants for mode in CATALOGUE[inv].modes}


def failures(outcomes: dict) -> dict:
    return {k: f"{o.counterexample} -> {o.error}" for k, o in outcomes.items() if o.status not in ("pass", "skip")}


def drawn(strategy, n: int = 60) -> list:
    out = []

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def collect(case) -> None:
        out.append(case)

    collect()
    return out


# -- the record -----------------------------------------------------------------------------------------------------

def test_profile_rejects_what_it_cannot_mean() -> None:
    for bad in ({"modes": ("ragged",)}, {"modes": ()}, {"positions": ("alibi",)}, {"positions": ()},
                {"contexts": ("autocast_fp8",)}, {"padded_layouts": ("middle",)}, {"tail_multiple": 0},
                {"media": ("image",), "media_modes": ()}, {"media_modes": ("ragged",)},
                {"modes": ("packed",), "media": ("image",), "media_modes": ("padded",)},
                {"modes": ("packed",), "mrope_modes": ("padded",)}):
        with pytest.raises(ValueError):
            EngineProfile(**bad)
    assert EngineProfile(padded_layouts=("left",)).padded_layout is PaddedLayout.LEFT


def test_the_legacy_class_attribute_moves_into_the_profile() -> None:
    class Legacy(EngineUnderTest):
        padded_layout = PaddedLayout.LEFT_RIGHT

    assert Legacy.profile.padded_layouts == (PaddedLayout.LEFT_RIGHT,) and Legacy().padded_layout == "left_right"
    assert EngineUnderTest().padded_layout is PaddedLayout.RIGHT
    assert load_engine("trl").profile.padded_layout is PaddedLayout.LEFT_RIGHT if _has_trl() else True


def _has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except Exception:  # noqa: BLE001 - TRL lives in its own venv
        return False
    return True


# -- one map from a layout to columns -------------------------------------------------------------------------------

@pytest.mark.parametrize("layout, starts, width", [("right", [0, 0, 0], 4), ("left", [0, 1, 0], 4),
                                                   ("left_right", [0, 2, 1], 5)])
def test_layout_starts_say_where_each_row_sits(layout, starts, width) -> None:
    p, r = UNEQUAL.prompt_lens, UNEQUAL.response_lens  # n = 4, 3, 4
    got, w = layout_starts(layout, p, r)
    assert got.tolist() == starts and w == width == layout_width(p, r, layout)
    cols = layout_columns(p, r, layout)
    mask = layout_mask(p, r, layout)
    for i, c in enumerate(cols):
        assert c.tolist() == list(range(starts[i], starts[i] + p[i] + r[i]))
        assert mask[i].nonzero().flatten().tolist() == c.tolist()
    rows, columns, _ = token_columns(layout, p, r)
    assert torch.equal(columns, torch.cat(cols)) and rows.tolist() == [0] * 4 + [1] * 3 + [2] * 4


@pytest.mark.parametrize("layout", list(PaddedLayout))
def test_sequences_from_rows_reads_every_layout(layout) -> None:
    from spec.cases.materialize import materialize
    mb = materialize(UNEQUAL)
    p, r = UNEQUAL.prompt_lens, UNEQUAL.response_lens
    rows, columns, width = token_columns(layout, p, r)
    dense = torch.full((UNEQUAL.batch_size, width), -1.0)
    dense[rows, columns] = torch.arange(UNEQUAL.total_nnz, dtype=torch.float32)
    assert torch.equal(sequences_from_rows(dense, mb, layout).values(), torch.arange(UNEQUAL.total_nnz).float())


# -- modes ----------------------------------------------------------------------------------------------------------

def test_a_packed_only_engine_gets_skips_not_failures() -> None:
    eng = engine("PackedOnly")
    outcomes = verdict(eng, ["INV-MASK-001", "INV-KEYS-002", "INV-POS-002", "INV-ERR-001"], examples=6)
    assert not failures(outcomes), failures(outcomes)
    for key in ("INV-MASK-001/padded", "INV-KEYS-002/both"):
        assert outcomes[key].status == "skip" and "modes=('packed',)" in outcomes[key].reason, outcomes[key]
    assert outcomes["INV-POS-002/packed"].status == "pass" and outcomes["INV-POS-002/packed"].examples
    # an "any" target draws the engine's one mode only; the pinned examples are moved into it
    assert {c.mode for c in drawn(CATALOGUE["INV-ERR-001"].cases("any", eng))} == {"packed"}
    assert {c.mode for c in _seed_examples(CATALOGUE["INV-ERR-001"], "any", eng)} == {"packed"}


def test_without_its_profile_the_packed_only_engine_fails() -> None:
    eng = engine("PackedOnly")
    eng.profile = EngineProfile()  # the old suite: every padded target is the engine's failure
    outcome = run_invariant(CATALOGUE["INV-MASK-001"], eng, "padded", "cpu", profile="dev", max_examples=3)
    assert outcome.status == "fail" and "packed only" in outcome.error


def test_a_padded_only_engine_gets_skips_not_failures() -> None:
    eng = engine("PaddedOnly")
    outcomes = verdict(eng, ["INV-MASK-001", "INV-POS-002", "INV-KEYS-002", "INV-ERR-001"], examples=6)
    assert not failures(outcomes), failures(outcomes)
    assert outcomes["INV-POS-002/packed"].status == "skip" and outcomes["INV-KEYS-002/both"].status == "skip"
    assert {c.mode for c in drawn(CATALOGUE["INV-ERR-001"].cases("any", eng))} == {"padded"}
    assert {c.mode for c in _seed_examples(CATALOGUE["INV-ERR-001"], "any", eng)} == {"padded"}


# -- positions ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, mrope", [("TextOnly", False), ("MropeOnly", True)])
def test_only_the_declared_position_kind_is_drawn(name, mrope) -> None:
    eng = engine(name)
    for inv in ("INV-VAL-001", "INV-POS-002", "INV-DENSE-002"):
        info = CATALOGUE[inv]
        mode = info.modes[0]
        assert {c.mrope for c in drawn(info.cases(mode, eng), 40)} == {mrope}, inv
        assert {c.mrope for c in _seed_examples(info, mode, eng)} == {mrope}, inv
    assert {c.mrope for c in drawn(minibatch_cases(positions=eng.profile.positions), 40)} == {mrope}
    assert {c.mrope for c in drawn(engine_cases(), 60)} == {False, True}  # the default still draws both


@pytest.mark.parametrize("name", ["TextOnly", "MropeOnly"])
def test_an_engine_of_one_position_kind_passes(name) -> None:
    outcomes = verdict(engine(name), ["INV-POS-001", "INV-POS-002", "INV-VAL-001"], examples=6)
    assert not failures(outcomes), failures(outcomes)


# -- the left layout ------------------------------------------------------------------------------------------------

LEFT_CHECKS = ["INV-MASK-001", "INV-MASK-003", "INV-INPUT-001", "INV-INPUT-002", "INV-POS-001", "INV-POS-003",
               "INV-VAL-001", "INV-VAL-002", "INV-LEAK-001", "INV-LEAK-002", "INV-SLICE-002"]


@pytest.mark.parametrize("invariant", LEFT_CHECKS)
@pytest.mark.parametrize("mrope", [False, True])
def test_left_layout_passes_when_declared(invariant, mrope) -> None:
    check(engine("LeftPadded"), invariant, UNEQUAL.with_(mrope=mrope))


@pytest.mark.parametrize("invariant", ["INV-MASK-001", "INV-INPUT-001", "INV-VAL-001"])
def test_left_layout_declared_right_fails(invariant) -> None:
    with pytest.raises(AssertionError):  # lengths 4, 2, 4: the right layout's padding is a read token in the left
        check(engine("WrongLeftDeclaredRight"), invariant, UNEQUAL.with_(response_lens=(1, 1, 2)))


def test_left_layout_verdict() -> None:
    outcomes = verdict(engine("LeftPadded"), ["INV-MASK-001", "INV-MASK-003", "INV-INPUT-001", "INV-LEAK-001"])
    assert not failures(outcomes), failures(outcomes)


def test_the_harness_poisons_the_left_layouts_padding() -> None:
    run = execute(engine("LeftPadded"), UNEQUAL.with_(calculate_entropy=False))
    logits = run.model_outputs[0].logits
    assert bool(logits[1, 0].isnan().all()) and not bool(logits[1, 1:].isnan().any())  # row 1: 3 tokens, 1 pad left


# -- tail padding to a multiple ---------------------------------------------------------------------------------------

def test_padded_length_honours_the_tail_rule() -> None:
    assert padded_length(10, None, 1, 16) == 16 and padded_length(10, 4, 1, 16) == 16
    assert padded_length(17, None, 3, 16) == 33 and padded_length(10, None, 3) == 12


def test_a_tail_multiple_engine_passes() -> None:
    outcomes = verdict(engine("TailMultiple"), ["INV-POS-002", "INV-CU-001", "INV-VAL-001", "INV-LEAK-001"])
    assert not failures(outcomes), failures(outcomes)


def test_the_tail_rule_is_what_the_rank_invariants_read() -> None:
    case = EngineCase(prompt_lens=(3, 2), response_lens=(2, 3), vocab=8, sp_size=2)
    check(engine("TailMultiple"), "INV-RANK-003", case)
    with pytest.raises(AssertionError, match="pad_size 6, expected 0"):
        check(engine("WrongTailUndeclared"), "INV-RANK-003", case)


def test_the_engines_own_tail_rule_is_checked_where_it_applies() -> None:
    """INV-PAD-003: a profile's tail rule, or a switch's where the case draws it, gives the packed row's length;
    an engine without one is not asked."""
    for name in ("TailMultiple", "SwitchedTail"):
        outcomes = verdict(engine(name), ["INV-PAD-003"])
        assert outcomes["INV-PAD-003/packed"].status == "pass", failures(outcomes)
        assert outcomes["INV-PAD-003/packed"].exercised >= 8
    outcome = verdict(engine("WrongSwitchedTail"), ["INV-PAD-003"])["INV-PAD-003/packed"]
    assert outcome.status == "fail" and "expected 16" in str(outcome.error), outcome.error
    assert "tail multiple=16" in str(outcome.error)
    assert "pads its packed row to no multiple" in skip_reason(CATALOGUE["INV-PAD-003"], engine("TextOnly"), "cpu")


def test_a_switched_tail_rules_reproducer_fails_where_the_rule_is_broken(tmp_path) -> None:
    """The reproducer of INV-PAD-003 carries the case's multiple (the drawn switch's): it fails the engine that pads
    to half of it and passes the one that pads to it."""
    case = EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, engine_config=(("pad_to_multiple_of", 16),))
    for name, code in (("WrongSwitchedTail", 1), ("SwitchedTail", 0)):
        path, why = write_reproducer(tmp_path / f"{name}.py", invariant="INV-PAD-003", mode="packed",
                                     engine=engine(name), case=case)
        assert why is None and "TAIL_MULTIPLE = 16" in path.read_text()
        got, printed = run_reproducer(path)
        assert got == code, printed
        assert code == 0 or "FAIL INV-PAD-003 (tail_rule)" in printed and "expected 16" in printed, printed


def test_a_switched_tail_rule_is_the_cases() -> None:
    switched, case = engine("SwitchedTail"), EngineCase(prompt_lens=(3,), response_lens=(2,), vocab=8)
    assert switched.tail_multiple_of(case) is None
    assert switched.tail_multiple_of(case.with_(engine_config=(("pad_to_multiple_of", 16),))) == 16
    assert engine("TailMultiple").tail_multiple_of(case) == 16
    draws = drawn(CATALOGUE["INV-PAD-003"].cases("packed", switched), 30)
    assert all(dict(c.engine_config).get("pad_to_multiple_of") == 16 for c in draws)
    assert all(dict(c.engine_config).get("pad_to_multiple_of") == 16
               for c in _seed_examples(CATALOGUE["INV-PAD-003"], "packed", switched))


# -- a caller's autocast ----------------------------------------------------------------------------------------------

def test_autocast_is_drawn_only_where_the_profile_lists_it() -> None:
    info = CATALOGUE["INV-VAL-001"]
    assert "autocast_bf16" not in {c.context for c in drawn(info.cases("packed", engine("TextOnly")), 60)}
    assert "autocast_bf16" in {c.context for c in drawn(info.cases("packed", engine("Autocast")), 60)}
    assert {c.context for c in drawn(info.cases("packed", engine("Bf16UnderAutocast")), 20)} == {"autocast_bf16"}
    assert profile_draws(engine("Autocast").profile)["contexts"][-1] == "autocast_bf16"
    assert not within_limits(UNEQUAL.with_(context="autocast_bf16"))


@pytest.mark.parametrize("sp", [1, 2])
def test_the_engine_runs_inside_the_autocast_and_the_model_outside_it(sp) -> None:
    seen = []

    class Probe(type(engine("Autocast"))):
        def make(self, head="lm", **settings):
            obj = super().make(head, **settings)
            inner = obj.prepare_model_outputs

            def outputs(*args, **kwargs):
                seen.append((torch.is_autocast_enabled("cpu"), torch.is_grad_enabled()))
                return inner(*args, **kwargs)
            obj.prepare_model_outputs = outputs
            return obj

    case = EngineCase((3, 2), (2, 1), vocab=8, sp_size=sp, context="autocast_bf16")
    run = execute(Probe(), case)
    assert seen == [(True, True)] * sp and not torch.is_autocast_enabled("cpu")
    assert run.model_outputs[0].logits.dtype == torch.float32  # the stand-in model computed as without it


def test_autocast_judges_the_scaled_logits_in_bfloat16() -> None:
    case = EngineCase((3, 2), (2, 3), vocab=64, temperature=0.05, calculate_entropy=True, context="autocast_bf16")
    ctx = Ctx(engine("Autocast"), case, "cpu", "packed")
    for key in ("log_probs", "entropy"):
        want, tol = ctx.oracle(key)
        ref, ref_tol = ctx.expected.at_precision(key, "float32", "bfloat16")
        assert all(torch.equal(a, b) for a, b in zip(tol, ref_tol))
        plain = ctx.oracle(key, case.with_(context="grad"))[1]
        assert all(bool((a >= b).all()) for a, b in zip(tol, plain)) and any(bool((a > b).any()) for a, b in zip(tol, plain))
    assert in_context(None, "values", "autocast_bf16", ctx.expected) is None  # no arithmetic on the logits


def test_bfloat16_arithmetic_passes_under_autocast_only() -> None:
    case = EngineCase((3, 2), (2, 3), vocab=64, temperature=0.05, calculate_entropy=True, seed=3)
    check(engine("Bf16UnderAutocast"), "INV-VAL-001", case.with_(context="autocast_bf16"))
    check(engine("Bf16UnderAutocast"), "INV-VAL-002", case.with_(context="autocast_bf16"))
    with pytest.raises(AssertionError, match="log_probs"):
        check(engine("Bf16Undeclared"), "INV-VAL-001", case)


# -- media and mRoPE in some modes only -----------------------------------------------------------------------------

PADDED_MEDIA = EngineProfile(media=("image",), media_modes=("padded",))
PADDED_MROPE = EngineProfile(media=("image",), mrope_modes=("padded",))


@pytest.mark.parametrize("profile", [PADDED_MEDIA, PADDED_MROPE], ids=["media_modes", "mrope_modes"])
def test_media_are_drawn_only_in_the_modes_the_profile_lists(profile) -> None:
    draws = profile_draws(profile)
    padded = drawn(engine_cases(mode="padded", **draws), 80)
    assert any(c.media for c in padded) and {i.kind for c in padded for items in c.media for i in items} == {"image"}
    for mode in ("packed", None):  # a packed target, and one that may compare both modes
        cases = drawn(engine_cases(mode=mode, **draws), 80)
        assert not any(c.media for c in cases), mode
        assert any(c.mrope for c in cases) is (profile is PADDED_MEDIA), mode  # mRoPE alone: where mrope_modes say
    limits = {k: v for k, v in draws.items() if k != "modes"}
    media_case = next(c for c in padded if c.media)
    assert within_limits(media_case, **limits) and not within_limits(media_case.with_(use_remove_padding=True), **limits)


def test_an_invariant_on_media_skips_the_modes_without_them() -> None:
    eng = engine("TextOnly")
    eng.profile = EngineProfile(positions=("rope", "mrope"), media=("image",), media_modes=("padded",))
    assert "media_modes" in skip_reason(CATALOGUE["INV-MM-001"], eng, "cpu", "packed")
    assert skip_reason(CATALOGUE["INV-MM-001"], eng, "cpu", "padded") is None
    assert skip_reason(CATALOGUE["INV-VAL-001"], eng, "cpu", "packed") is None  # text cases still run packed
    video = EngineCase(prompt_lens=(4, 2), response_lens=(1, 1), vocab=16, mrope=True, use_remove_padding=False,
                       media=((Media("image", 1, 2, 2, 0), Media("video", 2, 2, 2, 0)), ()))
    kept = honour_engine(video, eng)
    assert kept.media == ((Media("image", 1, 2, 2, 0),), ()) and kept.prompt_lens == video.prompt_lens
    pinned = [c for c in _seed_examples(CATALOGUE["INV-VAL-001"], "padded", eng) if c.media]  # the reach case's images
    assert pinned and {i.kind for c in pinned for items in c.media for i in items} == {"image"}
    assert not any(c.media for c in _seed_examples(CATALOGUE["INV-VAL-001"], "packed", eng))


@pytest.mark.parametrize("name, status", [("RefusesNonpositiveTemperature", "pass"),
                                          ("ClampsButDeclaresRefusal", "fail")])
def test_a_declared_temperature_refusal_is_handed_zero_and_minus_one(name: str, status: str) -> None:
    """INV-FLAG-004 hands an engine that declares it refuses a temperature <= 0 (``refuses``) T = 0.0 and -1.0: one that
    raises passes; one that clamps (finite outputs) fails, its declaration untrue."""
    outcome = run_invariant(CATALOGUE["INV-FLAG-004"], engine(name), "packed", "cpu", profile="dev", max_examples=3)
    assert outcome.status == status, outcome
    if status == "fail":
        assert "temperature=0.0" in outcome.error and "accepted silently" in outcome.error
