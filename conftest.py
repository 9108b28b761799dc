"""Suite-wide options: the hypothesis profile, the engine under test, the devices.

``HYPOTHESIS_PROFILE`` picks the profile (default, dev, ci, cuda, debug).
``--engine NAME`` picks the engine (impl, verl, planted:<bug>, or module:attr; repeatable).
``--device`` restricts the devices (default: cpu and cuda; cuda tests skip without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from spec.run.profiles import load_profile

PROFILE = load_profile()

# The suite's tensors are tiny: intra-op threads only contend with the xdist workers.
torch.set_num_threads(int(os.environ.get("SPEC_TORCH_THREADS", "1")))


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("spec", "engine conformance")
    group.addoption("--engine", action="append", default=None,
                    help="engine under test: impl (default), verl, planted:<bug>, or module:attr; repeatable")
    group.addoption("--device", action="append", default=None, choices=("cpu", "cuda"),
                    help="devices to run on (default: cpu and cuda; cuda skips without a GPU)")


def pytest_report_header(config: pytest.Config) -> list[str]:
    import tensordict
    import torch

    return [f"hypothesis profile: {PROFILE}; engines: {engine_names(config)}; devices: {device_names(config)}",
            f"torch {torch.__version__}, tensordict {tensordict.__version__}, "
            f"cuda available: {torch.cuda.is_available()}"]


def engine_names(config: pytest.Config) -> list[str]:
    return config.getoption("engine") or ["impl"]


def device_names(config: pytest.Config) -> list[str]:
    return config.getoption("device") or ["cpu", "cuda"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    if "instance" in metafunc.fixturenames:
        from spec.run.registry import load_engine
        from spec.run.runner import instances

        params, ids = [], []
        for name in engine_names(config):
            engine = load_engine(name)
            for info, mode in instances():
                for device in device_names(config):
                    params.append((info, engine, mode, device))
                    ids.append(f"{info.id}-{engine.name}-{mode}-{device}")
        metafunc.parametrize("instance", params, ids=ids)
    elif "device" in metafunc.fixturenames:
        metafunc.parametrize("device", device_names(config))


@pytest.fixture(autouse=True)
def _skip_cuda_without_gpu(request: pytest.FixtureRequest) -> None:
    device = request.node.callspec.params.get("device") if hasattr(request.node, "callspec") else None
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
