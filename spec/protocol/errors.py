"""Every exception the suite raises of its own, in one module (as Hypothesis keeps its ``errors.py``): what each
means and who raises it. Imports nothing (the protocol layer: every layer may raise these).

Who failed:

* :class:`Failures`: several facts that failed in one example, each its own failure (a record excuses only the parts
  it names);
* :class:`SuiteError`: the suite itself (its model, processor, oracle or a check crashed); :class:`MissingDependency`,
  the environment (a module the engine's library imports is not installed);
* :class:`EngineFault`: the engine, seen by a check (a malformed output, a rank that died, hung or disconnected),
  and :class:`RankFault`, such a failure of a rank; :class:`RankFailure`, a rank worker that died or hung;

what a user typed or set up:

* :class:`UnknownName` (an engine, a planted bug, a profile, an ``--only`` prefix naming nothing);
  :class:`DatabaseUnavailable` (the example database cannot be reached); :class:`UsageError` (the command line's
  one-line usage error, exit 2); :class:`InvalidRecord` (a known-failure record that could never match);

what an adapter met:

* :class:`StubError` (a stubbed module's undeclared name used); :class:`ModelNotCalled` (an engine's forward returned
  without calling the model); :class:`OneTemperatureError` (a library with one temperature per trainer handed
  per-sample ones);

and the signals that end a run early (``BaseException``s: neither hypothesis nor an engine's ``except Exception``
catches them): :class:`StopForward` (an engine's forward stopped at its model call), :class:`PartTaken` (a
collective stopped once it has what one rank hands it), :class:`BudgetSpent` (a target's
fault budget or shrink deadline spent), :class:`StreamDone` (every member of a group has failed), :class:`MutantTimeout`
(a target ran past ``spec mutate --timeout`` under a mutant).

The standalone reproducers' runtime (spec/repro) keeps its own exceptions: a reproducer runs without the suite.
"""

from __future__ import annotations

__all__ = ["SuiteError", "MissingDependency", "EngineFault", "Failures", "RankFailure", "RankFault", "UnknownName",
           "DatabaseUnavailable", "UsageError", "InvalidRecord", "StubError", "ModelNotCalled", "OneTemperatureError",
           "StopForward", "PartTaken", "BudgetSpent", "StreamDone",
           "MutantTimeout"]


class SuiteError(RuntimeError):
    """The suite itself failed on an example (its model, processor, oracle or a check crashed)."""


class MissingDependency(SuiteError):
    """The engine's own call could not import a module its library needs (``ModuleNotFoundError: tyro``): the
    environment lacks it. An environment error, never the engine's failed check or rejection
    (``spec.execute.attribution.missing_module`` finds it anywhere in the exception's chain)."""

    def __init__(self, module: str, where: str, detail: str):
        self.module = module
        super().__init__(f"environment: {where} needs the module {module!r}, which is not installed here "
                         f"(pip install {module.split('.')[0]}, or the distribution that provides it): {detail}")


class EngineFault(AssertionError):
    """A failed check on what the engine handed back or how its ranks behaved: a malformed output (values fewer
    than the offsets claim), an exception raised while the suite read one of the engine's objects, a rank that
    died, hung or disconnected. An :class:`AssertionError`: the verdict on the engine, never a suite error."""


class Failures(AssertionError):
    """Several facts that failed in one example, each its own failure (``parts``: their messages and facts): a
    check reports every one (:class:`EveryFailure`), and a known-failure record excuses only the parts it names
    (``spec.protocol.known.excusing``)."""

    def __init__(self, parts: list[BaseException]):
        super().__init__(f"{len(parts)} failures in one example: " + " | ".join(str(p) for p in parts))
        self.parts = parts


class RankFailure(RuntimeError):
    """A worker died or hung; the message holds each rank's traceback."""


class RankFault(RankFailure, EngineFault):
    """A rank died, hung or disconnected while it ran an example (the engine's calls): a failed check on that example
    (an :class:`EngineFault`), with each rank's traceback; the pool is replaced."""


class UnknownName(ValueError):
    """A name the user typed that names nothing; the message is one line, with the closest names."""


class DatabaseUnavailable(RuntimeError):
    """The configured database cannot be reached (a writer must not lose what it finds)."""


class InvalidRecord(ValueError):
    """A known-failure record of the engine that could never match what its invariant's check reports: an unknown
    invariant, a structured field its failures never carry, a mode it never runs (``spec.protocol.known.
    unmatchable``). Raised where the engine's records are read, never a silent no-op."""


class UsageError(Exception):
    """A usage error: printed as one line on stderr, exit code 2."""


class StubError(RuntimeError):
    """The code under test used a name of a stubbed module that nobody declared a value for."""


class ModelNotCalled(RuntimeError):
    """The engine's forward returned without calling the model (so it handed the model nothing)."""


class OneTemperatureError(NotImplementedError):
    """The library takes one temperature per trainer; the micro-batch holds distinct per-sample ones."""


class StopForward(BaseException):
    """Stops the engine's forward at the model call (a BaseException: an engine's ``except Exception`` cannot
    swallow it)."""


class PartTaken(BaseException):
    """Stops an engine's call at a collective (a faked TP gather) once it has what this rank hands it: the part every
    rank's call is then answered with."""


class BudgetSpent(BaseException):
    """Ends a target's hypothesis run (a BaseException: hypothesis does not catch it) once its fault budget or its
    shrink deadline is spent; carries the smallest failing example's exception so far."""

    def __init__(self, why: str, failure: BaseException):
        super().__init__(why)
        self.why, self.failure = why, failure


class StreamDone(BaseException):
    """Every member of a group has failed: nothing is left to check on further examples."""


class MutantTimeout(BaseException):
    """A target ran past ``--timeout`` under a mutant (one that loops forever): a BaseException, so that hypothesis
    does not take it for a failing example and replay it (with no alarm left) while shrinking."""
