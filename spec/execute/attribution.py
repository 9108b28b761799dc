"""Who raised it: the engine under test, or the suite (its model, processor, oracle, checks).

The runner wraps the engine under test in :class:`AttributedEngine`: every exception that
leaves one of the engine's own calls (``prepare_model_inputs``, ``prepare_model_outputs``,
a padding helper) is tagged ``"engine"``; the suite's callables the engine is handed (the
top-K ``logits_processor_func``) are wrapped so that what *they* raise is tagged ``"suite"``
first, even when it surfaces through the engine's call. Anything untagged was raised by
suite code outside the engine (materialize, the toy model, the oracle, a check): a suite
error, unless it is an :class:`AssertionError` (a check's verdict).

Every tagged exception is also logged for the example being run (:func:`recording`), so an
exception that a check swallowed (``except Exception``) is still seen by the runner: a suite
exception never counts as a rejection. Error invariants use :func:`expect_engine_error`.
No spec module is imported here (no cycles): it works on any engine-like object.

What the engine *returned* is validated where the suite first touches it (:func:`check_outputs`): a malformed
structure (a nested output whose values hold fewer entries than its offsets claim) is kept for the example
(:func:`note_fault`; the checks still judge the output as they read it, so a record of how a check fails on it still
matches), and an exception the suite then raises reading it is that :class:`EngineFault`: a failed check naming the
key, the rank and the shape, never a suite error. So is an exception raised while reading one of the engine's objects
through its adapter's views (:func:`read_engine`), and a rank that died or hung. A suite error is a fault in the
suite's own code on engine output that was well formed.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Iterator, Mapping

import torch

from . import coverage_hook
from ..protocol.errors import EngineFault, MissingDependency, SuiteError

__all__ = ["ENGINE", "SUITE", "origin", "tag", "AttributedEngine", "suite_side", "recording", "Log",
           "expect_engine_error", "SuiteError", "describe", "engine_side", "EngineFault", "check_outputs",
           "read_engine", "is_engine_fault", "note_fault", "faults_noted", "trial", "MissingDependency",
           "missing_module"]

ENGINE = "engine"
SUITE = "suite"
_ATTR = "_spec_origin"


def missing_module(exc: BaseException) -> str | None:
    """The module a ``ModuleNotFoundError`` in ``exc``'s cause/context chain could not find, or None."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, ModuleNotFoundError) and link.name:
            return link.name
        link = link.__cause__ or link.__context__
    return None


def is_engine_fault(exc: BaseException) -> bool:
    return isinstance(exc, EngineFault)


def check_nested(key: str, value: torch.Tensor, rank: int) -> None:
    """A jagged nested tensor is well formed: its offsets are 1-D integers from 0, non-decreasing, and its values
    hold exactly the entries the last offset claims (reading one that does not raises deep inside torch)."""
    if value.layout != torch.jagged:
        return
    try:
        values, offs = value.values(), value.offsets()
    except Exception as exc:  # noqa: BLE001 - the engine's tensor cannot be read
        raise EngineFault(f"rank {rank}: output {key!r} is a nested tensor whose values and offsets cannot be read "
                          f"({describe(exc)})") from exc
    if offs is None or offs.dim() != 1 or offs.numel() < 1 or offs.is_floating_point():
        raise EngineFault(f"rank {rank}: output {key!r}: offsets {None if offs is None else tuple(offs.shape)} "
                          "are no 1-D integer tensor")
    offs = offs.detach().cpu().long()
    claimed = int(offs[-1])
    if int(offs[0]) != 0 or bool((offs.diff() < 0).any()):
        raise EngineFault(f"rank {rank}: output {key!r}: offsets {offs.tolist()[:16]} do not rise from 0")
    if values.dim() < 1 or values.shape[0] != claimed:
        raise EngineFault(f"rank {rank}: output {key!r}: values hold {values.shape[0] if values.dim() else 0} "
                          f"entries, offsets claim {claimed} (values {tuple(values.shape)}, offsets "
                          f"{offs.tolist()[:16]})")


def check_outputs(outputs: Any, rank: int) -> None:
    """``outputs`` (one rank's outputs, as a view maps them) are a mapping, each nested tensor in it well formed;
    else an :class:`EngineFault` naming the key, the rank and the shape (what else an output holds is the
    invariants' to judge: INV-LAYOUT-001)."""
    if not isinstance(outputs, Mapping):
        raise EngineFault(f"rank {rank}: the outputs are a {type(outputs).__name__}, not a mapping")
    for key, value in outputs.items():
        if isinstance(value, torch.Tensor) and value.is_nested:
            check_nested(key, value, rank)


def read_engine(fn: Callable[[], Any], what: str, rank: int) -> Any:
    """``fn()`` reads one of the engine's objects (its outputs through the adapter's view, its model inputs): what
    it raises is an :class:`EngineFault` (the object was not what the engine's own view promises), not a suite
    error."""
    try:
        return fn()
    except EngineFault:
        raise
    except Exception as exc:  # noqa: BLE001 - raised reading the engine's object
        raise EngineFault(f"rank {rank}: reading {what} raised {describe(exc)}") from exc


def origin(exc: BaseException) -> str | None:
    """``"engine"``, ``"suite"`` or None (untagged: raised by suite code outside any engine call).

    A suite tag anywhere in the cause/context chain wins: an engine that re-raises the suite
    processor's error under its own type has still not rejected anything by itself."""
    seen: set[int] = set()
    found = getattr(exc, _ATTR, None)
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if getattr(link, _ATTR, None) == SUITE:
            return SUITE
        link = link.__cause__ or link.__context__
    return found


def tag(exc: BaseException, who: str) -> BaseException:
    """Tag ``exc`` with its origin unless an inner boundary already did."""
    if getattr(exc, _ATTR, None) is None:
        try:
            setattr(exc, _ATTR, who)
        except (AttributeError, TypeError):  # an exception type with __slots__: leave it untagged
            pass
    return exc


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:600]


class Log:
    """The tagged exceptions raised while one example ran (engine threads included)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, BaseException]] = []  # (origin, where, exception)
        self.handled: set[int] = set()  # ids of exceptions a check consumed on purpose
        #: malformed engine outputs seen while the example ran (:func:`note_fault`): an exception the suite then
        #: raises reading them is the engine's failed check, not a suite error
        self.faults: list[EngineFault] = []
        self._lock = threading.Lock()

    def add(self, who: str, where: str, exc: BaseException) -> None:
        with self._lock:
            if all(e is not exc for _, _, e in self.events):
                self.events.append((who, where, exc))

    def unhandled_suite(self) -> list[tuple[str, BaseException]]:
        return [(where, exc) for who, where, exc in self.events
                if origin(exc) == SUITE and id(exc) not in self.handled]


_CURRENT: list[Log] = []  # a stack; the runner runs one example at a time per process


@contextmanager
def recording() -> Iterator[Log]:
    log = Log()
    _CURRENT.append(log)
    try:
        yield log
    finally:
        _CURRENT.remove(log)


def _note(who: str, where: str, exc: BaseException) -> None:
    tag(exc, who)
    if _CURRENT:
        _CURRENT[-1].add(getattr(exc, _ATTR, who), where, exc)


def note_fault(fault: EngineFault) -> None:
    """Keep ``fault`` (a malformed output, found where the suite first touched it) for the running example."""
    if _CURRENT and all(f is not fault for f in _CURRENT[-1].faults):
        _CURRENT[-1].faults.append(fault)


@contextmanager
def faults_noted() -> Iterator[list[EngineFault]]:
    """The engine faults noted for the running example while the block ran (a list filled when it ends)."""
    log = _CURRENT[-1] if _CURRENT else None
    before = len(log.faults) if log is not None else 0
    found: list[EngineFault] = []
    try:
        yield found
    finally:
        if log is not None:
            found.extend(log.faults[before:])


@contextmanager
def trial() -> Iterator[None]:
    """A block whose failure the running example never saw: if it raises, what it logged (the exceptions it tagged,
    the engine faults it noted) is dropped from the running example's log before the exception propagates."""
    log = _CURRENT[-1] if _CURRENT else None
    events, faults = (len(log.events), len(log.faults)) if log is not None else (0, 0)
    try:
        yield
    except BaseException:
        if log is not None:
            del log.events[events:], log.faults[faults:]
        raise


def _tagged(fn: Callable, where: str, side: str, context: Callable[[], Any] = nullcontext,
            environment: bool = False) -> Callable:
    """``fn`` run inside ``context()``, its exceptions tagged as ``side``'s (:data:`SUITE` or :data:`ENGINE`). With
    ``environment``, an ImportError of a module the environment lacks (:func:`missing_module`) is raised as a
    :class:`MissingDependency` instead, tagged as nobody's: never the engine's failed check or rejection."""
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            with context():
                return fn(*args, **kwargs)
        except BaseException as exc:
            module = missing_module(exc) if environment and isinstance(exc, ImportError) else None
            if module is not None:
                raise MissingDependency(module, where, describe(exc)) from exc
            _note(side, where, exc)
            raise
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def suite_side(fn: Callable, where: str) -> Callable:
    """``fn`` (a suite callable handed to the engine), with its exceptions tagged as the suite's."""
    return _tagged(fn, where, SUITE)


def _engine_side(fn: Callable, where: str) -> Callable:
    # the engine's code: measured where spec verify measures it; a module its library lacks is the environment's
    return _tagged(fn, where, ENGINE, coverage_hook.engine_code, environment=True)


def engine_side(fn: Callable, where: str) -> Callable:
    """``fn`` (one of the engine's own callables: a micro-batch layer function), with its exceptions tagged as the
    engine's."""
    return _engine_side(fn, where)


class _AttributedObject:
    """An engine object whose two methods tag what they raise; the processor it gets is the suite's."""

    def __init__(self, inner: Any):
        self._inner = inner

    def prepare_model_inputs(self, micro_batch, *args, **kwargs):
        return _engine_side(self._inner.prepare_model_inputs, "prepare_model_inputs")(micro_batch, *args, **kwargs)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func=None, *args, **kwargs):
        if logits_processor_func is not None:
            logits_processor_func = suite_side(logits_processor_func, "logits_processor_func (top-K processor)")
        return _engine_side(self._inner.prepare_model_outputs, "prepare_model_outputs")(
            output, output_args, micro_batch, logits_processor_func, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        return _engine_side(value, name) if callable(value) and not isinstance(value, type) else value

    def __repr__(self) -> str:
        return repr(self._inner)


class AttributedEngine:
    """An engine under test whose objects and helpers tag their exceptions as the engine's.

    Everything else (name, known failures, ``lacks``, strategy limits) is the wrapped engine's."""

    def __init__(self, engine: Any):
        self._engine = engine

    @property
    def unwrapped(self) -> Any:
        return self._engine

    def make(self, *args: Any, **kwargs: Any) -> Any:
        """The engine's object; what its construction raises is the engine's (a rejected setting)."""
        return _AttributedObject(_engine_side(self._engine.make, "make (the engine's constructor)")(*args, **kwargs))

    def helper(self, name: str) -> Callable | None:
        fn = self._engine.helper(name)
        return None if fn is None else _engine_side(fn, name)

    @property
    def packer(self) -> Any:
        """The engine's packer (:attr:`~spec.protocol.EngineUnderTest.packer`: verl-megatron's packing functions, no
        engine object), its calls the engine's (tagged, and measured by a gated coverage measurement)."""
        packer = self._engine.packer
        return None if packer is None else _AttributedObject(packer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __repr__(self) -> str:
        return repr(self._engine)


def expect_engine_error(call: Callable[[], Any], what: str, types: tuple[type[BaseException], ...] = (Exception,),
                        ) -> BaseException:
    """Run ``call`` (e.g. ``lambda: execute(...)``); pass only if one of the engine's own calls raised
    one of ``types``. Returns that exception.

    * the engine raised another type: AssertionError (a wrong rejection);
    * nothing raised: AssertionError ("accepted silently");
    * only the suite raised (its processor or model choked on what the engine accepted): an
      AssertionError that says so: the engine accepted the input, and the suite's exception is no
      rejection (it is marked handled, so the runner does not also report a suite error);
    * untagged errors (suite code outside any engine call) propagate: a suite error.
    """
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - classified below
        who = origin(exc)
        if who is None and isinstance(exc, AssertionError):
            raise  # a check's own verdict
        if who == ENGINE:
            if not isinstance(exc, types):
                raise AssertionError(f"{what}: the engine raised {describe(exc)}, expected one of "
                                     f"{[t.__name__ for t in types]}") from exc
            return exc
        if who != SUITE:
            raise
        if _CURRENT:
            _CURRENT[-1].handled.add(id(exc))
        verdict = (f"{what} was accepted by the engine (no engine call raised); the suite's own code then "
                   f"failed on it ({describe(exc)}): that is no rejection")
    else:
        verdict = f"{what} was accepted silently; the contract makes it an error"
    # raised outside the except block: the check's verdict, not chained to the suite's exception
    raise AssertionError(verdict)
