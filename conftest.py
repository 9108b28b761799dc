"""Suite-wide options: the hypothesis profile, the engine under test, the devices.

``HYPOTHESIS_PROFILE`` picks the profile (default, dev, ci, cuda, debug).
``--engine NAME`` picks the engine (impl, verl, planted:<bug>, or module:attr; repeatable).
``--device`` restricts the devices (default: cpu and cuda; cuda tests skip without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

# Every test measures on its own empty example database (never the working directory's, never one a user
# configured): subprocesses a test starts get a fresh in-memory one each (unless the test names another),
# and each test in this process gets a fresh one (the fixture below). Replay of a shared database is
# tested explicitly (tests/test_example_db.py, tests/test_fuzz.py) on databases those tests create.
os.environ["SPEC_EXAMPLE_DB"] = ":memory:"

from hypothesis.database import InMemoryExampleDatabase  # noqa: E402

from spec.run.profiles import load_profile, use_database  # noqa: E402

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
def _isolated_example_database() -> None:
    """A fresh, empty in-memory example database for every test (see the top of this file)."""
    use_database(InMemoryExampleDatabase(), PROFILE)


@pytest.fixture(autouse=True)
def _skip_cuda_without_gpu(request: pytest.FixtureRequest) -> None:
    device = request.node.callspec.params.get("device") if hasattr(request.node, "callspec") else None
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
