"""The invariant record, its registry, and the context a check runs in."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

import torch
from hypothesis import strategies as st

from ..cases import DenseCase, EngineCase
from ..engines import EngineUnderTest
from ..harness import Run, execute, model_for
from ..materialize import materialize, move
from ..oracle import Expected, expected
from ..strategies import dense_cases, engine_cases

__all__ = ["InvariantInfo", "CATALOGUE", "invariant", "Ctx", "close", "close_sequence", "per_seq", "fail"]

ATOL = 1e-4
RTOL = 1e-4


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
    """

    id: str
    title: str
    contract: int
    check: Callable[["Ctx"], None]
    modes: tuple[str, ...] = ("packed", "padded")
    needs: tuple[str, ...] = ()
    kind: str = "batch"  # "batch": EngineCase end to end; "dense": a DenseCase for left_right_2_no_padding
    head: str = "lm"
    strategy_kwargs: dict[str, Any] = field(default_factory=dict)
    adjust: Callable[[EngineCase], EngineCase] | None = None
    protects: str = ""
    layout: bool = False

    def cases(self, mode: str, engine: EngineUnderTest) -> st.SearchStrategy:
        if self.kind == "dense":
            return dense_cases()
        kwargs = {**engine.strategy_limits(), **self.strategy_kwargs}
        strategy = engine_cases(mode=mode if mode in ("packed", "padded") else None, head=self.head, **kwargs)
        return strategy.map(self.adjust) if self.adjust else strategy

    @property
    def doc(self) -> str:
        return (self.check.__doc__ or "").strip()


CATALOGUE: dict[str, InvariantInfo] = {}


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

    def __init__(self, engine: EngineUnderTest, case: EngineCase | DenseCase, device: str, mode: str):
        self.engine, self.case, self.device, self.mode = engine, case, device, mode
        #: set by :meth:`not_exercised`: this example did not exercise the property (the runner counts it)
        self.vacuous: str | None = None

    def not_exercised(self, reason: str) -> None:
        """Record that this example could not exercise the property (e.g. nothing to poison).

        Invariants force their preconditions in ``adjust`` so this stays rare; the runner
        reports examples run vs exercised, and a test fails below 90% exercised."""
        self.vacuous = reason

    @cached_property
    def run(self) -> Run:
        return execute(self.engine, self.case, self.device)

    @cached_property
    def inputs_run(self) -> Run:
        """Only prepare_model_inputs (what input invariants look at): a later failure cannot mask theirs."""
        if "run" in self.__dict__:
            return self.run
        return execute(self.engine, self.case, self.device, stop_after_inputs=True)

    @cached_property
    def batch(self):
        """The micro-batch alone (for helper invariants that need no engine run)."""
        return materialize(self.case, self.device)

    @cached_property
    def expected(self) -> Expected:
        if self.device == "cpu":
            return expected(self.case, self.run.micro_batch, self.run.model)
        return expected(self.case, move(self.run.micro_batch, "cpu"), model_for(self.case, "cpu"))

    def rerun(self, case: EngineCase | None = None, **kwargs: Any) -> Run:
        return execute(self.engine, case or self.case, self.device, **kwargs)

    def helper(self, name: str) -> Callable:
        fn = self.engine.helper(name)
        if fn is None:  # guarded by `needs`; reaching here is a suite bug
            raise RuntimeError(f"engine {self.engine.name} has no helper {name}")
        return fn


def fail(message: str) -> None:
    raise AssertionError(message)


def per_seq(nested: torch.Tensor) -> list[torch.Tensor]:
    """A nested output as a list of CPU float64 tensors, one per sequence."""
    return [t.detach().to("cpu", torch.float64) for t in nested.unbind()]


def close_sequence(key: str, actual: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """:func:`close` for one sequence of output ``key``; log_probs drop the last token, whose label is
    the next sequence's first token (or a wrap) and is never read back."""
    if key == "log_probs":
        actual, want = actual[:-1], want[:-1]
    close(actual, want, what)


def close(actual: torch.Tensor, want: torch.Tensor, what: str, *, atol: float = ATOL, rtol: float = RTOL) -> None:
    """Assert ``actual`` ≈ ``want`` (same shape), naming the first bad index."""
    actual = actual.detach().to("cpu", torch.float64)
    want = want.detach().to("cpu", torch.float64)
    if actual.shape != want.shape:
        fail(f"{what}: shape {tuple(actual.shape)}, expected {tuple(want.shape)}")
    bad = ~torch.isclose(actual, want, atol=atol, rtol=rtol)
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        fail(f"{what}: at {idx} got {actual[idx].item():.6g}, expected {want[idx].item():.6g} "
             f"({int(bad.sum())} of {bad.numel()} values differ)")
