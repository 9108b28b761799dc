"""Known failures as precise records: where they apply, and how they fail.

In the spirit of OpInfo's ``XFailRule``/``DecorateInfo``, but keyed on the drawn case: a
:class:`KnownFailure` names an invariant (and optionally modes), a :class:`When` condition on
the case (a predicate with a human description) and the failure it expects (exception type
and a message regex). The runner excuses an example only when all of these match; the
example then counts as a *known-failure hit* and the run goes on, so a second, different
bug in the same invariant is still found and shrunk. Outside its condition, or with another
failure, the example fails as usual. A record that never fires over a run is *stale*: the
run reports it (as "unexpectedly passed") and fails, so a fixed bug cannot keep its excuse.

A record excuses only what the engine declares: a failure that names an output's dtype (``exc.output_dtype =
(key, dtype)``, INV-DEV-001's) is excused only where the engine's declared precision for that key on that case's
path (``EngineUnderTest.precision(key, case).returns``) is that dtype (:func:`declared`), whatever the record's
condition and pattern say: an entropy rounded to bf16 on a path declared float32 is no known failure. Likewise a
record bounded by a low-precision mechanism (``bound=("float16_cancellation", ...)``) excuses a value only on a key
and path the engine declares it computes or returns in that dtype (:func:`declared_mechanism`).

One example may fail several facts at once (INV-DEV-001: every output whose dtype is not float32; a value check:
every output key that differs): the check raises one failure whose ``parts`` are the facts, each an exception with
its own message and facts (:func:`parts_of`). A record excuses only the facts it names; the example is a known
failure only when every failing fact is excused, by one record or several (:func:`excusing`), so an excused
failure can never hide another in the same example.

Which facts a check's failures carry is the check's declaration (``InvariantInfo.facts``); a record asking a fact
the check never carries (``output=`` on a check that names no key) could never match, and is an error where the
engine's records are read (:func:`unmatchable`), never a silent no-op.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

__all__ = ["When", "ALWAYS", "KnownFailure", "applicable", "matching", "describe_records", "as_records",
           "within_bound", "declared", "declared_mechanism", "FLOAT_DTYPES", "Where", "parts_of", "excusing",
           "unexcused", "unmatchable", "FACTS"]

#: the structured facts a check's failure may carry (``exc.facts`` keys, and ``bounds``: the error measured against
#: the precision mechanisms' bounds), each with the record field that reads it
FACTS = {"key": "output", "position": "position", "bounds": "mechanism/bound"}

#: the floating dtypes an engine's precision declaration speaks of (``Precision.returns``); a failure naming another
#: dtype (an integer count) is no precision matter and is left to the record alone
FLOAT_DTYPES = ("float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class When:
    """A condition on the drawn case (``EngineCase`` or ``DenseCase``), with what it means in words."""

    text: str
    predicate: Callable[[Any], bool] = field(compare=False)

    def __call__(self, case: Any) -> bool:
        return bool(self.predicate(case))

    def __and__(self, other: "When") -> "When":
        return When(f"{self.text} and {other.text}", lambda c: self(c) and other(c))

    def __invert__(self) -> "When":
        return When(f"not ({self.text})", lambda c: not self(c))

    def __or__(self, other: "When") -> "When":
        return When(f"({self.text} or {other.text})", lambda c: self(c) or other(c))

    def __str__(self) -> str:
        return self.text


ALWAYS = When("every case", lambda case: True)


@dataclass(frozen=True)
class Where:
    """A condition on where a check failed: ``predicate(case, sequence, position)`` on the facts the failure
    carries (``exc.facts``: the sequence and the token position in it), with what it means in words."""

    text: str
    predicate: Callable[[Any, int, int], bool] = field(compare=False)

    def __call__(self, case: Any, sequence: int, position: int) -> bool:
        return bool(self.predicate(case, sequence, position))

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class KnownFailure:
    """One documented failure of an engine on one invariant.

    ``modes``: the modes it applies to (empty: every mode). ``when``: the cases it applies to.
    ``raises``: the exception type(s) the failure has (an :class:`AssertionError` from the check,
    or what the engine raises). ``matches``: a regex searched in ``"Type: message"``.
    ``reason``: why it fails, with a pointer to the bug (shown in reports). ``certain``: whether the failure shows
    on (nearly) every case under ``when`` (the default): then a run in which examples under it passed and none
    failed so is evidence the record is stale. ``certain=False``: the condition makes the failure possible,
    not likely (a float32 cancellation on some logits); without a hit such a record is only "not reached".
    """

    invariant: str
    reason: str
    raises: type[BaseException] | tuple[type[BaseException], ...] = AssertionError
    matches: str = ""
    when: When = ALWAYS
    modes: tuple[str, ...] = ()
    #: False for a failure its condition makes possible but not certain (a float32 cancellation shows on some
    #: logits and not others): with no hit it is reported as not reached, never as stale
    certain: bool = True
    #: for a numerical deviation: ``(mechanism, limit)``; the record excuses a failure only when the check
    #: measured the error against that mechanism's bound (``exc.bounds[mechanism]``: the largest
    #: |error| / bound over the tokens) and it is at most ``limit``. A wrong value beyond what the mechanism
    #: can produce, or a NaN, is not excused.
    bound: tuple[str, float] | None = None
    #: structured matching, on the facts a check's failure carries (``exc.facts``, set by
    #: ``spec.invariants.core.fail`` and the value checks) instead of a regex of its message. ``output``: the
    #: output or model-input key the failure names (``"log_probs"``, ``"attention_mask"``); ``position``: where
    #: in the batch (:class:`Where`, on the failing sequence and token); ``mechanism``: the precision mechanism
    #: (spec/truth/oracle.py's bound names: ``"bfloat16_rounding"``, ``"float32_cancellation"``, ...) whose bound the
    #: error is within, the same as ``bound=(mechanism, 1.0)``. A failure that carries no such fact is not excused.
    output: str = ""
    position: "Where | None" = None
    mechanism: str = ""

    def __post_init__(self) -> None:
        re.compile(self.matches)  # fail at definition, not mid-run
        if self.mechanism and self.bound is None:
            object.__setattr__(self, "bound", (self.mechanism, 1.0))
        elif self.mechanism and self.bound[0] != self.mechanism:
            raise ValueError(f"known failure {self.invariant}: mechanism {self.mechanism!r} and bound {self.bound!r} "
                             "name different mechanisms")

    @property
    def key(self) -> str:
        return self.invariant + (f"/{','.join(self.modes)}" if self.modes else "")

    def applies_to(self, invariant: str, mode: str) -> bool:
        return self.invariant == invariant and (not self.modes or mode in self.modes)

    def excuses(self, case: Any, exc: BaseException, engine: Any = None) -> bool:
        """Whether this record explains ``exc`` raised on ``case`` (and, given ``engine``, whether the engine's
        declarations allow what it excuses: :func:`declared`)."""
        if not isinstance(exc, self.raises) or not self.when(case):
            return False
        text = f"{type(exc).__name__}: {exc}"
        if re.search(self.matches, text) is None:
            return False
        facts = getattr(exc, "facts", {})
        if self.output and facts.get("key") != self.output:
            return False
        if self.position is not None and not ("sequence" in facts and "position" in facts
                                              and self.position(case, facts["sequence"], facts["position"])):
            return False
        if engine is not None and not declared(engine, case, exc):
            return False
        if engine is not None and self.bound is not None and not declared_mechanism(engine, case, exc, self.bound[0]):
            return False
        return self.bound is None or within_bound(exc, *self.bound)

    def describe(self) -> str:
        types = self.raises if isinstance(self.raises, tuple) else (self.raises,)
        bounded = f", within {self.bound[1]:g}x the {self.bound[0]} bound" if self.bound else ""
        where = (f" on {self.output!r}" if self.output else "") + (f" at {self.position.text}" if self.position else "")
        matching = f" matching {self.matches!r}" if self.matches else ""
        return (f"{self.key} when {self.when.text}: {'/'.join(t.__name__ for t in types)}"
                f"{matching}{where}{bounded} ({self.reason})")


def within_bound(exc: BaseException, mechanism: str, limit: float) -> bool:
    """Whether the check that raised ``exc`` measured its error within ``limit`` times ``mechanism``'s bound
    (a check that measured nothing for that mechanism excuses nothing; NaN is never within)."""
    ratio = getattr(exc, "bounds", {}).get(mechanism)
    return ratio is not None and ratio <= limit


def declared(engine: Any, case: Any, exc: BaseException) -> bool:
    """Whether ``engine``'s own declarations allow the deviation ``exc`` reports on ``case``: a failure naming an
    output's floating dtype (``exc.output_dtype = (key, dtype)``) only where ``engine.precision(key, case)``
    returns that dtype; any other failure, or an engine that declares no precision, is left to the record."""
    named = getattr(exc, "output_dtype", None)
    declare = getattr(engine, "precision", None)
    if named is None or declare is None:
        return True
    key, dtype = named
    dtype = str(dtype).removeprefix("torch.")
    if dtype not in FLOAT_DTYPES:
        return True
    return str(declare(key, case).returns).removeprefix("torch.") == dtype


def declared_mechanism(engine: Any, case: Any, exc: BaseException, mechanism: str) -> bool:
    """Whether ``engine``'s declarations allow a precision ``mechanism`` (spec/truth/oracle.py's bound names,
    ``"<dtype>_cancellation"``, ``"<dtype>_rounding"``) on the output key the failure names (``exc.facts["key"]``):
    a float32 mechanism always (the contract's precision); a bf16/fp16 one only where ``engine.precision(key, case)``
    computes or returns in that dtype (``scaled_in`` or ``returns``). A record bounded by float16 cancellation on
    an output the engine declares it computes in float32 excuses nothing there. A failure naming no key, or an
    engine that declares no precision, is left to the record."""
    dtype = mechanism.rsplit("_", 1)[0]
    key = getattr(exc, "facts", {}).get("key")
    declare = getattr(engine, "precision", None)
    if dtype not in FLOAT_DTYPES or dtype in ("float32", "float64") or key is None or declare is None:
        return True
    precision = declare(key, case)
    return dtype in (str(precision.returns).removeprefix("torch."), str(precision.scaled_in).removeprefix("torch."))


def parts_of(exc: BaseException) -> list[BaseException]:
    """The failing facts of one example's failure: the ``parts`` a check reported (each its own exception, with its
    own message and facts), else the failure itself."""
    return list(getattr(exc, "parts", None) or (exc,))


def excusing(records: Iterable[KnownFailure], case: Any, exc: BaseException, engine: Any = None
             ) -> list[KnownFailure] | None:
    """The records that excuse ``exc`` on ``case``, one per failing fact (:func:`parts_of`), or None when a fact is
    left that no record excuses: a record excuses only the facts it names."""
    records = list(records)
    found = [matching(records, case, part, engine) for part in parts_of(exc)]
    return None if any(record is None for record in found) else found


def unexcused(records: Iterable[KnownFailure], case: Any, exc: BaseException, engine: Any = None
              ) -> list[BaseException]:
    """The failing facts of ``exc`` that no record excuses on ``case``."""
    records = list(records)
    return [part for part in parts_of(exc) if matching(records, case, part, engine) is None]


def unmatchable(record: KnownFailure, facts: Iterable[str], modes: Iterable[str]) -> str | None:
    """Why ``record`` can never match a check whose failures carry ``facts`` (:data:`FACTS` keys) and that runs in
    ``modes``, or None: a structured field the check never carries, or a mode it never runs."""
    facts = set(facts)
    asked = [("key", "output", record.output), ("position", "position", record.position),
             ("bounds", "mechanism/bound", record.bound)]
    missing = [f"{field}=" for fact, field, value in asked if value and fact not in facts]
    if missing:
        return (f"{record.describe()}: asks {', '.join(missing)} but {record.invariant}'s failures carry "
                f"{sorted(facts) or 'no facts'}: it could never match (use matches= on its message instead)")
    modes = set(modes)
    if record.modes and not set(record.modes) & modes:
        return (f"{record.describe()}: {record.invariant}'s targets are {sorted(modes)}, never "
                f"{'/'.join(record.modes)}: it could never apply")
    return None


def applicable(records: Iterable[KnownFailure], invariant: str, mode: str) -> list[KnownFailure]:
    return [r for r in records if r.applies_to(invariant, mode)]


def matching(records: Iterable[KnownFailure], case: Any, exc: BaseException, engine: Any = None
             ) -> KnownFailure | None:
    """The first record that excuses ``exc`` on ``case`` (given ``engine``: only within its declarations)."""
    return next((r for r in records if r.excuses(case, exc, engine)), None)


def describe_records(records: Iterable[KnownFailure]) -> str:
    return "; ".join(r.describe() for r in records)


def as_records(known: Any) -> list[KnownFailure]:
    """An engine's ``known_failures`` as records. A legacy ``{"ID" or "ID/mode": reason}`` dict (an engine
    not yet rewritten) becomes records that excuse any failure there, on every case: imprecise, which
    the report shows in their condition."""
    if isinstance(known, dict):
        return [KnownFailure(key.split("/", 1)[0], reason, raises=BaseException,
                             when=When("every case (legacy, imprecise entry)", lambda case: True),
                             modes=tuple(key.split("/", 1)[1:]))
                for key, reason in known.items()]
    return list(known or ())
