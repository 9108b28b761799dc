"""Environment guards: the torch/tensordict that tox (or CI) meant to test is the one imported.

tox sets ``SPEC_EXPECT_TORCH`` / ``SPEC_EXPECT_TENSORDICT`` per environment (e.g. ``2.4.0``);
without them the version checks skip.
"""

from __future__ import annotations

import importlib
import inspect
import os

import pytest


@pytest.mark.parametrize(("module", "variable"), [("torch", "SPEC_EXPECT_TORCH"),
                                                  ("tensordict", "SPEC_EXPECT_TENSORDICT")])
def test_expected_version(module: str, variable: str) -> None:
    expected = os.environ.get(variable)
    if not expected:
        pytest.skip(f"{variable} is not set (tox sets it per environment)")
    installed = importlib.import_module(module).__version__
    actual = str(installed).split("+", 1)[0]  # drop the local suffix: 2.13.0+cpu -> 2.13.0
    assert actual == expected, (
        f"{module} {installed} is installed but {variable}={expected}: the environment did not "
        f"install the pinned {module} (a stale tox env? rebuild it with `tox -r`)")


def test_impl_imports_and_torch_has_jagged_dim() -> None:
    import torch

    import impl  # noqa: F401

    factory = getattr(torch.nested, "nested_tensor_from_jagged", None)
    assert factory is not None, (
        f"torch {torch.__version__} has no torch.nested.nested_tensor_from_jagged: impl needs torch >= 2.4")
    assert "jagged_dim" in inspect.signature(factory).parameters, (
        f"torch {torch.__version__}'s nested_tensor_from_jagged has no jagged_dim parameter "
        "(needed for mRoPE (B, 4, j) position_ids): impl needs torch >= 2.4")
