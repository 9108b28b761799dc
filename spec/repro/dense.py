"""Standalone reproducers for the dense trainer batch's invariants (a :class:`DenseCase`: INV-DENSE-001..007,
INV-MUT-003 on ``left_right_2_no_padding``, INV-RESP-001 on ``no_padding_2_padding``).

The file rebuilds the dense left-right padded batch from the case's structure and seed with the suite's
``materialize_dense`` written out (plain torch and tensordict), imports the engine's own padding helpers by module
and name (:func:`.imports.function_imports`), and runs the invariant's own check written out verbatim
(:func:`.imports.written_out`): its expected side is plain torch over the dense batch (each row's unmasked tokens,
positions, masks, teacher and router-replay rows, the response columns). ``ctx`` is a small stand-in with the
case, the device and the helpers. It exits 1 printing got vs expected, 0 when the helper is right.
"""

from __future__ import annotations

import dataclasses
import inspect
import pprint
from pathlib import Path
from typing import Any

from ..cases.structure import DenseCase
from ..protocol.engine import HELPERS, EngineUnderTest
from ..protocol.vendor import source
from .imports import function_imports, written_out
from .vendored import check_main, dense_ctx, failure

__all__ = ["case_fields", "write_dense_reproducer"]

#: names the written file defines itself (the checks' ``fail``, dataclasses' ``replace``, the imports)
PROVIDED = ("fail", "replace", "torch", "TensorDict", "Any")


def _literal(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str)) or (
        isinstance(value, tuple) and all(_literal(v) for v in value))


def _is_property(attr: Any) -> bool:
    return isinstance(attr, property)


def case_fields(case: Any) -> dict[str, Any]:
    """The case's fields and derived sizes (its properties) that are literals, as the written check reads them."""
    fields = {f.name: getattr(case, f.name) for f in dataclasses.fields(case)}
    derived = {name: getattr(case, name) for name, _ in inspect.getmembers(type(case), _is_property)}
    return {k: v for k, v in {**fields, **derived}.items() if _literal(v)}


def write_dense_reproducer(path: Path, header: str, invariant: str, check: Any, engine: EngineUnderTest,
                           case: DenseCase) -> str | None:
    """Write ``path``; returns why it is not standalone, or None."""
    code, why = written_out([check], PROVIDED)
    if why:
        return why
    names = [n for n in HELPERS if f'"{n}"' in code and engine.helper(n) is not None]
    if not names:
        return f"{invariant}'s check calls none of the engine's padding helpers ({', '.join(HELPERS)})"
    imports, why = function_imports({n: engine.helper(n) for n in names})
    if why:
        return why
    path.write_text("\n".join([
        header, "from __future__ import annotations", "", "import sys", "from types import SimpleNamespace", "from typing import Any", "", "import torch",
        "from tensordict import TensorDict", "", "# ---- the engine's helpers ----", imports, "",
        f"INVARIANT = {invariant!r}", f"HELPERS = {names!r}",
        "CASE = " + pprint.pformat(case_fields(case), width=120, sort_dicts=False), "",
        source(failure), source(dense_ctx),
        "# ---- the invariant's check and what it calls (the suite's, verbatim) ----", code, "",
        f"CHECK = {check.__name__}", "CAUGHT = Wrong", "CHECKED = 'this batch'", "", source(check_main)]))
    return None
