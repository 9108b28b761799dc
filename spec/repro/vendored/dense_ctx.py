"""What an invariant's check written out into a dense-batch reproducer reads (:mod:`spec.repro.dense`): the case,
the device, and the engine's padding helpers the file imports. Vendored before the check."""

from __future__ import annotations

from types import SimpleNamespace

#: what the file binds for this module: the case's fields and the helpers it imports
BOUND = ("CASE", "HELPERS")


def replace(case, **changes):
    return SimpleNamespace(**{**vars(case), **changes})


class Ctx:
    """What the check reads: the case, the device, the engine's helpers."""

    def __init__(self):
        self.case = SimpleNamespace(**CASE)
        self.device = "cpu"
        self.engine = SimpleNamespace(lacks=lambda name: None if name in HELPERS else f"no {name}")

    def helper(self, name):
        return globals()[name]
