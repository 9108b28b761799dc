"""The invariant record, its registry, and the context a check runs in."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any, Callable, Iterator

import torch
from hypothesis import strategies as st

from ..cases.structure import DenseCase, EngineCase
from ..protocol.engine import CONTRACT_PRECISION, EngineUnderTest, OutputSpan, Precision
from ..protocol.profile import AUTOCAST_DTYPES, ROUTES_SWITCH, Convention, EngineProfile, profile_of, routes_dtype
from ..execute.harness import Run, execute, model_for
from ..execute.attribution import origin
from ..protocol.errors import Failures
from ..execute.memo import Runs
from ..cases.materialize import draws, materialize
from ..truth.oracle import Expected, expected, unit_roundoff
from ..truth.closeness import ATOL, close
from ..truth.failing import add_facts, fail
from ..truth.outputs_checks import locate as _locate
from ..truth.outputs_checks import oracle_values, per_seq
from ..truth.outputs_checks import sequences as _sequences
from ..truth.rules import read_positions, shared_temperature
from ..truth.state_checks import held, same
from ..cases.strategies import dense_cases, engine_cases, profile_draws
from .reproduction import LayerCheck, Plan

__all__ = ["InvariantInfo", "CATALOGUE", "invariant", "Ctx", "close", "close_sequence", "per_seq", "fail",
           "match_oracle", "match_runs", "held", "same", "measure_bounds", "honour_engine",
           "shares_one_temperature", "read", "convention_promised", "convention_skip", "add_facts", "mode_reason",
           "within_profile", "in_context", "Failures", "EveryFailure", "VALUE_FACTS"]

#: the facts a value check's failure carries (:func:`match_oracle`, :func:`match_runs`): the output key, the
#: sequence and token position, the error against each precision mechanism's bound
VALUE_FACTS = ("key", "position", "bounds")

@dataclass(frozen=True)
class InvariantInfo:
    """One rule of the contract: a stable ID, what it covers, and a check.

    ``modes``: the padding modes it is instantiated for (``packed``, ``padded``), or
    ``("both",)`` for a check that compares the modes, or ``("any",)`` when the mode
    does not matter. ``needs``: engine features or helpers it requires; an engine
    lacking one gets the invariant skipped with the reason.

    ``protects``: one line, the consumer-visible behaviour the invariant protects (what a
    trainer reading the outputs would get wrong if it failed). ``layout``: True for a check
    of a layout convention the contract leaves open (verl's private choices): it runs in the
    separately reported *layout profile* and never counts towards the conformance verdict.
    ``convention``: the :class:`~spec.protocol.profile.Convention` the whole check asserts (one engine's promise
    beyond the contract, docs/contract.md "Conventions"): it runs only for an engine whose profile declares it
    and is skipped, with that reason, for any other. A check whose contract part holds for every engine and
    whose stricter part is a convention reads :meth:`Ctx.promises` instead.
    """

    id: str
    title: str
    contract: int
    check: Callable[["Ctx"], None]
    modes: tuple[str, ...] = ("packed", "padded")
    needs: tuple[str, ...] = ()
    #: engine features of which it needs at least one (it checks those the engine offers): an engine lacking every
    #: one gets it skipped with their reasons
    needs_any: tuple[str, ...] = ()
    kind: str = "batch"  # "batch": EngineCase end to end; "dense": a DenseCase for left_right_2_no_padding
    head: str = "lm"
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    adjust: Callable[[EngineCase], EngineCase] | None = None
    #: a further draw from the adjusted case (a strategy of cases: the rank invariants' process topology)
    draw_after: Callable[[EngineCase], st.SearchStrategy] | None = None
    protects: str = ""
    layout: bool = False
    convention: Convention | None = None
    #: the structured facts its failures carry (``spec.protocol.known.FACTS``: ``key``, ``position``, ``bounds``):
    #: what a known-failure record may match on beside a message pattern (a record asking another could never match,
    #: ``spec.protocol.known.unmatchable``)
    facts: tuple[str, ...] = ()
    #: how its standalone reproducer checks it (:mod:`spec.invariants.reproduction`); None: it has none
    repro: Plan | LayerCheck | None = None

    def cases(self, mode: str, engine: EngineUnderTest) -> st.SearchStrategy:
        """The cases drawn for ``engine``: what its profile accepts (modes, position kinds, execution contexts:
        :func:`~spec.cases.strategies.profile_draws`), within its strategy limits (features it lacks) and its
        configuration space, adjusted for the invariant and then to the engine (:func:`honour_engine`): the
        stream :meth:`drawn`, each case :meth:`shaped`."""
        return self.drawn(mode, engine).map(lambda case: self.shaped(case, engine))

    def drawn(self, mode: str, engine: EngineUnderTest) -> st.SearchStrategy:
        """What is drawn before this invariant's own adjustment: every target with the same :meth:`stream` key
        draws this same strategy (a further draw from the adjusted case, ``draw_after``, is part of it)."""
        profile = profile_of(engine)
        if self.kind == "dense":
            return dense_cases(**{"positions": tuple(profile.positions), **self.strategy_kwargs})
        kwargs = {"config_space": tuple(getattr(engine, "config_space", tuple)()), **profile_draws(profile),
                  **engine.strategy_limits(), **self.strategy_kwargs}
        strategy = engine_cases(mode=mode if mode in ("packed", "padded") else None, head=self.head, **kwargs)
        if self.draw_after:
            strategy = strategy.map(self.adjust) if self.adjust else strategy
            strategy = strategy.flatmap(self.draw_after)
        return strategy

    def shaped(self, case: Any, engine: EngineUnderTest) -> Any:
        """A case of :meth:`drawn` as this invariant checks it: its adjustment (unless ``draw_after`` applied it
        before the further draw), then the engine's (:func:`honour_engine`)."""
        if self.adjust and not self.draw_after:
            case = self.adjust(case)
        return honour_engine(case, engine)

    def stream(self, mode: str) -> str | None:
        """The key of the case stream this target draws (its seed and example-database key; spec/run/groups.py):
        every target whose :meth:`drawn` is the same strategy shares it, and with it each drawn case's engine run,
        where their adjustments agree. None for a subclass that draws its own kind of case (it keeps a stream of
        its own, keyed by the invariant)."""
        if type(self).cases is not InvariantInfo.cases or type(self).drawn is not InvariantInfo.drawn:
            return None
        after = "" if self.draw_after is None else "/after:" + "+".join(
            f"{fn.__module__}.{fn.__qualname__}" for fn in (self.adjust, self.draw_after) if fn is not None)
        limits = ",".join(f"{key}={value!r}" for key, value in sorted(self.strategy_kwargs.items()))
        return f"{self.kind}/{self.head}/{limits}{after}/{mode}"

    @property
    def doc(self) -> str:
        return (self.check.__doc__ or "").strip()


CATALOGUE: dict[str, InvariantInfo] = {}


def convention_promised(engine: EngineUnderTest, convention: Convention) -> bool:
    """Whether ``engine``'s profile declares ``convention`` (an engine without a profile declares none)."""
    profile = getattr(engine, "profile", None)
    return profile is not None and profile.promises(convention)


def convention_skip(info: InvariantInfo, engine: EngineUnderTest) -> str | None:
    """Why ``info`` does not run on ``engine``: it asserts a convention the engine's profile does not declare."""
    if info.convention is None or convention_promised(engine, info.convention):
        return None
    return (f"convention {info.convention.value} (docs/contract.md, Conventions): {engine.name}'s profile does not "
            "declare it, and the contract does not ask it")


def mode_reason(info: InvariantInfo, engine: EngineUnderTest, mode: str) -> str | None:
    """Why ``info``'s target in ``mode`` does not apply to ``engine``: a mode its profile does not run (a
    ``both`` target compares the two modes; an ``any`` target runs in a mode the engine has). A skip with the
    profile's reason, never the engine's failure; so is a mode an invariant on images and videos has no media in
    (the profile's ``media_modes``), or one on routed experts no routes in (``routes_modes``)."""
    if mode not in ("packed", "padded", "both"):
        return None
    profile = profile_of(engine)
    return (profile.mode_reason(mode) or (profile.media_mode_reason(mode) if {"media", "audio"} & set(info.needs)
                                          else None)
            or (profile.routes_mode_reason(mode) if {"routes", "routes_record"} & set(info.needs) else None))


def shares_one_temperature(engine: EngineUnderTest) -> bool:
    """Whether the engine takes one temperature per trainer (it lacks per-sample temperatures)."""
    return engine.lacks("per_sample_temperature") is not None


def honour_engine(case: EngineCase, engine: EngineUnderTest) -> EngineCase:
    """An adjusted case within what the engine offers where an invariant's ``adjust`` asks more than the property
    needs: an engine with one temperature per trainer gets one shared temperature (a permutation, a concatenation
    or the temperature's application hold just as well with one; the invariants that need per-sample values
    declare ``needs=("per_sample_temperature",)`` and are skipped instead); a distillation case of an engine whose
    own processor returns a fixed set of keys (:meth:`~spec.protocol.EngineUnderTest.processor_keys`) asks those."""
    case = within_profile(case, profile_of(engine))
    if isinstance(case, EngineCase) and case.per_sample_temperature and shares_one_temperature(engine):
        case = shared_temperature(case)
    if isinstance(case, EngineCase) and case.distillation_keys:
        keys = engine.processor_keys(case)  # the engine's own processor returns these whatever the case asks
        if keys is not None and tuple(keys) != case.distillation_keys:
            case = case.with_(distillation_keys=tuple(keys))
    return case


def within_profile(case: Any, profile: EngineProfile) -> Any:
    """``case`` moved into what ``profile`` accepts where an invariant's ``adjust`` or a pinned example asks what
    the engine does not take: its mode (packed-only settings dropped for the padded mode), its position kind, its
    execution context (the profile's first), media of a kind it does not take (their tokens left as text), routed
    experts beside a static bucket where the engine refuses the pair (``bucket_replay``: the bucket stays). The strategies draw nothing else (:func:`profile_draws`); a case
    already inside the profile is returned as it is."""
    mrope = getattr(case, "mrope", None)
    if mrope and isinstance(case, EngineCase) and profile.runs(case.mode) and not profile.takes(case.mode, mrope=True):
        case, mrope = case.with_(mrope=False), False
    if mrope is not None and ("mrope" if mrope else "rope") not in profile.positions:
        case = case.with_(mrope=not mrope) if isinstance(case, EngineCase) else replace(case, mrope=not mrope)
    if not isinstance(case, EngineCase):
        return case
    if case.mode not in profile.modes:
        packed = not case.use_remove_padding
        case = case.with_(use_remove_padding=packed) if packed else case.with_(
            use_remove_padding=False, sp_size=1, topology=None, pad_to_length=None, pass_cu_seqlens=False)
    if case.context not in profile.contexts:
        case = case.with_(context=profile.contexts[0])
    if "bucket_replay" in profile.refuses and case.pad_to_length and routes_dtype(case) is not None:
        # the pair the engine refuses (INV-FLAG-004 checks the refusal): the bucket a target asks for stays
        case = case.with_(engine_config=tuple((name, value) for name, value in case.engine_config
                                              if name != ROUTES_SWITCH))
    return media_within_profile(case, profile)


def media_within_profile(case: EngineCase, profile: EngineProfile) -> EngineCase:
    """``case`` without the media items of a kind ``profile`` does not list (their tokens stay, as text): an image-only
    engine gets a pinned or adjusted case's images, not its videos."""
    if any(item.kind not in profile.media for items in case.media for item in items):
        media = tuple(tuple(item for item in items if item.kind in profile.media) for items in case.media)
        case = case.with_(media=media if any(media) else ())
    return case


def invariant(id: str, title: str, *, contract: int, **kwargs: Any) -> Callable:
    """Register the decorated check in :data:`CATALOGUE` under ``id``."""
    def register(check: Callable[["Ctx"], None]) -> Callable[["Ctx"], None]:
        if id in CATALOGUE:
            raise ValueError(f"duplicate invariant id {id}")
        CATALOGUE[id] = InvariantInfo(id=id, title=title, contract=contract, check=check, **kwargs)
        return check
    return register


class Ctx:
    """What a check sees: the engine, the drawn case, the device, and lazily the run and oracle."""

    def __init__(self, engine: EngineUnderTest, case: EngineCase | DenseCase, device: str, mode: str,
                 runs: Runs | None = None):
        self.engine, self.case, self.device, self.mode = engine, case, device, mode
        #: the example's engine runs (:class:`~spec.execute.memo.Runs`): shared by every check of one drawn example
        #: in a stream, so a run two checks ask alike (this case, or a rerun of a variant) is made once
        self.runs = runs if runs is not None else Runs()
        #: set by :meth:`not_exercised`: this example did not exercise the property (the runner counts it)
        self.vacuous: str | None = None

    def promises(self, convention: Convention) -> bool:
        """Whether the engine's profile declares ``convention`` (its stricter part is then asserted too)."""
        return convention_promised(self.engine, convention)

    def not_exercised(self, reason: str) -> None:
        """Record that this example could not exercise the property (e.g. nothing to poison).

        Invariants force their preconditions in ``adjust`` so this stays rare; the runner
        reports examples run vs exercised, and a test fails below 90% exercised."""
        self.vacuous = reason

    @cached_property
    def run(self) -> Run:
        return self.runs.execute(self.engine, self.case, self.device)

    @cached_property
    def inputs_run(self) -> Run:
        """Only prepare_model_inputs (what input invariants look at): a later failure cannot mask theirs (a whole
        run of the case, where one was made, answers it)."""
        if "run" in self.__dict__:
            return self.run
        return self.runs.execute(self.engine, self.case, self.device, stop_after_inputs=True)

    @cached_property
    def batch(self):
        """The micro-batch alone (for helper invariants that need no engine run)."""
        return materialize(self.case, self.device)

    @cached_property
    def read(self) -> list[torch.Tensor]:
        """Per sequence, the positions of a per-token output the contract checks (:func:`spec.truth.rules.read_positions`
        for the engine's declared output span): never a sequence's last token, which no consumer reads."""
        span_of = getattr(self.engine, "output_span_of", None)  # the engine's span on this case (its switches)
        span = span_of(self.case) if span_of is not None else getattr(self.engine, "output_span", OutputSpan.SEQUENCE)
        return read_positions(self.case.prompt_lens, self.case.response_lens, span)

    @cached_property
    def expected(self) -> Expected:
        """The oracle, from the case's own draws (an engine that mutates its input cannot move the
        expectation) and a CPU model (the engine's head input: logits, or the fused head's exact product);
        no engine run needed."""
        return self.runs.oracle(self.case, self.engine,
                                lambda: expected(self.case, model_for(self.case, "cpu", self.engine), draws(self.case)))

    def oracle(self, key: str, case: EngineCase | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Output ``key``'s per-sequence expectation and tolerance at the precision the engine declares for it on
        ``case``'s path (default: this case): the oracle's rule (:meth:`spec.truth.oracle.Expected.at_precision`)."""
        declared = getattr(self.engine, "precision", None)
        case = case or self.case
        precision = declared(key, case) if declared is not None else None
        precision = in_context(precision, key, getattr(case, "context", "grad"), self.expected)
        if precision is None:
            return self.expected.of(key), self.expected.tolerance[key]
        return self.expected.at_precision(key, precision.returns, precision.scaled_in)

    def rerun(self, case: EngineCase | None = None, **kwargs: Any) -> Run:
        """The engine on ``case`` (default this one) with :func:`~spec.execute.harness.execute`'s ``kwargs``: a plain
        call (a poison, inputs only) is read from the example's :attr:`runs` where another check made it; one with a
        micro-batch or engine objects of its own always runs."""
        if set(kwargs) <= {"poison", "stop_after_inputs"}:
            return self.runs.execute(self.engine, case or self.case, self.device, **kwargs)
        return execute(self.engine, case or self.case, self.device, **kwargs)

    def helper(self, name: str) -> Callable:
        fn = self.engine.helper(name)
        if fn is None:  # guarded by `needs`; reaching here is a suite bug
            raise RuntimeError(f"engine {self.engine.name} has no helper {name}")
        return fn


def in_context(precision: Precision | None, key: str, context: str, exp: Expected) -> Precision | None:
    """The precision output ``key`` is judged at in execution ``context``: under a caller's autocast
    (:data:`~spec.protocol.profile.AUTOCAST_DTYPES`) the engine's lower-precision ops (a matmul: a fused head's
    logits) compute in the autocast's dtype, so every key computed from the scaled logits (those the oracle gives a
    condition: log_probs, entropy, sum_pi_squared, the distillation terms) is judged with the scaled logits in it
    (the coarser of it and the declared ``scaled_in``); the dtype an output is returned in stays the declared one
    (INV-DEV-001 holds outputs to float32 under autocast too). Outside an autocast: ``precision`` as it is."""
    dtype = AUTOCAST_DTYPES.get(context)
    if dtype is None or key == "values" or key not in exp.condition:  # a value head's values: no logits
        return precision
    precision = precision or CONTRACT_PRECISION
    coarser = max((precision.scaled_in, dtype), key=unit_roundoff)
    return Precision(returns=precision.returns, scaled_in=coarser)


class EveryFailure:
    """Collects the failing facts of one example, so a check reports each (every output's dtype, every key of two
    runs), not only the first: ``with facts.each(): ...`` per fact, then :meth:`raise_any`. Only a check's own
    assertion is collected; anything else (an engine's exception) propagates at once."""

    def __init__(self) -> None:
        self.parts: list[AssertionError] = []

    @contextmanager
    def each(self) -> Iterator[None]:
        try:
            yield
        except Failures as exc:
            self.parts += exc.parts
        except AssertionError as exc:
            if origin(exc) is not None:  # the engine's own assert (or the suite's): not a check's fact
                raise
            self.parts.append(exc)

    def raise_any(self) -> None:
        if len(self.parts) == 1:
            raise self.parts[0]
        if self.parts:
            raise Failures(list(self.parts))


def read(ctx: "Ctx", i: int, values: torch.Tensor) -> torch.Tensor:
    """Sequence ``i``'s values of a per-token output (or its expectation/tolerance) at the positions a consumer reads."""
    return values[ctx.read[i]]


def close_sequence(key: str, actual: torch.Tensor, want: torch.Tensor, what: str,
                   atol: "float | torch.Tensor" = ATOL, *, positions: torch.Tensor | None = None,
                   nan_equal: bool = False) -> None:
    """:func:`close` for one sequence of output ``key`` at ``positions`` (default: every position but the last, which
    no consumer reads)."""
    positions = torch.arange(max(actual.shape[0] - 1, 0)) if positions is None else positions
    if actual.shape[0] < (int(positions.max()) + 1 if positions.numel() else 0):
        fail(f"{what}: {actual.shape[0]} values, expected at least {int(positions.max()) + 1}")
    if want.shape[0] < (int(positions.max()) + 1 if positions.numel() else 0):
        fail(f"{what}: the reference has {want.shape[0]} values, expected at least {int(positions.max()) + 1}")
    if isinstance(atol, torch.Tensor):
        atol = atol[positions]
    close(actual[positions], want[positions], what, atol=atol, nan_equal=nan_equal)


def match_oracle(ctx: "Ctx", key: str, got, what: str = "") -> None:
    """The oracle-match loop, in one place (:func:`spec.truth.outputs_checks.oracle_values`, which a reproducer runs
    too): output ``key`` (nested) against the oracle, sequence by sequence, each token a consumer reads
    (:attr:`Ctx.read`) within the tolerance :mod:`spec.truth.oracle` derives, at the precision the engine declares
    for it (:meth:`Ctx.oracle`); a mismatch measured against the known mechanisms' bounds."""
    wants, tols = ctx.oracle(key)
    bounds = {mechanism: per_key[key] for mechanism, per_key in ctx.expected.bounds.items() if per_key.get(key)}

    def measured(exc: AssertionError, i: int, at: torch.Tensor, actual: torch.Tensor) -> None:
        measure_bounds(exc, actual[at], wants[i][at], {m: b[i][at] for m, b in bounds.items()})

    oracle_values(key, got, wants, tols, ctx.case.seq_lens, ctx.read, what, measured)


def measure_bounds(exc: AssertionError, actual: torch.Tensor, want: torch.Tensor,
                   bounds: dict[str, torch.Tensor]) -> None:
    """Attach to ``exc`` the largest ``|actual - want| / bound`` per mechanism (``exc.bounds``; inf where a
    value is NaN), and say it in the message: a known numerical deviation excuses the failure only within its
    mechanism's bound (:attr:`spec.protocol.KnownFailure.bound`)."""
    if not bounds:
        return
    err = (actual.detach().to("cpu", torch.float64) - want.detach().to("cpu", torch.float64)).abs()
    ratios = {}
    for mechanism, bound in bounds.items():
        ratio = err / bound.to(torch.float64).clamp(min=torch.finfo(torch.float64).tiny)
        ratios[mechanism] = float("inf") if bool(ratio.isnan().any()) else float(ratio.max())
    exc.bounds = ratios
    exc.args = (f"{exc.args[0] if exc.args else ''} [" + ", ".join(
        f"|error| / {m} bound = {r:.3g}" for m, r in sorted(ratios.items())) + "]", *exc.args[1:])


def match_runs(ctx: "Ctx", got: dict, want: dict, what: str, rows: list[int] | None = None,
               reference: EngineCase | None = None) -> None:
    """Two runs of the same samples agree on every key (``want``'s keys must all be in ``got``), sequence
    by sequence, at every position a consumer reads, within twice the oracle's tolerance of each token (each
    run is within it of the oracle), at the coarser of the precisions the engine declares for the two runs
    (``got`` is ``ctx.case``'s, ``want`` is ``reference``'s, default the same). NaN equals NaN here: where both
    runs give NaN they agree, and the value invariant (against the oracle) reports the NaN once. ``rows``: the
    samples of the whole case that ``got``'s sequences are (default: all)."""
    rows = list(range(ctx.case.batch_size)) if rows is None else rows
    facts = EveryFailure()  # every key that differs, each a fact of its own (a record excuses only the keys it names)
    for key in sorted(want):
        with facts.each():
            _match_key(ctx, key, got, want, what, rows, reference)
    facts.raise_any()


def _match_key(ctx: "Ctx", key: str, got: dict, want: dict, what: str, rows: list[int],
               reference: EngineCase | None) -> None:
    """:func:`match_runs` for one key."""
    exp = ctx.expected
    if key not in got:
        fail(f"{what}: key {key!r} missing (keys: {sorted(got)})", key=key)
    mine = _sequences(got[key], f"{what}: {key!r}", len(rows))
    theirs = _sequences(want[key], f"{what}: {key!r} (reference)", len(rows))
    tols = exp.tolerance.get(key)
    if tols:
        own, other = ctx.oracle(key)[1], ctx.oracle(key, reference)[1]
        tols = [torch.maximum(a, b) for a, b in zip(own, other)]
    bounds = {mechanism: per_key[key] for mechanism, per_key in exp.bounds.items() if per_key.get(key)}
    for j, (x, y) in enumerate(zip(mine, theirs)):
        at = ctx.read[rows[j]]
        atol = ATOL if not tols else 2 * _padded_tolerance(tols[rows[j]], y.shape[0])
        try:
            close_sequence(key, x, y, f"{what}: {key!r} of sequence {rows[j]}", atol=atol, positions=at,
                           nan_equal=True)
        except AssertionError as exc:
            _locate(exc, key, rows[j], at)
            # the two runs' difference against each mechanism's bound (each run within it of the oracle: a
            # record for a run-vs-run difference allows twice it)
            reach = int(at.max()) + 1 if at.numel() else 0
            if bounds and min(x.shape[0], y.shape[0]) >= reach:
                measure_bounds(exc, x[at], y[at], {m: b[rows[j]][at] for m, b in bounds.items()})
            raise


def _padded_tolerance(tol: torch.Tensor, length: int) -> torch.Tensor:
    """A per-token tolerance extended to ``length`` (log_probs have none at the unread last token)."""
    if tol.shape[0] >= length:
        return tol[:length]
    return torch.cat([tol, tol.new_full((length - tol.shape[0],), float(tol.max()) if tol.numel() else ATOL)])
