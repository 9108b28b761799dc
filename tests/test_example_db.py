"""The shared example database (spec/run/database.py): one setting, SPEC_EXAMPLE_DB, and replay.

Two worker processes share one database: worker 1 (a writer profile with its own seed) finds a
planted bug and saves it; worker 2, under the derandomized ``ci`` profile, replays it as its first
and only case, through a read-only view that leaves the database unchanged. A control ``ci``
run on an empty database needs many cases to find the same bug, so the replay is what made it
immediate. The test runs on a directory database always, and on a real Redis server when one can
be had: ``$SPEC_TEST_REDIS_URL`` (``.ci/run`` starts one), else a ``redis-server`` it starts and
stops itself; without either it skips the Redis run and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import Verbosity
from hypothesis.database import DirectoryBasedExampleDatabase, ReadOnlyDatabase

from spec.run.database import DatabaseUnavailable, KeepFailures, check_reachable, example_database, replay_database
from spec.run.registry import load_engine
from spec.invariants import CATALOGUE
from spec.run.runner import run_invariant

ROOT = Path(__file__).resolve().parents[1]
#: A bug the derandomized ci profile needs dozens of cases to find (its minimal case is an mRoPE
#: batch), so a first-example failure can only come from the database.
BUG = ("INV-DENSE-002", "any", "planted:left_right_as_nested_positions")


def worker(profile: str, database: str, seed: int | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "HYPOTHESIS_PROFILE")}
    env.update(SPEC_EXAMPLE_DB=database, PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore")
    args = [sys.executable, "-m", "tests.db_worker", profile, *BUG] + ([str(seed)] if seed is not None else [])
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_redis(url: str, seconds: float = 15.0) -> None:
    import redis

    client, until = redis.Redis.from_url(url), time.time() + seconds
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if time.time() > until:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def redis_url():
    """A Redis database: .ci/run's server ($SPEC_TEST_REDIS_URL), else one started (and stopped) here."""
    pytest.importorskip("redis", reason="the redis package is not installed (pip install -e '.[test]')")
    import redis

    url = os.environ.get("SPEC_TEST_REDIS_URL")
    proc = None
    if not url:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip("redis-server not installed (apt-get install redis-server): "
                        "only the directory-database run of the two-worker replay test ran")
        url = f"redis://127.0.0.1:{free_port()}/0"
        proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", url.rsplit(":", 1)[1].split("/")[0],
                                 "--save", "", "--appendonly", "no", "--daemonize", "no"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_redis(url)
        redis.Redis.from_url(url).flushdb()
        yield url
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=15)


def _redis_snapshot(url: str) -> dict:
    import redis

    client = redis.Redis.from_url(url)
    return {key: client.smembers(key) for key in client.scan_iter()}


def _directory_snapshot(path: Path) -> list:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@pytest.mark.parametrize("backend", ["directory", "redis"])
def test_two_workers_share_the_database(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if backend == "redis":
        database = request.getfixturevalue("redis_url")
        snapshot = lambda: _redis_snapshot(database)  # noqa: E731
    else:
        database = str(tmp_path / "examples")
        snapshot = lambda: _directory_snapshot(Path(database))  # noqa: E731

    found = worker("default", database, seed=1)  # worker 1: a writer with its own seed stream
    assert found["status"] == "fail" and found["database"].startswith(backend), found
    saved = snapshot()
    assert saved, f"worker 1 saved nothing in {database}"

    if backend == "directory":  # a writer run on an engine that passes the saved case deletes nothing
        impl = run_invariant(CATALOGUE[BUG[0]], load_engine("impl"), BUG[1], profile="default",
                             database=example_database(database), verbosity=Verbosity.quiet, max_examples=3)
        assert impl.status == "pass" and snapshot() == saved, impl

    replay = worker("ci", database)  # worker 2: the derandomized ci profile
    assert replay["derandomize"] and replay["database"] == f"read-only {found['database']}", replay
    assert replay["status"] == "fail" and replay["counterexample"] == found["counterexample"], replay
    # its first case was the saved failure, and no other case ran: the 2 examples are that case and
    # hypothesis's final re-run of it for the report
    assert replay["distinct_cases"] == 1 and replay["examples"] <= 2, replay
    assert snapshot() == saved, "the ci profile wrote to the database"

    if backend == "directory":  # the control (in this process): the ci profile on an empty database
        missing = tmp_path / "never-created"
        info, mode, engine = CATALOGUE[BUG[0]], BUG[1], load_engine(BUG[2])
        control = run_invariant(info, engine, mode, profile="ci", database=replay_database(str(missing)),
                                verbosity=Verbosity.quiet)
        assert control.status == "fail" and control.distinct_cases > 5, control
        assert not missing.exists(), "a read-only run created the database directory"


def test_setting_selects_the_database(tmp_path: Path) -> None:
    configured = example_database(str(tmp_path))
    assert isinstance(configured, KeepFailures) and isinstance(configured._db, DirectoryBasedExampleDatabase)
    configured.save(b"k", b"v")
    configured.delete(b"k", b"v")  # a configured (shared) database never loses a saved failure
    assert list(configured.fetch(b"k")) == [b"v"]
    assert example_database("").path == Path(".hypothesis/examples")
    assert example_database("none") is None and replay_database("none") is None
    view = replay_database(str(tmp_path / "absent"))
    assert isinstance(view, ReadOnlyDatabase) and list(view.fetch(b"k")) == []
    view.save(b"k", b"v")
    assert not (tmp_path / "absent").exists()
    both = example_database(f"{tmp_path / 'a'}, {tmp_path / 'b'}")  # writes go to each, reads merge
    both.save(b"k", b"v")
    assert list(example_database(str(tmp_path / "b")).fetch(b"k")) == [b"v"]
    assert list(replay_database(f"{tmp_path / 'absent'},{tmp_path / 'a'}").fetch(b"k")) == [b"v"]
    with pytest.raises(ValueError, match="SPEC_EXAMPLE_DB"):
        example_database("ftp://host/db")
    with pytest.warns(UserWarning, match="replays no saved failures"):
        assert replay_database("ftp://host/db") is None


def test_unreachable_redis_never_breaks_a_ci_run() -> None:
    pytest.importorskip("redis", reason="the redis package is not installed")
    from hypothesis.extra.redis import RedisExampleDatabase

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    writer = example_database(url)
    assert isinstance(writer, KeepFailures) and isinstance(writer._db, RedisExampleDatabase)
    with pytest.raises(DatabaseUnavailable, match="unreachable"):
        check_reachable(writer)
    reader = replay_database(url)
    with pytest.warns(UserWarning, match="unreadable"):
        assert list(reader.fetch(b"key")) == []
