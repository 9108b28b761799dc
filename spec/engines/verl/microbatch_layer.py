"""verl's micro-batch layer as the installed verl ships it (every verl engine calls the same functions:
``prepare_micro_batches``, ``postprocess_batch_func``, the seqlen balancing and TensorDict utilities), probed by import
and name, never by version.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

import torch

from ...protocol.microbatch import MicroBatchLayer, layer_from

__all__ = ["MICROBATCH_MODULES", "verl_microbatch_layer"]

#: where the installed verl keeps its micro-batch layer (0.9.1; a module an older verl lacks is skipped)
MICROBATCH_MODULES = ("verl.workers.engine.utils", "verl.utils.seqlen_balancing", "verl.utils.tensordict_utils")


def verl_microbatch_layer() -> MicroBatchLayer | None:
    """The installed verl's own micro-batch functions, probed by import and name (never by version): every verl
    engine calls these same functions (``prepare_micro_batches``, ``postprocess_batch_func``)."""
    sources = []
    for name in MICROBATCH_MODULES:
        try:
            sources.append(importlib.import_module(name))
        except ImportError:
            continue
    if not sources:
        return None
    layer = layer_from("verl", sources)
    if not layer.functions:
        return None
    balancing = next((m for m in sources if m.__name__ == "verl.utils.seqlen_balancing"), None)
    cutters = {name: _cpu_collectives(layer.functions[name], balancing)
               for name in ("prepare_micro_batches", "rearrange_micro_batches") if name in layer.functions}
    return layer.with_functions("verl", **cutters) if balancing is not None else layer


def _cpu_collectives(fn: Callable, balancing: Any) -> Callable:
    """verl's ``rearrange_micro_batches`` puts the tensors of its data-parallel ``all_reduce`` on
    ``get_device_name()``, which on a machine without an accelerator still answers ``"cuda"`` (verl's platform
    fallback is 'nvidia'). On such a machine the call runs with that module's ``get_device_name`` answering
    ``"cpu"``, the device of the gloo group the suite's real ranks use; nothing else changes, and with an
    accelerator the function is verl's own, untouched."""
    if torch.cuda.is_available() or not callable(getattr(balancing, "get_device_name", None)):
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        saved = balancing.get_device_name
        balancing.get_device_name = lambda: "cpu"
        try:
            return fn(*args, **kwargs)
        finally:
            balancing.get_device_name = saved

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
