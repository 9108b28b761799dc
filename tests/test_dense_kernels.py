"""impl/dense.py: the jagged kernels and the index fallback (used where torch lacks the
CPU kernels, e.g. torch 2.4) agree, including truncation, padding values and trailing dims."""

from __future__ import annotations

import pytest
import torch

import impl.dense as dense


@pytest.fixture(params=["kernel", "fallback"])
def path(request, monkeypatch):
    if request.param == "fallback":
        monkeypatch.setattr(dense, "_has_kernel", lambda *args: False)
    elif not dense._has_kernel("cpu", "_jagged_to_padded_dense_forward"):
        pytest.skip("this torch has no CPU jagged kernels")
    return request.param


@pytest.mark.parametrize("rest", [(), (3,)])
def test_jagged_to_padded(path, rest) -> None:
    values = torch.arange(10 * (rest[0] if rest else 1), dtype=torch.float32).view(10, *rest)
    offsets = torch.tensor([0, 5, 6, 10])
    out = dense.jagged_to_padded(values, offsets, 3, -1.0)
    assert out.shape == (3, 3, *rest)
    assert torch.equal(out[0], values[0:3])  # cut to the width
    assert torch.equal(out[1, :1], values[5:6]) and bool((out[1, 1:] == -1).all())
    assert torch.equal(out[2], values[6:9])


def test_padded_to_jagged(path) -> None:
    padded = torch.arange(24).view(3, 4, 2)
    out = dense.padded_to_jagged(padded, torch.tensor([0, 2, 2, 5]), 5)
    assert out.tolist() == [[0, 1], [2, 3], [16, 17], [18, 19], [20, 21]]


def test_paths_agree_on_random_input(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 9, (17,), generator=gen)
    offsets = torch.nn.functional.pad(lens.cumsum(0), (1, 0))
    values = torch.randn(int(offsets[-1]), 2, generator=gen)
    fast = dense.jagged_to_padded(values, offsets, 6, 0.0), dense.padded_to_jagged(
        torch.randn(17, 9, 2, generator=gen), offsets, int(offsets[-1]))
    monkeypatch.setattr(dense, "_has_kernel", lambda *args: False)
    gen = torch.Generator().manual_seed(0)
    torch.randint(0, 9, (17,), generator=gen), torch.randn(int(offsets[-1]), 2, generator=gen)
    slow = dense.jagged_to_padded(values, offsets, 6, 0.0), dense.padded_to_jagged(
        torch.randn(17, 9, 2, generator=gen), offsets, int(offsets[-1]))
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
