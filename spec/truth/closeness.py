"""How a check compares values: ``|actual - want| <= atol + rtol * |want|``, naming the first bad index. Shared by the
invariants and the check cores a standalone reproducer runs too (spec/truth/outputs_checks.py)."""

from __future__ import annotations

import torch

from .failing import fail

__all__ = ["ATOL", "RTOL", "close"]

ATOL = 1e-4
RTOL = 1e-4


def close(actual: torch.Tensor, want: torch.Tensor, what: str, *, atol: "float | torch.Tensor" = ATOL,
          rtol: float = RTOL, nan_equal: bool = False) -> None:
    """Assert ``actual`` ≈ ``want`` (same shape): ``|actual - want| <= atol + rtol * |want|`` with ``atol``
    a float or a per-element tensor; NaN is never close, unless ``nan_equal`` (two runs compared: NaN in both at
    the same place agree); names the first bad index."""
    actual = actual.detach().to("cpu", torch.float64)
    want = want.detach().to("cpu", torch.float64)
    if actual.shape != want.shape:
        fail(f"{what}: shape {tuple(actual.shape)}, expected {tuple(want.shape)}")
    if isinstance(atol, torch.Tensor):
        atol = atol.detach().to("cpu", torch.float64)
        rtol = 0.0  # the derived tolerance is absolute, per token
    same = actual == want  # equal infinities
    if nan_equal:
        same = same | (actual.isnan() & want.isnan())
    bad = ~(same | ((actual - want).abs() <= atol + rtol * want.abs()))
    if bool(bad.any()):
        idx = tuple(int(i) for i in bad.nonzero()[0])
        allowed = float(atol[idx]) if isinstance(atol, torch.Tensor) else atol + rtol * abs(want[idx].item())
        fail(f"{what}: at {idx} got {actual[idx].item():.8g}, expected {want[idx].item():.8g} "
             f"(|diff| {abs(actual[idx].item() - want[idx].item()):.3g} > allowed {allowed:.3g}; "
             f"{int(bad.sum())} of {bad.numel()} values differ)", index=idx)
