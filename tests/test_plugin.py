"""The pytest plugin runs the catalogue in another project's test session, against the example engine
and adapter of docs/writing-an-adapter.md (written into a temporary package outside this repository)."""

from __future__ import annotations

import json
import os
import re
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "writing-an-adapter.md"
BLOCK = re.compile(r"```python\n# (mypkg/[a-z_]+\.py)\n(.*?)```", re.S)


def doc_blocks() -> dict[str, str]:
    return {path: code for path, code in BLOCK.findall(DOC.read_text())}


def test_doc_holds_a_complete_small_adapter() -> None:
    blocks = doc_blocks()
    assert set(blocks) == {"mypkg/tiny_engine.py", "mypkg/adapter.py"}
    assert len(blocks["mypkg/adapter.py"].splitlines()) <= 60
    assert "spec.protocol" in blocks["mypkg/adapter.py"] and "import spec" not in blocks["mypkg/tiny_engine.py"]


@pytest.fixture(scope="module")
def user_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("user_repo")
    assert ROOT not in repo.parents
    (repo / "mypkg").mkdir()
    (repo / "mypkg" / "__init__.py").write_text("")
    for path, code in doc_blocks().items():
        (repo / path).write_text(code)
    # a planted bug in the user's engine: the padded attention mask from the response lengths (verl #6278)
    buggy = doc_blocks()["mypkg/tiny_engine.py"].replace(
        "mask = (torch.arange(width, device=lens.device) < lens.unsqueeze(1))",
        "mask = (torch.arange(width, device=lens.device) < (lens // 2 + 1).unsqueeze(1))")
    assert buggy != doc_blocks()["mypkg/tiny_engine.py"]
    (repo / "mypkg" / "buggy_engine.py").write_text(buggy)
    (repo / "mypkg" / "buggy_adapter.py").write_text(
        doc_blocks()["mypkg/adapter.py"].replace("mypkg.tiny_engine", "mypkg.buggy_engine"))
    (repo / "test_own.py").write_text("def test_own():\n    assert True\n")
    return repo


def run_pytest(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(repo)]), "PYTHONWARNINGS": "ignore"}
    env.pop("PYTEST_XDIST_WORKER", None)
    # After `pip install` the pytest11 entry point loads the plugin by itself (what a user's repo gets);
    # otherwise it is named with -p (a second registration would be a pytest usage error).
    load = [] if _entry_point_installed() else ["-p", "spec.pytest_plugin"]
    return subprocess.run([sys.executable, "-m", "pytest", *load, "-p", "no:cacheprovider",
                           "-q", "-rs", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=1800)


def _entry_point_installed() -> bool:
    return any(ep.value == "spec.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))


def test_catalogue_runs_in_the_users_session(user_repo: Path) -> None:
    run = run_pytest(user_repo, "--ioprep-engine", "mypkg.adapter:TinyAdapter", "--ioprep-profile", "dev",
                     "--ioprep-only", "INV-MASK,INV-VAL-001,INV-KEYS-001,INV-LABEL-001,INV-SP-001,INV-DEV",
                     "--ioprep-report", "out", "test_own.py")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert "ioprep: " in run.stdout and "1 passed" not in run.stdout.splitlines()[-1]
    report = json.loads((user_repo / "out" / "verify-tiny.json").read_text())
    statuses = {o["status"] for o in report["outcomes"]}
    assert statuses <= {"pass", "skip"}, statuses
    passed = {o["invariant"] for o in report["outcomes"] if o["status"] == "pass"}
    assert {"INV-MASK-001", "INV-VAL-001", "INV-KEYS-001", "INV-LABEL-001"} <= passed
    skipped = {o["invariant"]: o["reason"] for o in report["outcomes"] if o["status"] == "skip"}
    assert "INV-SP-001" in skipped and "tiny has no sp" in skipped["INV-SP-001"]
    assert (user_repo / "out" / "verify-tiny.md").read_text().startswith("# Conformance report: engine `tiny`")


#: the catalogue in shards (ID prefixes), so that pytest-xdist spreads the worked example's full ``ci`` run over its
#: workers (one run of the whole catalogue was the suite's longest test by far, and its last one); "rest" holds every
#: family not named, so a new family runs there
WORKED_EXAMPLE_SHARDS = {
    "ranks": ("INV-RANK", "INV-SP"),
    "batch": ("INV-BATCH", "INV-KEYS"),
    "values": ("INV-TEMP", "INV-VAL"),
    "state": ("INV-LEAK", "INV-SLICE", "INV-MUT"),
    "inputs": ("INV-LABEL", "INV-FLAG", "INV-MB"),
}


def _family(invariant: str) -> str:
    return "-".join(invariant.split("-")[:2])


def _shard_prefixes(shard: str) -> tuple[str, ...]:
    if shard != "rest":
        return WORKED_EXAMPLE_SHARDS[shard]
    from spec.run.runner import instances

    named = {f for prefixes in WORKED_EXAMPLE_SHARDS.values() for f in prefixes}
    return tuple(sorted({_family(info.id) for info, _ in instances()} - named))


def test_the_worked_example_shards_cover_the_catalogue_once() -> None:
    from spec.run.runner import instances

    shards = [set(_shard_prefixes(s)) for s in (*WORKED_EXAMPLE_SHARDS, "rest")]
    families = {_family(info.id) for info, _ in instances()}
    assert set().union(*shards) == families and sum(map(len, shards)) == len(families)


@pytest.mark.parametrize("shard", [*WORKED_EXAMPLE_SHARDS, "rest"])
def test_worked_example_passes_the_full_ci_catalogue(user_repo: Path, shard: str) -> None:
    """The guide's adapter, as a user copies it, against every invariant of the catalogue under ``ci`` (no subset:
    the shards together are the whole catalogue): the session passes, nothing fails, and what it lacks is skipped
    with the adapter's reasons."""
    from spec.run.runner import instances

    prefixes = _shard_prefixes(shard)
    run = run_pytest(user_repo, "--ioprep-engine", "mypkg.adapter:TinyAdapter", "--ioprep-profile", "ci",
                     "--ioprep-only", ",".join(prefixes), "--ioprep-report", f"full-{shard}", "test_own.py")
    report = json.loads((user_repo / f"full-{shard}" / "verify-tiny.json").read_text())
    bad = {o["test_id"]: f"{o['counterexample']} -> {o['error']}" for o in report["outcomes"]
           if o["status"] not in ("pass", "skip", "unexercised")}
    assert run.returncode == 0 and not bad, (bad, run.stdout[-3000:])
    assert report["verdict"] == "pass"
    mine = [(info.id, mode) for info, mode in instances() if _family(info.id) in prefixes]
    assert sorted((o["invariant"], o["mode"]) for o in report["outcomes"]) == sorted(mine)  # the whole shard ran
    passed = {o["invariant"] for o in report["outcomes"] if o["status"] == "pass"}
    expected = {"INV-FLAG-003", "INV-FLAG-004", "INV-VAL-001", "INV-VAL-002", "INV-VAL-003", "INV-VAL-004",
                "INV-TEMP-001", "INV-SLICE-006", "INV-MASK-001", "INV-LEAK-001"}
    assert {i for i in expected if _family(i) in prefixes} <= passed
    # never a pass with no example exercised: only the packed leak checks, whose rows have no padding (TinyPrep
    # offers no bucket and no sequence parallelism), and they say so
    idle = {(o["invariant"], o["mode"]): o["reason"] for o in report["outcomes"] if o["status"] == "unexercised"}
    assert set(idle) <= {("INV-LEAK-001", "packed"), ("INV-LEAK-002", "packed")}, idle
    assert all("no padding to poison" in reason for reason in idle.values()), idle


def test_plugin_fails_a_buggy_user_engine(user_repo: Path) -> None:
    run = run_pytest(user_repo, "--ioprep-engine", "mypkg.buggy_adapter:TinyAdapter", "--ioprep-profile", "ci",
                     "--ioprep-only", "INV-MASK-001")
    assert run.returncode == 1, run.stdout[-3000:]
    assert "INV-MASK-001-tiny-padded-cpu" in run.stdout and "minimal counterexample: EngineCase(" in run.stdout


def test_plugin_is_inert_without_an_engine(user_repo: Path) -> None:
    run = run_pytest(user_repo, "test_own.py")
    assert run.returncode == 0 and "1 passed" in run.stdout and "ioprep" not in run.stdout


def _without_timings(path: Path) -> dict:
    """The report without timings, the distinct-case count and the coverage counts (the ``dev`` profile draws at
    random: two runs see duplicates, and each dimension's values, by chance)."""
    report = json.loads(path.read_text())
    report["outcomes"] = [{k: v for k, v in o.items() if k not in ("seconds", "distinct_cases", "coverage")}
                          for o in report["outcomes"]]
    report.pop("coverage", None)
    return report


def test_plugin_under_xdist_writes_the_one_process_report(user_repo: Path) -> None:
    """Distributed per test over xdist workers, the controller still writes the whole report, in catalogue
    order, equal to a run without xdist apart from the timings."""
    pytest.importorskip("xdist")
    only = ["--ioprep-engine", "mypkg.adapter:TinyAdapter", "--ioprep-profile", "dev",
            "--ioprep-only", "INV-MASK-001,INV-VAL-001,INV-KEYS-00,INV-SP-001"]
    one = run_pytest(user_repo, *only, "--ioprep-report", "out-one", "-p", "no:xdist")
    two = run_pytest(user_repo, *only, "--ioprep-report", "out-two", "-n", "2")
    assert one.returncode == 0 and two.returncode == 0, one.stdout[-2000:] + two.stdout[-2000:]
    assert "ioprep: " in two.stdout and "bringing up nodes" in two.stdout  # xdist ran it
    a, b = (_without_timings(user_repo / out / "verify-tiny.json") for out in ("out-one", "out-two"))
    assert len(a["outcomes"]) >= 6 and a == b


def test_two_engines_write_one_report_each(user_repo: Path) -> None:
    """``--ioprep-engine`` twice: each engine's report is titled with it and holds its own results only (the
    planted bug's failure in its report, impl's report passing)."""
    run = run_pytest(user_repo, "--ioprep-engine", "impl", "--ioprep-engine", "planted:loss_mask_attention",
                     "--ioprep-profile", "dev", "--ioprep-only", "INV-MASK-001", "--ioprep-report", "two")
    assert run.returncode == 1, run.stdout[-3000:]
    impl = json.loads((user_repo / "two" / "verify-impl.json").read_text())
    planted = json.loads((user_repo / "two" / "verify-planted-loss_mask_attention.json").read_text())
    assert {o["engine"] for o in impl["outcomes"]} == {"impl"} and impl["verdict"] == "pass"
    assert {o["engine"] for o in planted["outcomes"]} == {"planted:loss_mask_attention"}
    assert planted["verdict"] == "fail" and [o["status"] for o in planted["outcomes"]] == ["fail"]
    assert (user_repo / "two" / "verify-impl.md").read_text().startswith("# Conformance report: engine `impl`")
    assert (user_repo / "two" / "verify-planted-loss_mask_attention.md").read_text().startswith(
        "# Conformance report: engine `planted:loss_mask_attention`")
    assert "ioprep: impl: 1 passed, 0 failed" in run.stdout
    assert "ioprep: planted:loss_mask_attention: 0 passed, 1 failed" in run.stdout


@pytest.mark.parametrize("args, says", [
    (["--ioprep-engine", "planted:loss_mask_atention"],
     "unknown planted bug 'loss_mask_atention'; did you mean 'loss_mask_attention'?"),
    (["--ioprep-engine", "nope"], "unknown engine 'nope'"),
    (["--ioprep-engine", "impl", "--ioprep-profile", "cii"], "unknown hypothesis profile 'cii'; did you mean 'ci'?"),
    (["--ioprep-engine", "impl", "--ioprep-only", "INV-MSK"], "--only 'INV-MSK' matches no invariant ID"),
])
def test_a_bad_name_is_a_pytest_usage_error(user_repo: Path, args: list[str], says: str) -> None:
    run = run_pytest(user_repo, *args, "test_own.py")
    assert run.returncode == 4, run.stdout[-2000:] + run.stderr[-2000:]  # pytest's ExitCode.USAGE_ERROR
    assert f"ERROR: ioprep: {says}" in run.stderr, run.stderr[-2000:]
    assert "INTERNALERROR" not in run.stdout + run.stderr and "Traceback" not in run.stderr
