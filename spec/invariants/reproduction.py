"""How an invariant's standalone reproducer checks it: one record per invariant, declared where the invariant is
registered (``@invariant(..., repro=...)``), read by the writers of spec/repro. An invariant without one has no
standalone reproducer (the file written for it says so).

* :class:`Plan`: an engine case. The checks (spec/repro/runtime.py runs them, each the invariant's own check from
  spec/truth/*_checks.py) on one or more runs of the shrunk case: the case itself, plus the variants a run-vs-run
  invariant compares it with. Every run is checked against the float64 reference written out in the file, so a
  run-vs-run invariant (packed vs padded, a permutation, halves, a float vs a tensor temperature, sequence
  parallelism, a bucket, chunking) becomes "each of the runs equals the reference": where two runs disagree, one of
  them is wrong. ``real_ranks``: the file starts its own gloo ranks (spec/repro/ranks.py).
* :class:`LayerCheck`: a micro-batch case. The layer functions the invariant calls (its own ``functions``) and the
  check of spec/repro/vendored that the file runs on them: on the layer's cut (``on="cut"``), its TensorDict helpers
  (``"helpers"``), its cut on real data-parallel ranks (``"ranks"``), or the whole way through the engine
  (``"engine"``).

spec/repro/plans.py lists every check name a :class:`Plan` may ask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..cases.structure import EngineCase

__all__ = ["Plan", "LayerCheck", "Variant", "alone", "both_modes", "float_and_tensor", "permuted", "halves",
           "sequence_parallel", "bucketed", "chunked", "VALUES"]

#: a variant: (label, the case of the run) from the shrunk case
Variant = Callable[[EngineCase], list[tuple[str, EngineCase]]]


def alone(case: EngineCase) -> list[tuple[str, EngineCase]]:
    return [("the case", case)]


def both_modes(case: EngineCase) -> list[tuple[str, EngineCase]]:
    return [("packed", case.with_(use_remove_padding=True)),
            ("padded", case.with_(use_remove_padding=False, sp_size=1, pad_to_length=None))]


def float_and_tensor(case: EngineCase) -> list[tuple[str, EngineCase]]:
    temps = case.temperatures()
    runs = [("the case", case)]
    if len(set(temps)) == 1:
        other = case.with_(temperature=temps) if not case.per_sample_temperature else case.with_(temperature=temps[0])
        runs.append(("the same temperature as a (B,) tensor" if not case.per_sample_temperature
                     else "the same temperature as a float", other))
    return runs


def _doubled(case: EngineCase) -> EngineCase:
    if case.batch_size > 1:
        return case
    temperature = case.temperature * 2 if isinstance(case.temperature, tuple) else case.temperature
    return case.with_(prompt_lens=case.prompt_lens * 2, response_lens=case.response_lens * 2, temperature=temperature)


def permuted(case: EngineCase) -> list[tuple[str, EngineCase]]:
    case = _doubled(case)
    rows = list(range(case.batch_size))[::-1]
    return [("the case", case), (f"its samples in the order {rows}", case.subset(rows))]


def halves(case: EngineCase) -> list[tuple[str, EngineCase]]:
    case = _doubled(case)
    half = case.batch_size // 2
    first, second = list(range(half)), list(range(half, case.batch_size))
    return [("the case", case), (f"samples {first} alone", case.subset(first)),
            (f"samples {second} alone", case.subset(second))]


def sequence_parallel(case: EngineCase) -> list[tuple[str, EngineCase]]:
    return [(f"sp={max(case.sp_size, 2)}", case.with_(sp_size=max(case.sp_size, 2))), ("sp=1", case.with_(sp_size=1))]


def bucketed(case: EngineCase) -> list[tuple[str, EngineCase]]:
    bucket = case.pad_to_length or case.total_nnz + 3
    return [(f"bucket={bucket}", case.with_(pad_to_length=bucket)), ("no bucket", case.with_(pad_to_length=None))]


def chunked(case: EngineCase) -> list[tuple[str, EngineCase]]:
    chunk = case.entropy_chunk_size or 2
    return [(f"entropy chunk size {chunk}", case.with_(entropy_chunk_size=chunk)),
            ("no chunking", case.with_(entropy_chunk_size=None))]


@dataclass(frozen=True)
class Plan:
    """An engine case's reproducer: ``checks`` on each run ``runs`` makes of the shrunk case."""

    checks: tuple[str, ...]
    runs: Variant = alone
    #: what fills the padded logit slots and the packed tail (the suite's poisons)
    poison: str = "nan"
    #: the output keys the invariant asserts, the only ones ``values`` compares (empty: every key the flags ask for)
    keys: tuple[str, ...] = ()
    #: the runs are on real gloo ranks the file starts (the INV-RANK invariants)
    real_ranks: bool = False


#: every key the flags ask for, against the reference
VALUES = Plan(("keys", "values"))


@dataclass(frozen=True)
class LayerCheck:
    """A micro-batch case's reproducer: the vendored check ``check`` on the layer's functions the invariant calls."""

    #: the check's name in the vendored module (none for "ranks" and "engine": their files hold one check each)
    check: str | None = None
    #: "cut" (spec/repro/vendored/layer_cut_checks.py), "helpers" (layer_helper_checks.py), "ranks" (the cut on
    #: real data-parallel ranks) or "engine" (the whole way, each micro-batch through the engine)
    on: str = "cut"

    def __post_init__(self) -> None:
        if self.on not in ("cut", "helpers", "ranks", "engine"):
            raise ValueError(f"LayerCheck.on={self.on!r}: one of cut, helpers, ranks, engine")
        if (self.check is None) != (self.on in ("ranks", "engine")):
            raise ValueError(f"LayerCheck(check={self.check!r}, on={self.on!r}): a check names its vendored function "
                             "on the cut and the helpers, and only there")
