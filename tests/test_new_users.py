"""The eleven things new users fought adapting two frameworks from the guide (a false alarm, stubs without values, the
stub scanner, records matching nothing, passes with no example, a missing dependency, no position_ids, entropy as a
metric, gaps in the guide, fused heads, an excused failure hiding another), each pinned.

The engines are tests/new_user_engines.py (impl changed the way a third party differs); most tests run one check on
pinned cases as the runner would (``check``), a few run the runner on one target with a handful of examples.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from spec.cases import EngineCase
from spec.engines.kit import stubs
from spec.engines.kit import HiddenStatesModel, ThirdPartyEngine, import_library
from spec.execute.attribution import AttributedEngine, EngineFault
from spec.invariants import CATALOGUE, Ctx
from spec.invariants import core
from spec.planted import PLANTED
from spec.protocol import EngineProfile, KnownFailure
from spec.report import summary_line
from spec.run.registry import UnknownName, load_engine
from spec.run import runner
from spec.run.runner import run_invariant

ROOT = Path(__file__).resolve().parents[1]
ENGINES = "tests.new_user_engines"
PADDED = EngineCase(prompt_lens=(2, 1), response_lens=(1, 3), vocab=7, calculate_entropy=True, seed=3,
                    use_remove_padding=False)


def engine(name: str):
    return load_engine(f"{ENGINES}:{name}")


def check(eng, invariant: str, case: EngineCase) -> None:
    """One invariant's check on ``case`` as the runner runs it (its adjust, then the engine's)."""
    info = CATALOGUE[invariant]
    case = core.honour_engine(info.adjust(case) if info.adjust else case, eng)
    mode = case.mode if set(info.modes) & {"packed", "padded"} else info.modes[0]
    info.check(Ctx(AttributedEngine(eng), case, "cpu", mode))


def failure(eng, invariant: str, case: EngineCase) -> AssertionError:
    with pytest.raises(AssertionError) as caught:
        check(eng, invariant, case)
    return caught.value


# -- 1: a 0/1 float 2-D mask is a mask ----------------------------------------------------------------------------

def test_a_float_01_mask_is_no_false_alarm() -> None:
    check(engine("FloatMask"), "INV-MASK-002", PADDED)
    check(engine("FloatMask"), "INV-MASK-001", PADDED)


def test_a_float_mask_a_model_reads_wrongly_still_fails() -> None:
    exc = failure(engine("AdditiveBiasMask"), "INV-MASK-002", PADDED)
    assert "-inf" in str(exc) and exc.facts["key"] == "attention_mask"
    assert "INT32" in str(failure(load_engine("planted:mask_as_bool"), "INV-MASK-002", PADDED)).upper()


# -- 2: stubs with well-known values, and load() giving a stub a value -------------------------------------------

@pytest.fixture
def newlib(tmp_path, monkeypatch):
    """A library that uses names of packages not installed here at import time."""
    root = tmp_path / "newlib"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "trainer.py").write_text(textwrap.dedent("""
        import numba
        import ray
        import uvloop
        from absent_transformers.utils import is_torch_npu_available
        from absent_vendor import CHUNK

        uvloop.install()
        COMPILED = not is_torch_npu_available()  # an NPU check: must be False here, never truthy


        @numba.njit
        def double(x):
            return 2 * x


        @numba.njit(cache=True)
        def triple(x):
            return 3 * x


        @ray.remote
        class Worker:
            pass


        def chunk():
            return CHUNK
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "newlib.trainer"
    for name in [k for k in sys.modules if k.split(".")[0] in ("newlib", "numba", "ray", "uvloop",
                                                               "absent_transformers", "absent_vendor")]:
        sys.modules.pop(name)
    import_library.cache_clear()


class _NewLib(ThirdPartyEngine):
    name, library, wheel, ci_step = "newlib", "newlib", "newlib==1.0", "(none)"
    modules = ("newlib.trainer",)
    heavy = ("numba", "ray", "uvloop", "absent_transformers", "absent_vendor")
    stub_values = {"absent_vendor": {"CHUNK": 64}}


def test_load_gives_well_known_and_declared_values(newlib) -> None:
    (trainer,) = _NewLib().load()
    assert trainer.COMPILED is True  # is_torch_npu_available() answered False
    assert trainer.double(2) == 4 and trainer.triple(2) == 6 and isinstance(trainer.Worker, type)
    assert trainer.chunk() == 64  # declared once, on the class, through load()


def test_a_name_nobody_declared_still_raises(newlib) -> None:
    (trainer,) = _NewLib().load()
    with pytest.raises(stubs.StubError, match="numba.cuda"):
        sys.modules["numba"].cuda.jit(lambda: None)  # not well known: a CUDA kernel is no plain function
    stub = stubs.strict_module("absent_gpu_lib")
    assert stub.is_available_gpu is not None  # reading is allowed
    with pytest.raises(stubs.StubError):
        bool(stub.is_available_gpu)
    with stubs.GatheredParameters([torch.ones(1)]) as params:  # deepspeed's gather where nothing is partitioned
        assert params[0].shape == (1,)


# -- 3: the scanner follows imports across packages, and relative imports of a package's __init__ ---------------

def test_scanner_follows_other_packages_and_init_relative_imports(tmp_path, monkeypatch) -> None:
    files = {
        "pkga/__init__.py": "",
        "pkga/sub/__init__.py": "from .helpers import x\n",  # relative in an __init__: pkga.sub.helpers
        "pkga/sub/helpers.py": "import heavy_one\nx = 1\n",
        "pkga/sub/mod.py": "from pkga.other import y\nfrom pkgb import util\n",  # another package, another project
        "pkga/other.py": "import heavy_two\ny = 2\n",
        "pkga/helpers.py": "import not_this_one\n",  # what a one-level-too-high resolution would read
        "pkgb/__init__.py": "",
        "pkgb/util.py": "from heavy_three.deep import thing\n",
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = stubs.module_level_imports("pkga.sub.mod", ("heavy_one", "heavy_two", "heavy_three", "not_this_one"))
    assert set(found) == {"heavy_one", "heavy_two", "heavy_three.deep"}


# -- 4: records match facts the checks carry, and one that never could is an error --------------------------------

def test_consumer_view_and_grad_failures_carry_their_facts() -> None:
    exc = failure(load_engine("planted:loss_mask_attention"), "INV-SLICE-006", PADDED)
    assert exc.facts["key"] == "log_probs" and isinstance(exc.facts["position"], int)
    case = EngineCase(prompt_lens=(2,), response_lens=(2,), vocab=5, calculate_entropy=True)
    exc = failure(load_engine("planted:entropy_detached_with_grad"), "INV-GRAD-001", case)
    assert exc.facts["key"] == "entropy"
    assert KnownFailure("INV-GRAD-001", "r", output="entropy").excuses(case, exc)


@pytest.mark.parametrize("name, says", [("UnmatchableRecord", "output="), ("MisspeltRecord", "no invariant")])
def test_a_record_that_can_never_match_is_an_error(name, says) -> None:
    with pytest.raises(UnknownName, match=says):
        engine(name)


# -- 5: a check that ran no example exercising it is not exercised, never a pass ----------------------------------

def test_zero_exercised_is_not_a_pass() -> None:
    outcome = run_invariant(CATALOGUE["INV-FLAG-004"], engine("NoRefusals"), "packed", profile="dev", max_examples=2)
    assert outcome.status == "unexercised" and outcome.exercised == 0
    assert "declares no unsupported setting" in outcome.reason
    assert "1 not exercised" in summary_line([outcome]) and "0 passed" in summary_line([outcome])


def test_value_head_refusals_skip_an_engine_without_a_value_head() -> None:
    assert "value" in CATALOGUE["INV-FLAG-005"].needs


# -- 6: a missing dependency is the environment's, never the engine's failure -------------------------------------

def test_a_missing_module_is_an_environment_error() -> None:
    outcome = run_invariant(CATALOGUE["INV-VAL-001"], engine("MissingDependency"), "packed", profile="dev",
                            max_examples=2)
    assert outcome.status == "error" and outcome.blame == "environment", (outcome.status, outcome.error)
    assert "tyro_not_installed_here" in outcome.error and "pip install" in outcome.error
    assert "engine raised" not in outcome.error


# -- 7: an engine that hands the model no position_ids -------------------------------------------------------------

@pytest.mark.parametrize("invariant", ["INV-POS-001", "INV-VAL-001", "INV-VAL-002", "INV-MASK-001", "INV-LEAK-001"])
def test_no_position_ids_declared_passes(invariant) -> None:
    check(engine("NoPositionIds"), invariant, PADDED)


def test_no_position_ids_undeclared_fails() -> None:
    assert "model_computes_positions" in str(failure(engine("NoPositionIdsUndeclared"), "INV-POS-001", PADDED))


def test_a_packed_row_needs_its_positions() -> None:
    with pytest.raises(ValueError, match="padded batch only"):
        EngineProfile(model_computes_positions=True)


# -- 8: entropy as a metric only ---------------------------------------------------------------------------------

GRAD = EngineCase(prompt_lens=(2, 1), response_lens=(2, 2), vocab=5, calculate_entropy=True, seed=2)


def test_entropy_as_a_metric_is_declared_and_checked() -> None:
    check(engine("EntropyAsMetric"), "INV-GRAD-001", GRAD)
    check(engine("EntropyAsMetric"), "INV-VAL-002", GRAD)  # its values are still the entropy's
    assert "metric only" in str(failure(engine("EntropyMetricWithGrad"), "INV-GRAD-001", GRAD))
    assert "metrics" in str(failure(load_engine("planted:entropy_detached_with_grad"), "INV-GRAD-001", GRAD))


# -- 9: the guide's profile section and the micro-batch layer ----------------------------------------------------

def test_the_guide_covers_every_profile_field_and_the_micro_batch_layer() -> None:
    guide = (ROOT / "docs" / "writing-an-adapter.md").read_text()
    profile = guide[guide.index("## The profile"):guide.index("## The kit")]
    for field in EngineProfile.__dataclass_fields__:
        assert f"`{field}`" in profile, field
    assert "## The micro-batch layer" in guide and "microbatch_layer" in guide


# -- 10: a fused head that reads model.model.lm_head.weight inside a gather context ---------------------------------

def test_fused_head_finds_the_weight_where_such_heads_look() -> None:
    hidden, weight = torch.randn(1, 3, 8), torch.randn(5, 8)
    model = HiddenStatesModel(hidden, weight)
    with stubs.GatheredParameters([model.model.lm_head.weight], modifier_rank=None):
        got = model.model.lm_head.weight
    assert got is weight and model.lm_head.weight is weight and model.get_output_embeddings().weight is weight
    assert model.model(input_ids=None).last_hidden_state is hidden
    assert model.base_model().last_hidden_state is hidden
    assert torch.allclose(model.model.lm_head(hidden), hidden @ weight.T)


# -- 11: an excused failure never hides another ---------------------------------------------------------------------

CHUNKED_BF16 = EngineCase(prompt_lens=(2, 2), response_lens=(2, 1), vocab=6, calculate_entropy=True,
                          logits_dtype="bfloat16", entropy_chunk_size=2)


def test_every_failing_fact_is_reported_and_excused_only_by_name() -> None:
    eng = load_engine("planted:entropy_rounded_behind_log_probs")
    exc = failure(eng, "INV-DEV-001", CHUNKED_BF16)
    assert [part.facts["key"] for part in exc.parts] == ["log_probs", "entropy"]
    outcome = run_invariant(CATALOGUE["INV-DEV-001"], eng, "packed", profile="dev", max_examples=1,
                            also=(CHUNKED_BF16,))
    assert outcome.status == "fail" and "'entropy'" in outcome.error and "'log_probs'" not in outcome.error


def test_the_held_out_bug_class_is_planted() -> None:
    assert PLANTED["entropy_rounded_behind_log_probs"].caught_by == ("INV-DEV-001",)


def test_a_fault_among_several_facts_is_still_the_engines_fault() -> None:
    exc = core.Failures([AssertionError("output 'entropy' differs"), EngineFault("rank 1: values short")])
    assert runner._blame(exc, "fail") == "engine fault"  # a malformed output, even beside another fact
