"""Runs catalogue entries against an engine with hypothesis; one code path for pytest and the CLI."""

from __future__ import annotations

import time
import zlib
from dataclasses import asdict, dataclass

import torch
from hypothesis import Phase, example, given, seed as hypothesis_seed, settings

from .cases import DenseCase, EngineCase
from .engines import EngineUnderTest
from .invariants import CATALOGUE, Ctx, InvariantInfo

__all__ = ["Outcome", "instances", "skip_reason", "run_invariant", "SEED_CASES", "DEVICES"]

DEVICES = ("cpu", "cuda")

#: The seeds' worked examples (verl PRs #6345, #6386), pinned on every invariant.
SEED_CASES = (
    EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=1.0),
    EngineCase(prompt_lens=(3, 2), response_lens=(2, 1), vocab=8, temperature=(0.5, 2.0), calculate_entropy=True,
               distillation_keys=("distillation_losses", "student_mass")),
)
SEED_DENSE = (
    DenseCase(prompt_lens=(3, 2), response_lens=(2, 1), prompt_width=3, response_width=2, topk=2),
    DenseCase(prompt_lens=(2, 2), response_lens=(1, 1), prompt_width=2, response_width=1, mrope=True),
    DenseCase(prompt_lens=(2,), response_lens=(3,), prompt_width=2, response_width=3, mrope=True),
)


@dataclass
class Outcome:
    invariant: str
    engine: str
    mode: str
    device: str
    status: str  # pass | fail | skip | xfail | xpass
    examples: int = 0
    exercised: int = 0  # examples on which the property was exercised (not marked ctx.not_exercised)
    distinct_cases: int = 0
    seconds: float = 0.0
    counterexample: str | None = None
    error: str | None = None
    reason: str | None = None

    @property
    def test_id(self) -> str:
        return f"{self.invariant}-{self.engine}-{self.mode}-{self.device}"

    def as_dict(self) -> dict:
        return {**asdict(self), "test_id": self.test_id}


def instances(infos=None) -> list[tuple[InvariantInfo, str]]:
    """Every (invariant, mode) pair of the catalogue, in ID order."""
    infos = infos if infos is not None else [CATALOGUE[k] for k in sorted(CATALOGUE)]
    return [(info, mode) for info in infos for mode in info.modes]


def skip_reason(info: InvariantInfo, engine: EngineUnderTest, device: str) -> str | None:
    if device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    for need in info.needs:
        reason = engine.lacks(need)
        if reason:
            return reason
    return None


def _seed_examples(info: InvariantInfo, mode: str) -> list:
    if info.kind == "dense":
        return list(SEED_DENSE)
    cases = []
    for case in SEED_CASES:
        if mode in ("packed", "padded"):
            case = case.with_(use_remove_padding=mode == "packed")
        if info.head != case.head:
            case = case.with_(head=info.head, temperature=1.0, distillation_keys=(), calculate_entropy=False)
        cases.append(info.adjust(case) if info.adjust else case)
    return cases


def _one_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(text.split())[:600]


def stream_key(info: InvariantInfo, mode: str) -> bytes:
    """Each invariant x mode has its own seed stream (and example-database key): under
    ``derandomize`` hypothesis seeds from the test's digest, which this key enters."""
    return f"{info.id}/{mode}".encode()


def run_invariant(info: InvariantInfo, engine: EngineUnderTest, mode: str, device: str = "cpu", *,
                  profile: str | None = None, shrink: bool = True, seed: int | None = None,
                  **setting_overrides) -> Outcome:
    """Check ``info`` on ``engine`` under ``profile`` (default: the loaded one) plus overrides.

    ``shrink=False`` stops at the first failing example (enough to know a bug is rejected).
    ``seed``: an explicit seed (combined with the invariant's stream key), for independent runs.
    """
    outcome = Outcome(info.id, engine.name, mode, device, "pass")
    reason = skip_reason(info, engine, device)
    if reason:
        outcome.status, outcome.reason = "skip", reason
        return outcome
    state: dict = {"n": 0, "exercised": 0, "cases": set(), "fail": None}

    def body(case):
        state["n"] += 1
        state["cases"].add(repr(case))
        ctx = Ctx(engine, case, device, mode)
        try:
            info.check(ctx)
        except Exception as exc:
            state["fail"] = (case, exc)
            raise
        if ctx.vacuous is None:
            state["exercised"] += 1

    body._hypothesis_internal_add_digest = stream_key(info, mode)  # type: ignore[attr-defined]

    def prop(phases):
        test = given(case=info.cases(mode, engine))(body)
        for case in reversed(_seed_examples(info, mode)):
            test = example(case=case)(test)
        if seed is not None:
            test = hypothesis_seed(zlib.crc32(stream_key(info, mode)) ^ seed)(test)
        return settings(parent, phases=phases, **setting_overrides)(test)

    parent = settings.get_profile(profile) if profile is not None else settings.default
    # Generated examples first (so a failure is reported shrunk), then the pinned seed examples.
    generated = tuple(p for p in parent.phases if p != Phase.explicit and (shrink or p != Phase.shrink))
    start = time.perf_counter()
    for phases in (generated, (Phase.explicit,)):
        try:
            prop(phases)()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, with its minimal case
            case, original = state["fail"] if state["fail"] else (None, exc)
            outcome.status = "fail"
            outcome.counterexample = repr(case) if case is not None else None
            outcome.error = _one_line(original)
            break
    outcome.seconds = time.perf_counter() - start
    outcome.examples = state["n"]
    outcome.exercised = state["exercised"]
    outcome.distinct_cases = len(state["cases"])
    known = engine.known_failures.get(f"{info.id}/{mode}") or engine.known_failures.get(info.id)
    if known:
        outcome.reason = known
        outcome.status = "xfail" if outcome.status == "fail" else "xpass"
    return outcome
