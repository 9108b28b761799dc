"""The adapter kit (spec/engines/kit/__init__.py): an engine that calls the model inside its forward, strict stubs
for heavy imports, a third party's engine class, loading a library (stubs, a package without its __init__, one
ImportError), the declarations stated once (rows_view, in_logits_dtype), response rows back on the sequences, and
known-failure records that match on structured fields."""

from __future__ import annotations

import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from spec.cases import EngineCase
from spec.engines.kit.hf_batch import sequences_from_response_rows
from spec.engines.kit import (ModelNotCalled, ModelOutput, ThirdPartyEngine, import_library, in_logits_dtype,
                              inputs_seen_by_model, refuse_flags, replaying, rows_view)
from spec.engines.kit.stubs import StrictModule, StubError, import_with_stubs, strict_module
from spec.execute.attribution import AttributedEngine
from spec.invariants import CATALOGUE, Ctx
from spec.protocol import Feature, Precision
from spec.protocol.known import KnownFailure, Where
from spec.run.registry import load_engine
from tests.batches import seed_batch


# -- an engine that calls the model inside its own forward ----------------------------------------------------------

def _forward(model, ids, after: list):
    """A library's forward: builds the model inputs, calls the model, then goes on (and swallows exceptions)."""
    try:
        out = model(ids, attention_mask=ids > 0, position_ids=torch.arange(ids.shape[1]))
    except Exception:  # noqa: BLE001 - a library that catches everything must not swallow the stop
        return None
    after.append(out)
    return out["logits"] * 2


def test_inputs_seen_by_model_records_and_stops() -> None:
    ids, after = torch.tensor([[3, 0]]), []
    inputs = inputs_seen_by_model(lambda model: _forward(model, ids, after))
    assert set(inputs) == {"input_ids", "attention_mask", "position_ids"} and inputs["input_ids"] is ids
    assert after == []  # nothing after the model call ran


def test_replaying_returns_the_harness_output() -> None:
    output, after = SimpleNamespace(logits=torch.ones(1, 2, 3)), []
    assert torch.equal(_forward(replaying(output), torch.tensor([[3, 0]]), after), 2 * output.logits)
    result = replaying(output)()
    assert isinstance(result, ModelOutput) and result.logits is result["logits"] is output.logits
    result.entropy = 1
    assert result["entropy"] == 1


def test_a_forward_that_never_calls_the_model_is_an_error() -> None:
    with pytest.raises(ModelNotCalled):
        inputs_seen_by_model(lambda model: None)


# -- strict stubs ---------------------------------------------------------------------------------------------------

def test_an_undeclared_stub_name_raises_when_used() -> None:
    module = StrictModule("heavy_lib", {"npu_count": lambda: 0})
    assert module.npu_count() == 0  # declared: its value
    assert module.is_xpu_available() is False  # an availability probe is well known: the package is absent here
    undeclared = module.xpu_count
    for use in (bool, lambda f: f(), iter, len, int):
        with pytest.raises(StubError, match=r"heavy_lib\.xpu_count .*records=\{'heavy_lib': "
                                            r"\{'xpu_count': \.\.\.\}\}"):
            use(undeclared)

    class Model(module.PreTrainedModel):  # a base class may be a stub
        pass

    assert Model.__mro__[1].__name__ == "PreTrainedModel"


def test_strict_stubs_cannot_change_the_code_under_test_unnoticed(tmp_path, monkeypatch) -> None:
    """The MagicMock stub's npu_count() is truthy: the library silently turns its compile off. A strict stub
    raises instead, naming the name to declare; declared, the library runs as it would. (An ``is_<x>_available``
    probe needs no declaration: the kit knows it is False here, spec.engines.kit.stubs.WELL_KNOWN.)"""
    package = tmp_path / "kit_lib"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "core.py").write_text(textwrap.dedent("""
        from kit_missing_dep import npu_count
        COMPILE = not npu_count()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    for strict, values, want in ((False, None, False), (True, {"kit_missing_dep": {"npu_count": lambda: 0}}, True)):
        for name in ("kit_lib", "kit_lib.core", "kit_missing_dep"):
            sys.modules.pop(name, None)
        assert import_with_stubs("kit_lib.core", ("kit_missing_dep",), values, strict=strict).module.COMPILE is want
    for name in ("kit_lib", "kit_lib.core", "kit_missing_dep"):
        sys.modules.pop(name, None)
    with pytest.raises(StubError, match="kit_missing_dep.npu_count"):
        import_with_stubs("kit_lib.core", ("kit_missing_dep",), strict=True)
    for name in ("kit_lib", "kit_lib.core", "kit_missing_dep"):
        sys.modules.pop(name, None)


def test_strict_module_keeps_a_real_module() -> None:
    assert strict_module("torch") is torch


# -- a third party's engine class -----------------------------------------------------------------------------------

class _Lib(ThirdPartyEngine):
    name, library = "lib", "Lib's API"
    offers = frozenset({Feature.CU_SEQLENS, Feature.PER_SAMPLE_TEMPERATURE})
    reasons = {Feature.SP: "no process group"}

    def engine_object(self):
        return "object"


def test_third_party_engine_states_its_features_once() -> None:
    lib = _Lib()
    assert lib.lacks("sp") == "no process group" and lib.lacks(Feature.BUCKET) == "Lib's API has no bucket"
    assert lib.lacks(Feature.CU_SEQLENS) is None and lib.lacks(Feature.ENGINE) is None
    limits = lib.strategy_limits()
    assert limits["allow_cu_seqlens"] is True and limits["allow_sp"] is False
    assert limits["per_sample_temperature"] is None and lib.lacks(Feature.PER_SAMPLE_TEMPERATURE) is None  # both kinds
    limits = type("One", (_Lib,), {"offers": frozenset()})().strategy_limits()
    assert limits["per_sample_temperature"] is False
    assert lib.make() == "object"
    with pytest.raises(NotImplementedError, match="no engine settings"):
        lib.make(pad_to_length=8)
    with pytest.raises(NotImplementedError, match="use_fused_kernels: Lib's API"):
        refuse_flags(SimpleNamespace(use_fused_kernels=True, distillation_use_topk=False,
                                     calculate_sum_pi_squared=False), "Lib's API")


# -- loading a library -------------------------------------------------------------------------------------------

def test_a_library_loads_with_stubs_and_a_package_without_its_init(tmp_path, monkeypatch) -> None:
    inner = tmp_path / "kit_load" / "inner"
    inner.mkdir(parents=True)
    (tmp_path / "kit_load" / "__init__.py").write_text("")
    (inner / "__init__.py").write_text("raise RuntimeError('this __init__ must not run')\n")
    (inner / "core.py").write_text("from kit_load_heavy import Model\nVALUE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    names = ("kit_load", "kit_load.inner", "kit_load.inner.core", "kit_load_heavy")

    class _Loaded(_Lib):
        name, wheel, ci_step, without_init = "kit-load", "kit-load==1.0", ".ci/steps/kit.sh", ("kit_load.inner",)
        modules, heavy = ("kit_load.inner.core", "kit_load.inner.core:VALUE"), ("kit_load_heavy",)

    try:
        core, value = _Loaded().load()
        assert value == 3 and core.VALUE == 3 and isinstance(sys.modules["kit_load_heavy"], StrictModule)
        assert _Loaded().load()[0] is core  # imported once
        with pytest.raises(ImportError, match=r"--engine kit-load needs kit-load==1\.0 \(\.ci/steps/kit\.sh\): .*NOPE"):
            import_library("kit-load", ("kit_load.inner.core:NOPE",), (), wheel="kit-load==1.0",
                           ci_step=".ci/steps/kit.sh", without=("kit_load.inner",))
        with pytest.raises(ImportError, match=r"--engine kit-absent needs kit-absent==2 \(step\)"):
            import_library("kit-absent", ("kit_absent.core",), (), wheel="kit-absent==2", ci_step="step")
    finally:
        for name in names:
            sys.modules.pop(name, None)


def test_rows_view_and_in_logits_dtype() -> None:
    ids, mask = torch.tensor([[5, 6, 7], [8, 9, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    view = rows_view({"input_ids": ids, "position_ids": None, "attention_mask": mask},
                     {"sequences": ids, "attention_mask": mask})
    assert view.labels.tolist() == [6, 7, 5, 9, 0] and view.input_ids is ids
    assert in_logits_dtype("log_probs", EngineCase((2,), (1,), logits_dtype="bfloat16")) == Precision("bfloat16", "bfloat16")


def test_sequences_from_response_rows() -> None:
    mb = seed_batch()  # responses of 2 and 1 tokens: scored at positions 2, 3 and 1 of sequences of 5 and 3
    rows = {"log_probs": torch.tensor([[1.0, 2.0], [3.0, 0.0]]), "entropy": None}
    for right_aligned, given in ((False, rows["log_probs"]), (True, torch.tensor([[1.0, 2.0], [0.0, 3.0]]))):
        out = sequences_from_response_rows({**rows, "log_probs": given}, mb, right_aligned=right_aligned)
        assert set(out) == {"log_probs"}
        first, second = out["log_probs"].unbind()
        assert first[2:4].tolist() == [1.0, 2.0] and second[1].item() == 3.0


# -- records that match on structured fields ------------------------------------------------------------------------

def _value_failure() -> AssertionError:
    """A real failure of INV-VAL-001 (log-probs at T instead of the oracle's), as the runner sees it."""
    case = EngineCase(prompt_lens=(2, 3), response_lens=(2, 2), vocab=5, temperature=0.5, seed=1)
    engine = AttributedEngine(load_engine("planted:double_temperature"))
    with pytest.raises(AssertionError) as caught:
        CATALOGUE["INV-VAL-001"].check(Ctx(engine, case, "cpu", case.mode))
    return caught.value


def test_a_value_failure_carries_its_key_and_place() -> None:
    facts = _value_failure().facts
    assert facts["key"] == "log_probs" and isinstance(facts["sequence"], int) and isinstance(facts["position"], int)


def test_records_match_on_structured_fields() -> None:
    exc = _value_failure()
    case = EngineCase(prompt_lens=(2, 3), response_lens=(2, 2), vocab=5, temperature=0.5, seed=1)
    seq, pos = exc.facts["sequence"], exc.facts["position"]
    assert KnownFailure("INV-VAL-001", "r", output="log_probs").excuses(case, exc)
    assert not KnownFailure("INV-VAL-001", "r", output="entropy").excuses(case, exc)
    at = Where("that token", lambda c, s, p: (s, p) == (seq, pos))
    elsewhere = Where("another token", lambda c, s, p: (s, p) != (seq, pos))
    assert KnownFailure("INV-VAL-001", "r", output="log_probs", position=at).excuses(case, exc)
    assert not KnownFailure("INV-VAL-001", "r", output="log_probs", position=elsewhere).excuses(case, exc)
    # a mechanism is the bound it names at 1x: a failure that measured no such bound is not excused
    record = KnownFailure("INV-VAL-001", "r", output="log_probs", mechanism="bfloat16_rounding")
    assert record.bound == ("bfloat16_rounding", 1.0) and not record.excuses(case, exc)
    exc.bounds = {"bfloat16_rounding": 0.5}
    assert record.excuses(case, exc)
    assert "on 'log_probs'" in record.describe()
    plain = AssertionError("no facts")  # a failure without facts matches no structured record
    assert not KnownFailure("INV-VAL-001", "r", output="log_probs").excuses(case, plain)
