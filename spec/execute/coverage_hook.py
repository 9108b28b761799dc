"""The per-process hook of the engine-code coverage (:mod:`spec.run.engine_coverage`).

``spec verify`` names a folder in ``$SPEC_ENGINE_COVERAGE`` holding ``config.json`` (the engine's surface files);
every process that runs engine code (the verify workers of :mod:`spec.run.parallel`, the real-rank workers of
:mod:`spec.execute.rank_worker`, the verify process itself with one worker) calls :func:`start` when it starts and
:func:`stop` when it ends: coverage.py measures lines and branches of those files only (``include=``, the C tracer
leaves every other file untraced) and saves one data file per process (``data_suffix``), combined by the parent.
Without the variable (or without coverage.py) both are no-ops.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

try:
    import coverage
except ImportError:  # coverage.py not installed: nothing is measured, the report says so
    coverage = None

__all__ = ["ENV", "CONFIG", "DATA", "available", "start", "stop", "switch", "write_config", "engine_code"]

#: the environment variable naming the measurement's folder
ENV = "SPEC_ENGINE_COVERAGE"
CONFIG = "config.json"
DATA = ".coverage"
#: coverage.py's warnings that say nothing here: a process that ran no surface code, a file never imported
QUIET = ["no-data-collected", "module-not-imported", "module-not-measured", "couldnt-parse", "no-ctracer"]

_ACTIVE: list[Any] = []
#: a gated measurement's depth of engine-code blocks (empty: not gated)
_GATE: list[int] = []
#: the dynamic context asked (:func:`switch`) and the one coverage.py was last switched to
_CONTEXT: list[str | None] = [None, None]


def available() -> bool:
    return coverage is not None


def new(folder: Path, include: list[str]) -> Any:
    """A coverage.py measurement of ``include`` (branches too) whose data goes to ``folder`` (suffixed per process)."""
    cov = coverage.Coverage(data_file=str(folder / DATA), data_suffix=True, branch=True, include=include,
                            config_file=False)
    cov.set_option("run:disable_warnings", QUIET)
    return cov


def start(main: bool = True) -> None:
    """Start measuring in this process if ``$SPEC_ENGINE_COVERAGE`` names a measurement (once per process).

    A gated measurement (its config's ``gated``: spec verify's) measures only inside :func:`engine_code` blocks, the
    engine's own calls: coverage.py's tracer is handed every line of every Python function while it runs, the
    suite's own included (the oracle, the checks, hypothesis), and no engine code runs outside those calls. A process
    that runs nothing but engine tasks (a real rank: ``main=False``) measures throughout."""
    folder = os.environ.get(ENV)
    if not folder or coverage is None or _ACTIVE:
        return
    try:
        config = json.loads((Path(folder) / CONFIG).read_text())
        include, gated = config["include"], bool(config.get("gated")) and main
    except (OSError, ValueError, KeyError):
        return
    cov = new(Path(folder), include)
    _ACTIVE.append(cov)
    _GATE[:] = [0] if gated else []
    if not gated:
        cov.start()


@contextmanager
def engine_code() -> Iterator[None]:
    """A block that runs the engine's code: measured in a gated process (:func:`start`), nested blocks once. Only the
    main thread gates: a thread started inside a block is measured (coverage.py hands its tracer to new threads while
    it measures), and the suite runs an engine's ranks in threads only inside one (``harness._in_threads``)."""
    if not _GATE or not _ACTIVE or threading.current_thread() is not threading.main_thread():
        yield
        return
    _GATE[0] += 1
    if _GATE[0] == 1:
        for cov in _ACTIVE:
            cov.start()
        if _CONTEXT[0] != _CONTEXT[1]:  # a context switched while measuring was off: from now on
            _switch(_CONTEXT[0])
    try:
        yield
    finally:
        _GATE[0] -= 1
        if _GATE[0] == 0:
            for cov in _ACTIVE:
                cov.stop()


def write_config(folder: Path, include: list[str], gated: bool = False) -> None:
    """Name the files a measurement in ``folder`` covers, and whether it is gated (what :func:`start` reads in each
    process)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps({"include": include, "gated": gated}))


def switch(context: str) -> None:
    """Measure this process's next lines under the dynamic context ``context`` (a target, in the coverage map); in a
    gated process from its next engine-code block on (coverage.py switches only while it measures)."""
    _CONTEXT[0] = context
    if _ACTIVE and (not _GATE or _GATE[0]):
        _switch(context)


def _switch(context: str) -> None:
    for cov in _ACTIVE:
        cov.switch_context(context)
    _CONTEXT[1] = context


def stop() -> None:
    """Stop this process's measurement and save its data file."""
    while _ACTIVE:
        cov = _ACTIVE.pop()
        if not _GATE or _GATE[0]:  # a gated one is stopped outside engine code
            cov.stop()
        cov.save()
    _GATE[:] = []
