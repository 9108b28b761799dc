"""Environment guards: the torch/tensordict that tox (or CI) meant to test is the one imported.

tox sets ``SPEC_EXPECT_TORCH`` / ``SPEC_EXPECT_TENSORDICT`` per environment (e.g. ``2.4.0``);
without them the version checks skip.
"""

from __future__ import annotations

import importlib
import inspect
import os
from pathlib import Path

import pytest

import tests


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


# --------------------------------------------------------------------------- what torch 2.4 does differently
# Each test forces the torch 2.4 path on any torch, so the `tests` CI step (torch 2.13) catches a regression of the
# floor; the torch24 step (.ci/steps.sh) runs them on 2.4 itself. The micro-batch layer's: tests/test_microbatch.py.

def test_the_all_gather_writes_normal_tensors_under_inference_mode(monkeypatch) -> None:
    """impl's TorchDistributedAllGather under torch.inference_mode(): gloo writes the gathered parts on its own
    thread, where torch 2.4 refuses an in-place update of an inference tensor (every real-rank run in the
    `inference_mode` context failed there); the parts must be normal tensors, the result what a gather gives."""
    import torch
    import torch.distributed as dist

    from impl.sequence_parallel import TorchDistributedAllGather

    written = []

    def all_gather(parts, local, group=None):
        written.extend(p.is_inference() for p in parts)
        for i, p in enumerate(parts):
            p.copy_(local + 10 * i)

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    with torch.inference_mode():
        out = TorchDistributedAllGather()(torch.arange(3.0).view(3, 1))
    assert written == [False, False]
    assert out.view(-1).tolist() == [0.0, 1.0, 2.0, 10.0, 11.0, 12.0]


def test_jagged_tensors_cross_the_rank_boundary_as_on_torch_24(monkeypatch) -> None:
    """The real-rank harness pickles micro-batches and replies; on torch 2.4 a jagged tensor whose shape was read
    does not pickle ("cannot pickle 'PyCapsule' object": every real-rank invariant failed there), so it is rebuilt
    from its parts: the ragged dim, rows and cached lengths survive (2.4's own reduction would make a (4, j)
    mRoPE tensor ragged at dim 1)."""
    import pickle

    import torch
    from tensordict import TensorDict

    from spec.execute import pickling, rank_worker

    monkeypatch.setattr(pickling, "_PICKLES_JAGGED", False)  # what the import finds on torch 2.4
    offsets = torch.tensor([0, 2, 5])
    positions = torch.nested.nested_tensor_from_jagged(torch.arange(20).view(4, 5), offsets, jagged_dim=2)
    ids = torch.nested.nested_tensor_from_jagged(torch.arange(5), offsets)
    assert positions.shape[1] == 4 and ids.shape[0] == 2  # the shape read: 2.4 caches a capsule on the tensor
    td = TensorDict({"position_ids": positions, "input_ids": ids}, batch_size=[2])
    back = pickle.loads(pickling.dumps({"micro_batch": td}))["micro_batch"]
    for key, before in td.items():
        after = back[key]
        assert after._ragged_idx == before._ragged_idx and after._max_seqlen == before._max_seqlen == 3, key
        assert [t.tolist() for t in after.unbind()] == [t.tolist() for t in before.unbind()], key
    with torch.inference_mode():  # an engine's output: a CPU tensor stays on the CPU (torch 2.4 has no .cpu() there)
        made = torch.nested.nested_tensor_from_jagged(torch.arange(5), offsets)
        safe = rank_worker._nested_safe({"x": made})["x"]
    assert safe.is_nested and safe.values().tolist() == list(range(5))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8", "bool"])
def test_tensors_cross_the_rank_boundary_with_what_a_check_reads(dtype) -> None:
    """A real-rank reply's CPU tensors travel as raw bytes (spec.execute.pickling): values bit for bit, dtype,
    shape, strides, storage offset, requires_grad, empty tensors, and jagged rows come back as they left."""
    import pickle

    import torch

    from spec.execute import pickling

    dt = getattr(torch, dtype)
    base = (torch.randn(5, 7, generator=torch.Generator().manual_seed(0)) * 9).to(dt)
    view = base.t()[2:]  # strided, offset
    empty = torch.empty(0, 3, dtype=dt)
    leaf = torch.randn(3, dtype=torch.float32, requires_grad=True)
    jagged = torch.nested.nested_tensor_from_jagged(base.flatten()[:6], torch.tensor([0, 2, 6]))
    back = pickle.loads(pickling.dumps({"base": base, "view": view, "empty": empty, "leaf": leaf, "jagged": jagged}))
    for name, before in {"base": base, "view": view, "empty": empty}.items():
        after = back[name]
        assert after.dtype == before.dtype and after.shape == before.shape, name
        assert after.stride() == before.stride() and after.storage_offset() == before.storage_offset(), name
        assert torch.equal(after, before), name  # (no NaN drawn: equal is bit for bit here)
    assert back["leaf"].requires_grad and torch.equal(back["leaf"], leaf)
    assert [t.tolist() for t in back["jagged"].unbind()] == [t.tolist() for t in jagged.unbind()]
    sent = base.clone()
    base.zero_()  # what arrived is the receiver's own copy
    assert torch.equal(back["base"], sent) and back["base"].any()


def test_tests_engines_import_from_this_repository_in_any_venv() -> None:
    """``tests.*`` engines (loaded by name: ``--engine tests.factory_engine:make_engine``) are this repository's, also
    in a venv where verl or OpenRLHF installed a ``tests`` package of its own: ours is a regular package."""
    assert tests.__file__ is not None, "tests/ is a namespace directory: a library's site-packages 'tests' wins over it"
    assert Path(tests.__file__).resolve().parent == Path(__file__).resolve().parent
