"""The example database, chosen by one setting: ``SPEC_EXAMPLE_DB``.

Hypothesis saves every failing example it finds under the test's database key (one key per
case stream, see ``spec.run.runner.stream_key``) and replays the saved ones before
drawing new cases. Where they are saved:

=====================================  =====================================================
``SPEC_EXAMPLE_DB``                    database
=====================================  =====================================================
unset or empty                         Hypothesis's own directory: ``examples`` under its storage
                                       directory (``$HYPOTHESIS_STORAGE_DIRECTORY``, else
                                       ``.hypothesis`` in the working directory)
``:memory:``                           a fresh in-memory database per process, empty at start
                                       (the project's tests use one per test, see conftest.py)
a path (``/srv/spec-db``)              that directory
``redis://host:port/db`` (``rediss``)  :class:`hypothesis.extra.redis.RedisExampleDatabase`
``github-artifact://owner/repo[/name]``  the nightly's uploaded directory, read only
                                       (:class:`hypothesis.database.GitHubArtifactDatabase`)
``none``                               no database
several, comma-separated               all of them (:class:`MultiplexedDatabase`): reads merge,
                                       writes go to each (the nightly: Redis + a directory)
=====================================  =====================================================

Writers (the ``default``/``dev``/``debug``/``cuda`` profiles, ``python -m spec fuzz``) read and
write it, and never delete from a configured one (:class:`KeepFailures`: the keys are the same
for every engine, so a run on a passing engine must not erase another engine's failures); the derandomized ``ci`` profile reads it through :class:`ReadOnlyDatabase`, so a CI run
replays every saved failure first and never changes the database. A read-only view never
raises: a missing directory reads as empty, and an unreachable Redis server (or a missing
``redis`` package) is reported once as a warning and read as empty.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

from hypothesis.configuration import storage_directory
from hypothesis.database import (
    DirectoryBasedExampleDatabase,
    ExampleDatabase,
    GitHubArtifactDatabase,
    InMemoryExampleDatabase,
    MultiplexedDatabase,
    ReadOnlyDatabase,
)

from ..protocol.errors import DatabaseUnavailable

__all__ = ["ENV", "MEMORY", "REDIS_TTL", "default_directory", "example_database", "replay_database", "describe", "check_reachable",
           "DatabaseUnavailable", "KeepFailures"]

ENV = "SPEC_EXAMPLE_DB"
#: the setting for a fresh in-memory database (empty at start, gone with the process)
MEMORY = ":memory:"
#: Redis entries expire this long after they were last saved or read (every CI run reads them).
REDIS_TTL = timedelta(days=30)
_REDIS_SCHEMES = ("redis", "rediss", "unix")


def default_directory() -> Path:
    """Hypothesis's own default, as its settings give it: ``examples`` under its storage directory
    (``$HYPOTHESIS_STORAGE_DIRECTORY``, else ``.hypothesis`` in the working directory)."""
    try:
        return storage_directory("examples", intent_to_write=False).path
    except TypeError:  # hypothesis before 6.131: storage_directory(*names) returns the path itself
        return Path(storage_directory("examples"))


def _setting(url: str | None) -> str:
    return (os.environ.get(ENV, "") if url is None else url).strip()


def _parts(setting: str) -> list[str]:
    return [part.strip() for part in setting.split(",") if part.strip()]


def _redis(url: str) -> ExampleDatabase:
    try:
        import redis
    except ImportError as exc:  # the `fuzz` extra installs it
        raise DatabaseUnavailable(f"{ENV}={url} needs the redis package: pip install -e '.[fuzz]'") from exc
    from hypothesis.extra.redis import RedisExampleDatabase

    client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=10)
    return RedisExampleDatabase(client, expire_after=REDIS_TTL)


def _github(url: str) -> ExampleDatabase:
    parts = [p for p in (urlsplit(url).netloc + urlsplit(url).path).split("/") if p]
    if len(parts) not in (2, 3):
        raise ValueError(f"{ENV}={url}: expected github-artifact://owner/repo[/artifact-name]")
    return GitHubArtifactDatabase(*parts)


def example_database(url: str | None = None, *, strict: bool = True) -> ExampleDatabase | None:
    """The read-write database named by ``url`` (default: ``$SPEC_EXAMPLE_DB``); see the module doc.

    A configured database (the setting is not empty) is wrapped so that nothing is ever deleted
    from it (:class:`KeepFailures`). ``strict=False`` (the profiles): a setting that cannot be used
    is warned about and the default directory is used instead, so a bad URL never stops a test
    run; ``python -m spec fuzz`` is strict.
    """
    setting = _setting(url)
    if not strict:
        try:
            return example_database(setting)
        except (DatabaseUnavailable, ValueError) as exc:
            warnings.warn(f"{exc}; saving examples under {default_directory()} instead", stacklevel=2)
            return example_database("")
    db = _open(setting)
    return KeepFailures(db) if setting and db is not None else db


def _open(setting: str) -> ExampleDatabase | None:
    if "," in setting:
        parts = [db for db in map(_open, _parts(setting)) if db is not None]
        return MultiplexedDatabase(*parts) if parts else None
    if not setting:
        return DirectoryBasedExampleDatabase(default_directory())
    if setting.lower() == "none":
        return None
    if setting == MEMORY:
        return InMemoryExampleDatabase()
    scheme = urlsplit(setting).scheme.lower()
    if scheme in _REDIS_SCHEMES:
        return _redis(setting)
    if scheme == "github-artifact":
        return _github(setting)
    if scheme not in ("", "file"):
        raise ValueError(f"{ENV}={setting!r}: use a directory, redis://host:port/db, "
                         "github-artifact://owner/repo[/name], :memory: or none")
    return DirectoryBasedExampleDatabase(Path(urlsplit(setting).path if scheme == "file" else setting))


class KeepFailures(ExampleDatabase):
    """A shared database's writer view: saves and moves pass through, deletes are dropped.

    The database key is one per invariant x mode for every engine, so Hypothesis's clean-up
    (a saved failure that no longer fails is deleted when replayed) would let a run on an engine
    that passes erase what a campaign found on another engine (impl's nightly campaign erasing
    verl's findings). Shrinking still moves superseded examples to the secondary key.
    """

    def __init__(self, db: ExampleDatabase) -> None:
        super().__init__()
        self._db = db

    def __repr__(self) -> str:
        return f"KeepFailures({self._db!r})"

    def fetch(self, key: bytes) -> Iterable[bytes]:
        return self._db.fetch(key)

    def save(self, key: bytes, value: bytes) -> None:
        self._db.save(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        self._db.move(src, dest, value)

    def delete(self, key: bytes, value: bytes) -> None:
        pass


class _ForgivingReads(ExampleDatabase):
    """A read-only view whose reads never raise: a lost server reads as empty (warned once)."""

    def __init__(self, db: ExampleDatabase, label: str) -> None:
        super().__init__()
        self._db, self._label, self._warned = db, label, False

    def __repr__(self) -> str:
        return f"ReadOnlyDatabase({self._db!r})"

    def fetch(self, key: bytes) -> Iterable[bytes]:
        try:
            values = list(self._db.fetch(key))
        except Exception as exc:  # noqa: BLE001 - any backend error: a CI run goes on without replay
            if not self._warned:
                self._warned = True
                warnings.warn(f"example database {self._label} unreadable ({type(exc).__name__}: {exc}); "
                              "no saved failures are replayed", stacklevel=2)
            return []
        return values

    def save(self, key: bytes, value: bytes) -> None:
        pass

    def delete(self, key: bytes, value: bytes) -> None:
        pass

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        pass


def replay_database(url: str | None = None) -> ExampleDatabase | None:
    """A read-only view of :func:`example_database` for the ``ci`` profile; never raises."""
    setting = _setting(url)
    if "," in setting:
        views = [db for db in map(replay_database, _parts(setting)) if db is not None]
        return MultiplexedDatabase(*views) if views else None
    try:
        db = _open(setting)
    except (DatabaseUnavailable, ValueError) as exc:
        warnings.warn(f"{exc}; the ci profile replays no saved failures", stacklevel=2)
        return None
    if db is None:
        return None
    if isinstance(db, DirectoryBasedExampleDatabase):
        return ReadOnlyDatabase(db)  # a missing directory reads as empty, and nothing creates it
    return _ForgivingReads(db, setting)


def check_reachable(db: ExampleDatabase | None) -> None:
    """Raise :class:`DatabaseUnavailable` unless ``db`` answers (a Redis ping); for writers."""
    if isinstance(db, KeepFailures):
        return check_reachable(db._db)
    if isinstance(db, MultiplexedDatabase):
        for part in db._wrapped:
            check_reachable(part)
        return
    client = getattr(db, "redis", None)
    if client is None:
        return
    try:
        client.ping()
    except Exception as exc:  # noqa: BLE001 - redis.ConnectionError, TimeoutError, auth errors
        raise DatabaseUnavailable(f"example database {describe(db)} unreachable: {exc}") from exc


def describe(db: ExampleDatabase | None) -> str:
    """One line naming the database (no credentials)."""
    if db is None:
        return "none"
    if isinstance(db, KeepFailures):
        return describe(db._db)
    if isinstance(db, MultiplexedDatabase):
        return " + ".join(describe(part) for part in db._wrapped)
    inner = getattr(db, "_db", None) or getattr(db, "_wrapped", None)
    if isinstance(db, (ReadOnlyDatabase, _ForgivingReads)) and inner is not None:
        return f"read-only {describe(inner)}"
    if isinstance(db, DirectoryBasedExampleDatabase):
        return f"directory {db.path}"
    if isinstance(db, InMemoryExampleDatabase):
        return "in-memory"
    client = getattr(db, "redis", None)
    if client is not None:
        kw = client.connection_pool.connection_kwargs
        where = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}"
        return f"redis {where}/{kw.get('db', 0)}"
    return type(db).__name__
