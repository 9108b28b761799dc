"""Standalone reproducers for the Megatron packing invariants (INV-MEG-001..005: ``engine.packer``, a
:class:`spec.truth.megatron_packing.Packer`; INV-MEG-006's vision-language micro-batch is not written out).

The file writes out the suite's statement of the packing (``spec/truth/megatron_packing.py``: ``PackSpec``,
``ThdShard``, the TP x CP alignment rule, ``nested_from``, and the ``ShardLayout`` of the protocol module it
imports, both importing nothing else of the suite), builds the packer as the adapter does, and runs the invariant's
own check written out verbatim (:func:`.imports.written_out`) over every TP x CP x layout the suite ran: its
expected side is plain arithmetic and torch over the batch the case's seed makes (the sequences themselves for a
round trip, ``arange`` positions, the next tokens, the alignment rule). The packer:

* verl's (``--engine verl-megatron``): the adapter's :class:`~spec.engines.megatron.adapter.VerlMegatronPacker` and
  :func:`~spec.engines.megatron.adapter.fake_parallel_state` written out (the faked ``megatron.core.parallel_state`` and the
  ``torch.distributed.all_gather`` answered from every rank's shard, as plain code), over
  ``verl.models.mcore.util`` imported by name (it needs verl and megatron-core);
* a packer class the suite defines in a module that imports only the statement (the planted packers,
  ``spec/planted/megatron_bugs.py``, and the reference packer): that module written out and the class built;
* anything else: not standalone, and the reason says why.

It exits 1 printing got vs expected (or what the packer raised, with the parallel setting), 0 when the packer is
right.
"""

from __future__ import annotations

import pprint
from pathlib import Path
from typing import Any

from ..engines.impl.adapter import ImplEngine
from ..engines.megatron.adapter import VerlMegatronPacker
from ..protocol.engine import EngineUnderTest, ShardLayout
from ..truth.megatron_packing import ReferencePacker
from .dense import case_fields
from ..protocol.vendor import source
from .imports import alias, inline_module, modules_code, written_out
from .vendored import check_main, failure, packing_ctx

__all__ = ["MEG_REQUIRES", "ReferencePackingEngine", "packer_requires", "write_packing_reproducer"]

TRUTH = "spec.truth.megatron_packing"
#: the statement's names the checks and the written-out packers read, bound from the written-out modules
STATEMENT = {"PackSpec": TRUTH, "ThdShard": TRUTH, "MtpTargets": TRUTH, "nested_from": TRUTH, "thd_alignment": TRUTH,
             "case_bucket": TRUTH, "full_loss_mask": TRUTH, "ShardLayout": "spec.protocol.engine"}
#: names the written file defines itself
PROVIDED = (*STATEMENT, "fail", "torch", "Any")
#: what verl's packer needs installed besides torch and tensordict
MEG_REQUIRES = "verl megatron-core"


class ReferencePackingEngine(ImplEngine):
    """impl with the suite's reference packer: the correct twin of a planted packer."""

    name = "reference-packer"
    layouts = tuple(ShardLayout)

    def __init__(self) -> None:
        super().__init__()
        self.packer = ReferencePacker()


def packer_requires(engine: EngineUnderTest) -> str:
    return MEG_REQUIRES if isinstance(getattr(engine, "packer", None), VerlMegatronPacker) else ""


def _packer_code(packer: Any, modules: dict[str, str]) -> tuple[str | None, str | None]:
    """Code binding ``PACKER`` to the engine's packer, built as its adapter builds it (``modules``: the suite
    modules written out so far, extended here)."""
    cls = type(packer)
    if isinstance(packer, VerlMegatronPacker):
        code, why = written_out([cls], PROVIDED)
        if why:
            return None, why
        util = packer.util.__name__
        return "\n".join([code, "", "import importlib", "", "# the engine's own module, as the adapter calls it",
                          f"PACKER = {cls.__name__}(importlib.import_module({util!r}))"]), None
    if cls.__init__ is not object.__init__ or "<" in cls.__qualname__ or "." in cls.__qualname__:
        return None, f"the packer {cls.__qualname__} is not built without arguments from a module-level class"
    _, why = inline_module(cls.__module__, modules)
    if why:
        return None, f"the packer {cls.__qualname__} is defined by the suite: {why}"
    return f"PACKER = {alias(cls.__module__)}.{cls.__qualname__}()", None


def write_packing_reproducer(path: Path, header: str, invariant: str, check: Any, engine: EngineUnderTest,
                             case: Any) -> str | None:
    """Write ``path``; returns why it is not standalone, or None."""
    packer = getattr(engine, "packer", None)
    if packer is None:
        return f"engine {engine.name} has no packer (Feature.PACKING)"
    if getattr(case, "media", ()):
        return (f"{invariant} runs the case's vision-language micro-batch (spec.cases.materialize with its media "
                "draws), which the written-out case (its lengths, seed and sizes) does not carry")
    code, why = written_out([check], PROVIDED)
    if why:
        return why
    modules, why = inline_module(TRUTH)
    if why:
        return why
    packer_code, why = _packer_code(packer, modules)
    if why:
        return why
    bind = [f"{name} = {alias(module)}.{name}" for name, module in STATEMENT.items()]
    layouts = [ShardLayout(layout).value for layout in engine.layouts]
    path.write_text("\n".join([
        header, "from __future__ import annotations", "", "import sys", "from types import SimpleNamespace",
        "from typing import Any", "", "import torch", "",
        "# ---- the suite's statement of the packing (spec/truth/megatron_packing.py), written out ----",
        *modules_code(modules), *bind, "",
        "# ---- the packer under test (begin) ----", packer_code, "# ---- the packer under test (end) ----", "",
        f"INVARIANT = {invariant!r}",
        "CASE = " + pprint.pformat(case_fields(case), width=120, sort_dicts=False),
        f"LAYOUTS = {layouts!r}  # the CP layouts the engine offers (the suite ran each)", "",
        source(failure), source(packing_ctx),
        "# ---- the invariant's check and what it calls (the suite's, verbatim) ----", code, "",
        f"CHECK = {check.__name__}",
        "CAUGHT = AssertionError  # the check's, or the packer's own (every CP rank must re-assemble the same)",
        "CHECKED = 'this case'", "", source(check_main)]))
    return None
