"""The regimes a trainer runs the preparation in are drawn, honoured and reach every engine: the autograd
context (grad, no_grad, inference_mode)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings, strategies as st

import impl
from spec.cases import CONTEXTS, EngineCase
from spec.cases.strategies import engine_cases, within_limits
from spec.engines.impl.adapter import ImplEngine
from spec.execute.harness import execute
from spec.execute.ranks import unavailable


class _Seen(impl.LMHeadEngine):
    """impl, recording the autograd state of each call and whether the logits it was handed require grad."""

    log: list = []

    def prepare_model_inputs(self, micro_batch):
        self.log.append(("inputs", torch.is_grad_enabled(), torch.is_inference_mode_enabled(), None))
        return super().prepare_model_inputs(micro_batch)

    def prepare_model_outputs(self, output, oa, mb, logits_processor_func=None, **kw):
        self.log.append(("outputs", torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
                         output.logits.requires_grad))
        return super().prepare_model_outputs(output, oa, mb, logits_processor_func, **kw)


class _SeenEngine(ImplEngine):
    name = "seen"
    engine_classes = {"lm": _Seen, "value": impl.ValueHeadEngine}


WANT = {"grad": (True, False, True), "no_grad": (False, False, False), "inference_mode": (False, True, False)}


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("sp", [1, 2])
def test_harness_runs_the_engine_in_the_case_context(context, sp) -> None:
    _Seen.log = []
    case = EngineCase((3, 2), (2, 1), vocab=8, temperature=0.5, sp_size=sp, context=context)
    run = execute(_SeenEngine(), case)
    grad, inference, logits_grad = WANT[context]
    assert {(g, i) for _, g, i, _ in _Seen.log} == {(grad, inference)}, _Seen.log
    assert {r for what, _, _, r in _Seen.log if what == "outputs"} == {logits_grad}
    assert run.outputs["log_probs"].requires_grad is logits_grad
    # outside the context again: what the invariants compare with is readable
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()


@pytest.mark.skipif(unavailable("cpu", 2) is not None, reason="no real ranks here")
def test_real_ranks_run_the_engine_in_the_case_context() -> None:
    from spec.planted import planted_engine

    engine = planted_engine("inplace_div_without_grad")  # divides the logits in place only without grad
    for context, changed in (("grad", False), ("no_grad", True), ("inference_mode", True)):
        run = execute(engine, EngineCase((3, 2), (2, 1), vocab=8, temperature=0.5, sp_size=2, context=context))
        same = all(torch.equal(out.logits.nan_to_num(), snap["logits"].nan_to_num())
                   for out, snap in zip(run.model_outputs, run.model_output_snapshots))
        assert same is not changed, context


def test_repr_names_the_context_only_when_not_grad() -> None:
    case = EngineCase((1,), (1,))
    assert "grad" not in repr(case)
    assert repr(case.with_(context="no_grad")).endswith("no_grad seed=0)")
    assert "inference_mode" in repr(case.with_(context="inference_mode"))
    with pytest.raises(ValueError, match="context"):
        case.with_(context="eval")


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_every_context_is_drawn(data) -> None:
    # every context reachable (a single draw can be any of them) and within_limits agrees with the strategy
    case = data.draw(engine_cases(allow_large=False))
    assert case.context in CONTEXTS
    assert within_limits(case) and not within_limits(case, contexts=tuple(c for c in CONTEXTS if c != case.context))


def test_contexts_shrink_to_grad() -> None:
    from spec.planted import planted_engine

    space = planted_engine("vocab_chunked_logsumexp").config_space()
    seen = []

    @settings(max_examples=20, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(engine_cases(allow_large=False, config_space=space))
    def always_fails(case):
        seen.append(case)
        raise AssertionError("shrink me")

    with pytest.raises(AssertionError):
        always_fails()
    assert seen[-1].context == "grad"  # the replayed minimal example


# -- the engine's own configuration, declared precision, no region left out, coverage ----------------------------

from spec.cases.coverage import DIMENSIONS, EXCLUDED_PAIRS, FEATURES, PAIRS, dimensions, domains  # noqa: E402
from spec.invariants import CATALOGUE  # noqa: E402
from spec.run.registry import ENGINES  # noqa: E402
from spec.run.runner import run_invariant  # noqa: E402

from spec.cases.structure import LOGITS_DTYPES  # noqa: E402

def _engines():
    for name, (build, _) in ENGINES.items():
        try:
            yield name, build()
        except ImportError:  # verl's engines need verl installed (the verl venv runs them)
            continue


@pytest.mark.parametrize("name", list(ENGINES))
def test_strategy_limits_leave_no_dtype_context_or_configuration_out(name) -> None:
    engine = dict(_engines()).get(name)
    if engine is None:
        pytest.skip(f"{name} cannot be built here")
    limits = engine.strategy_limits()
    assert "contexts" not in limits and "config_space" not in limits, (name, limits)
    dtypes = tuple(limits.get("logits_dtypes", LOGITS_DTYPES))
    assert dtypes == LOGITS_DTYPES, f"{name}'s strategy_limits exclude logits dtypes: {limits}"


def _strategies(engine):
    """The strategy of every engine invariant of the catalogue for ``engine``, per mode it runs in, with how many
    of its own examples to draw (more for the real-rank ones: four SP group layouts among their draws)."""
    return [(info.cases(mode, engine), 100 if "real_ranks" in info.needs else 12) for info in CATALOGUE.values()
            if info.kind in ("batch", "microbatch") for mode in info.modes
            if mode in ("packed", "padded", "any", "both")]


class _AllSeen(Exception):
    """Every value sought was drawn: the longer look stops."""


#: the reachability test's hypothesis seed: its draws follow from this and the strategies, never from the test's
#: source text (``derandomize`` hashes the function's source, so an edit to the test body used to move its draws)
REACH_SEED = 20261205


def _draw_all(strategy, examples: int, note) -> None:
    """``note(case)`` on ``examples`` cases of ``strategy``, drawn from :data:`REACH_SEED`; ``note`` may end the look
    early by raising :class:`_AllSeen` (anything else it raises fails the draw, shrunk by hypothesis)."""
    @seed(REACH_SEED)
    @settings(max_examples=examples, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def draw(case):
        note(case)

    try:
        draw()
    except _AllSeen:
        pass


@pytest.mark.parametrize("name", ["impl", "verl", "planted:vocab_chunked_logsumexp"])
def test_every_dimension_value_is_reachable_or_has_a_reason(name) -> None:
    from spec.run.registry import load_engine

    try:
        engine = load_engine(name)
    except ImportError:
        pytest.skip(f"{name} needs verl")
    space, seen, excluded = tuple(engine.config_space()), set(), set()
    wanted = {(dim, value) for dim, values in domains(engine).items() for value, reason in values.items()
              if reason is None}

    def note(case, stop_when_all_seen: bool = False) -> None:
        seen.update(dimensions(case, space))
        if isinstance(case, EngineCase):
            has = {f for f, (present, _) in FEATURES.items() if present(case)}
            excluded.update(" x ".join(sorted(pair)) for pair in EXCLUDED_PAIRS if pair <= has)
        if stop_when_all_seen and not wanted - seen:
            raise _AllSeen

    strategies = _strategies(engine)
    union = st.one_of([s for s, _ in strategies])
    # the union (what any invariant may draw) and a few of each invariant's own (a value only one invariant
    # draws, e.g. the value head's, is not left to the union's luck)
    for strategy, examples in ((union, 800), *strategies):
        _draw_all(strategy, examples, note)
    # a rare pair (two features of a few % each) the first draws missed: a longer look, each invariant's own (a pair
    # only a few invariants draw, e.g. the value head's long rows), then the union's, until every value is seen
    for strategy, examples in (*((s, 60) for s, _ in strategies), (union, 1500)):
        if not wanted - seen:
            break
        _draw_all(strategy, examples, lambda case: note(case, stop_when_all_seen=True))
    unseen = [f"{dim} = {value}" for dim, value in sorted(wanted - seen)]
    assert not unseen, f"{name}: values no drawn case reaches and no reason declared: {unseen}"
    # a pair the coverage leaves out as never combined must really never be drawn
    assert not excluded, f"{name}: pairs declared never combined (EXCLUDED_PAIRS) were drawn: {sorted(excluded)}"


def test_config_switch_values_reach_the_engine() -> None:
    from spec.planted import planted_engine

    engine = planted_engine("vocab_chunked_logsumexp")
    case = EngineCase((3, 2), (2, 1), vocab=16, engine_config=(("vocab_chunk", 4),))
    assert "vocab_chunk=4" in repr(case)
    assert dimensions(case, engine.config_space())[-1] == ("engine config: vocab_chunk", "4")
    run = execute(engine, case)
    plain = execute(engine, case.with_(engine_config=()))
    assert not torch.equal(run.outputs["log_probs"].values(), plain.outputs["log_probs"].values())


def test_the_runner_counts_every_example_on_every_dimension() -> None:
    outcome = run_invariant(CATALOGUE["INV-LAYOUT-001"], ImplEngine(), "packed", "cpu", profile="ci",
                            max_examples=8, database=None)
    for dim in DIMENSIONS:
        if dim != "temperature":
            assert sum(outcome.coverage[dim].values()) == outcome.examples, (dim, outcome.coverage[dim])
    assert set(outcome.coverage["layout"]) == {"packed"}


def test_verl_declares_low_precision_per_key_and_path() -> None:
    pytest.importorskip("verl")
    from spec.engines.verl.adapter import VerlEngine
    from spec.protocol import Precision

    verl = VerlEngine()
    bf16 = EngineCase((3, 2), (2, 1), logits_dtype="bfloat16", calculate_entropy=True)
    assert verl.precision("log_probs", bf16) == Precision("bfloat16", "bfloat16")
    assert verl.precision("entropy", bf16.with_(entropy_chunk_size=2)) == Precision("float32", "bfloat16")
    assert verl.precision("entropy", bf16.with_(use_remove_padding=False, entropy_chunk_size=2)) == \
        Precision("bfloat16", "bfloat16")
    assert verl.precision("log_probs", bf16.with_(use_fused_kernels=True)) == Precision()
    assert verl.precision("log_probs", bf16.with_(logits_dtype="float32")) == Precision()


@pytest.mark.parametrize("name", ["verl-torchtitan", "verl-automodel"])
def test_native_verl_engines_return_the_dtype_they_declare_on_every_path(name) -> None:
    """TorchTitan and Automodel declare per key and path what dtype they return (no dtype limit): each declaration
    is the dtype verl's own prepare_model_outputs returns, bf16/fp16 logits, packed and padded, chunked entropy,
    a (B,) tensor temperature, fused kernels where offered."""
    pytest.importorskip("verl")
    from spec.run.registry import load_engine

    engine = load_engine(name)
    variants = [{}, {"entropy_chunk_size": 2}, {"prompt_lens": (3,), "response_lens": (2,), "temperature": (0.5,)}]
    if engine.lacks("fused") is None:
        variants.append({"use_fused_kernels": True})
    seen = set()
    for dtype in ("bfloat16", "float16"):
        for packed in (True, False):
            for variant in variants:
                case = EngineCase(**{"prompt_lens": (3, 2), "response_lens": (2, 1), **variant},
                                  use_remove_padding=packed, calculate_entropy=True, logits_dtype=dtype)
                for key, value in execute(engine, case).outputs.items():
                    got = (value.values() if value.is_nested else value).dtype
                    assert str(got) == f"torch.{engine.precision(key, case).returns}", (case, key, got)
                    seen.add(str(got))
    assert {"torch.float32", "torch.bfloat16", "torch.float16"} <= seen, seen  # both declarations are exercised


# -- the micro-batch layer in the case's context ------------------------------------------------------------------

@pytest.mark.parametrize("context", CONTEXTS)
def test_micro_batch_layer_runs_in_the_case_context(context) -> None:
    from types import SimpleNamespace

    from spec.cases.microbatch import MiniBatchCase, materialize_minibatch
    from spec.invariants.microbatch import layer

    seen = []
    raw = ImplEngine().microbatch_layer()
    prepare = raw.get("prepare_micro_batches")

    def recording(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return prepare(*args, **kwargs)

    class _Engine:
        def microbatch_layer(self):
            return raw.with_functions("recording", prepare_micro_batches=recording)

    case = MiniBatchCase((3, 2), (2, 1), max_token_len=5, context=context)
    data = materialize_minibatch(case, "cpu")
    layer(SimpleNamespace(engine=_Engine(), case=case)).get("prepare_micro_batches")(data)
    assert seen == [WANT[context][:2]]
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    assert (context in repr(case)) is (context != "grad")


def test_micro_batch_cases_draw_every_context_and_shrink_to_grad() -> None:
    from spec.cases.microbatch import minibatch_cases

    seen = set()
    _draw_all(minibatch_cases(), 60, lambda case: seen.add(case.context))
    assert seen == set(CONTEXTS)
    shrunk = []

    def always_fails(case):
        shrunk.append(case)
        raise AssertionError("shrink me")

    with pytest.raises(AssertionError):
        _draw_all(minibatch_cases(), 20, always_fails)
    assert shrunk[-1].context == "grad"


def test_feature_pairs_are_the_allowed_pairs_of_the_features() -> None:
    names = list(FEATURES)
    assert all(len(pair) == 2 and pair <= set(names) for pair in EXCLUDED_PAIRS), EXCLUDED_PAIRS
    assert len(PAIRS) == len(names) * (len(names) - 1) // 2 - len(EXCLUDED_PAIRS)
    case = EngineCase((3, 2), (2, 1), vocab=16, sp_size=2, head="value", context="no_grad")
    pairs = {v for d, v in dimensions(case) if d == "feature pair"}
    assert {"packed x value head", "packed x sp", "value head x sp", "sp x no grad", "value head x no grad"} <= pairs
    assert not any("padded" in p or "entropy" in p for p in pairs)
