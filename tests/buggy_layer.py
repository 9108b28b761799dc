"""Micro-batch layer functions with a bug each, at module level (as an engine's own layer is), for
tests/test_repro_minibatch.py: a reproducer imports them by module and name, without the suite."""

from __future__ import annotations

import torch

from impl.microbatch.batches import prepare_micro_batches as _prepare
from impl.microbatch.batches import restore_dynamic_batch as _restore


def restore_dynamic_batch(data, batch_idx_list):
    """Without grad the results stay in micro-batch order (an evaluation fast path that skips the restore)."""
    return _restore(data, batch_idx_list) if torch.is_grad_enabled() else data


def prepare_micro_batches(data, *args, **kwargs):
    """The last micro-batch's index list loses its last sample (the micro-batch itself keeps it)."""
    micro, indices = _prepare(data, *args, **kwargs)
    if indices is not None and len(indices[-1]) > 1:
        indices = [list(part) for part in indices]
        indices[-1] = indices[-1][:-1]
    return micro, indices
