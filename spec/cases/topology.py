"""Process topologies on real ranks: which global ranks form each sequence-parallel (SP) group.

A trainer runs data parallelism x sequence parallelism: ``dp`` SP groups of ``sp`` ranks each, in a world of
at least ``dp * sp`` ranks. A group need not start at global rank 0, a rank's rank within its group
(``dist.get_rank(group)``, what Ulysses slices by) need not equal its global rank, and the groups may
interleave (SP outermost in the device mesh: group ``g`` is ranks ``g, g + dp, g + 2 dp, ...``).

:class:`Topology` names the groups' global ranks (each group in ascending order, as ``torch.distributed``
ranks a group's members); ``None`` on a case is the simplest one, one group ``[0, sp)``, where global and
group ranks agree. Every group runs its own micro-batch: the case's structure with its own seed
(:meth:`Topology.group_case`), so a rank that reads another group's data, or slices by its global rank,
shows. :func:`topologies` draws one (for a given ``sp``, or of any group size) within a pool of ranks; it
shrinks to ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


__all__ = ["Topology", "layouts"]


@dataclass(frozen=True)
class Topology:
    """The SP groups of one real-rank run, as tuples of global ranks (group ``g`` is ``groups[g]``)."""

    groups: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        groups = tuple(tuple(int(r) for r in g) for g in self.groups)
        object.__setattr__(self, "groups", groups)
        if not groups or any(not g for g in groups):
            raise ValueError(f"a topology needs at least one non-empty SP group, got {list(map(list, groups))}")
        if len({len(g) for g in groups}) != 1:
            raise ValueError(f"SP groups of one topology have one size, got sizes {[len(g) for g in groups]} "
                             f"in {list(map(list, groups))}")
        flat = [r for g in groups for r in g]
        if min(flat) < 0 or len(set(flat)) != len(flat):
            raise ValueError(f"SP groups must be disjoint sets of ranks >= 0, got {list(map(list, groups))}")
        if any(list(g) != sorted(g) for g in groups):
            raise ValueError(f"each SP group lists its global ranks in ascending order (its members' group ranks "
                             f"0, 1, ...), got {list(map(list, groups))}")

    @classmethod
    def single(cls, sp: int) -> "Topology":
        """The simplest topology: one group ``[0, sp)`` (what ``topology=None`` means)."""
        return cls((tuple(range(sp)),))

    @property
    def sp(self) -> int:
        return len(self.groups[0])

    @property
    def dp(self) -> int:
        return len(self.groups)

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every global rank that runs a group, ascending."""
        return tuple(sorted(r for g in self.groups for r in g))

    @property
    def world(self) -> int:
        """The ranks the world must have (the highest global rank + 1); ranks in no group idle."""
        return max(self.ranks) + 1

    @property
    def layout(self) -> str:
        """``single`` (one group [0, sp)), ``shifted`` (one group elsewhere), ``contiguous`` or ``interleaved``."""
        if self.dp == 1:
            return "single" if self.groups[0] == tuple(range(self.sp)) else "shifted"
        if all(g[k + 1] - g[k] == 1 for g in self.groups for k in range(self.sp - 1)):
            return "contiguous"
        return "interleaved"

    def group_of(self, rank: int) -> int | None:
        """The index of the group global ``rank`` belongs to (None: it idles)."""
        return next((i for i, g in enumerate(self.groups) if rank in g), None)

    def group_case(self, case: Any, group: int) -> Any:
        """The :class:`~spec.cases.structure.EngineCase` group ``group`` runs: the same structure, its own seed
        (group 0 runs ``case`` itself)."""
        return case if group == 0 else case.with_(seed=int(case.seed) + group)

    def __repr__(self) -> str:
        return repr([list(g) for g in self.groups])


def layouts(sp: int, pool: int) -> list[Topology]:
    """Every topology of ``sp``-rank groups within ``pool`` ranks the strategies draw, the simplest first: one
    group ``[first, first + sp)``, then ``dp >= 2`` groups contiguous or interleaved from rank 0."""
    out = [Topology((tuple(range(first, first + sp)),)) for first in range(pool - sp + 1)]
    for dp in range(2, pool // sp + 1):
        ranks = list(range(dp * sp))
        out.append(Topology(tuple(tuple(ranks[g * sp:(g + 1) * sp]) for g in range(dp))))
        out.append(Topology(tuple(tuple(ranks[g::dp]) for g in range(dp))))
    return out
