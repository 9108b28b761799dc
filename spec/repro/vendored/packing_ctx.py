"""What an invariant's check written out into a Megatron packing reproducer reads (:mod:`spec.repro.packing`): the
case, the device, the packer under test and the CP layouts it offers. Vendored before the check."""

from __future__ import annotations

from types import SimpleNamespace

#: what the file binds for this module: the case's fields, the packer, the layouts and the statement's ShardLayout
BOUND = ("CASE", "PACKER", "LAYOUTS", "ShardLayout")


class Ctx:
    """What the check reads: the case, the device, the packer and its layouts."""

    def __init__(self):
        self.case = SimpleNamespace(**CASE)
        self.device = "cpu"
        self.engine = SimpleNamespace(packer=PACKER, layouts=tuple(ShardLayout(v) for v in LAYOUTS))
