"""The standalone reproducer of INV-MB-015 (end to end: the micro-batch layer's cut, the engine on every
micro-batch, the layer's ``postprocess_batch_func``, against the per-sequence float64 reference).

The file is the engine-case reproducer's runtime (:mod:`.runtime` and the suite's stand-in model and hand-off,
written beside it by :func:`.templates.write_beside`; the engine built as its adapter does, the float64 reference)
joined with the micro-batch reproducer's (:mod:`.minibatch`: the shrunk mini-batch saved as a ``.pt`` beside it, the layer's own functions imported by module
and name, or a planted wrapper's factory written out). It cuts the mini-batch with the layer's
``prepare_micro_batches``, runs every micro-batch through one engine object (as a trainer keeps it) with the
micro-batch's samples as its case, joins the outputs with ``postprocess_batch_func`` (or the layer's
``concat_nested_tensors`` and ``restore_dynamic_batch``), and compares every sample's outputs with the reference of
the whole mini-batch in its own place. It exits 1 printing got vs expected (or what the layer or engine raised), 0
when right.
"""

from __future__ import annotations

import inspect
import pprint
from pathlib import Path
from typing import Any, Callable

import torch

from ..cases.microbatch import MiniBatchCase, materialize_minibatch, micro_batch_rows
from ..engines.impl.adapter import ImplEngine
from ..execute.pickling import save
from ..invariants.microbatch import refusable_case
from ..protocol.engine import ReproSnippet
from .micro_batch import case_data, declarations
from ..protocol.vendor import source
from .minibatch import case_dict, layer_imports, plain_minibatch
from .plans import layer_checks
from .templates import LOADER, PREAMBLE, SHARE, engine_block, write_beside
from .vendored import end_to_end_main, failure, layer_call

__all__ = ["END_TO_END", "layer_bug_only", "write_end_to_end_reproducer"]

END_TO_END, = layer_checks("engine")


def layer_bug_only(engine: Any) -> bool:
    """Whether ``engine`` is impl with a bug planted in its micro-batch layer alone (its engine is impl's own)."""
    bug = getattr(engine, "bug", None)
    return isinstance(engine, ImplEngine) and bug is not None and bug.microbatch is not None and not (
        bug.lm or bug.value or bug.helpers or bug.packer or bug.config or bug.precision or bug.companion)


def write_end_to_end_reproducer(path: Path, header: str, engine: Any, snippet: ReproSnippet | None,
                                functions: dict[str, Callable[..., Any]], case: MiniBatchCase,
                                factory: Any = None) -> str | None:
    """Write ``path`` (and its ``.pt``); returns why it is not standalone, or None."""
    if snippet is None:
        return f"engine {engine.name} cannot be built standalone for the mini-batch's engine case"
    if refusable_case(case):
        return "the layer may refuse this mini-batch (INV-MB-003/004/006 check that), INV-MB-015 does not run it"
    names = ("prepare_micro_batches", "postprocess_batch_func") if functions.get("postprocess_batch_func") else (
        "prepare_micro_batches", "concat_nested_tensors", "restore_dynamic_batch")
    imports, why = layer_imports(functions, names, factory)
    if why:
        return why
    save(plain_minibatch(materialize_minibatch(case, "cpu")), path.with_suffix(".pt"))
    write_beside(path.parent)
    path.write_text("\n".join([
        header, PREAMBLE, "import pickle", LOADER, engine_block(snippet),
        "# ---- the engine's micro-batch layer ----", imports, "",
        f"INVARIANT = {END_TO_END!r}", "CHECK_NAMES = []", "POISON = 'nan'", "KEYS = []",
        declarations(engine),
        "DATA = None", "RUNS = []", "",
        "# the mini-batch's settings (the cut) and its samples as one engine case (the reference)",
        "CASE = " + pprint.pformat(case_dict(case), width=120, sort_dicts=False),
        "WHOLE = " + pprint.pformat(case_data(case.engine_case()), width=120, sort_dicts=False),
        "MINI = Path(__file__).with_suffix('.pt')", "", SHARE, "",
        inspect.getsource(micro_batch_rows), source(failure), source(layer_call), source(end_to_end_main)]))
    return None
