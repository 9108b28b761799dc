"""A micro-batch reproducer's main (:mod:`spec.repro.minibatch`): loads the saved mini-batch, runs the file's
``check``, exits 1 printing what was wrong, 0 when right. Vendored last."""

from __future__ import annotations

import sys

import torch

#: what the file binds for this module: the invariant, the saved mini-batch, the check and what it raises
BOUND = ("MINI", "check", "Wrong", "verdict")


def main():
    mini = torch.load(MINI, weights_only=False)
    try:
        problem = check(mini)
    except Wrong as exc:
        problem = str(exc)
    except Exception as exc:  # noqa: BLE001 - the layer raised on a case it must take: wrong, as the header says
        problem = f"raised {type(exc).__name__}: {exc}; expected a result on this case"
    return verdict(problem, "this mini-batch")


if __name__ == "__main__":
    sys.exit(main())
