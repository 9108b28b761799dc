"""How a micro-batch reproducer calls the layer (``INV-MB-*``; :mod:`spec.repro.minibatch`, :mod:`spec.repro.dp_layer`,
:mod:`spec.repro.end_to_end`): in the case's autograd context, ``prepare_micro_batches`` with the case's settings.
Vendored after the file's constants and the engine's layer functions."""

from __future__ import annotations

import torch

#: what the file binds for this module: the case and the layer's own prepare_micro_batches
BOUND = ("CASE", "prepare_micro_batches")


def context():
    return {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[CASE["context"]]()


def cut(mini, **group):
    """The layer's micro-batches of ``mini`` and their index lists (``group``: the data-parallel group's keywords)."""
    with context():
        micro, indices = prepare_micro_batches(
            mini, num_batches_divided_by=CASE["num_batches_divided_by"], min_num_micro_batch=CASE["min_num_micro_batch"],
            use_dynamic_bsz_balance=CASE["balance"], **group)
    return list(micro), indices


def samples(value):
    return [t for t in value.unbind()] if value.is_nested else list(value)
