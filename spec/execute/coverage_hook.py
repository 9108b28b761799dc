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
from pathlib import Path
from typing import Any

try:
    import coverage
except ImportError:  # coverage.py not installed: nothing is measured, the report says so
    coverage = None

__all__ = ["ENV", "CONFIG", "DATA", "available", "start", "stop", "switch", "write_config"]

#: the environment variable naming the measurement's folder
ENV = "SPEC_ENGINE_COVERAGE"
CONFIG = "config.json"
DATA = ".coverage"
#: coverage.py's warnings that say nothing here: a process that ran no surface code, a file never imported
QUIET = ["no-data-collected", "module-not-imported", "module-not-measured", "couldnt-parse", "no-ctracer"]

_ACTIVE: list[Any] = []


def available() -> bool:
    return coverage is not None


def new(folder: Path, include: list[str]) -> Any:
    """A coverage.py measurement of ``include`` (branches too) whose data goes to ``folder`` (suffixed per process)."""
    cov = coverage.Coverage(data_file=str(folder / DATA), data_suffix=True, branch=True, include=include,
                            config_file=False)
    cov.set_option("run:disable_warnings", QUIET)
    return cov


def start() -> None:
    """Start measuring in this process if ``$SPEC_ENGINE_COVERAGE`` names a measurement (once per process)."""
    folder = os.environ.get(ENV)
    if not folder or coverage is None or _ACTIVE:
        return
    try:
        include = json.loads((Path(folder) / CONFIG).read_text())["include"]
    except (OSError, ValueError, KeyError):
        return
    cov = new(Path(folder), include)
    cov.start()
    _ACTIVE.append(cov)


def write_config(folder: Path, include: list[str]) -> None:
    """Name the files a measurement in ``folder`` covers (what :func:`start` reads in each process)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps({"include": include}))


def switch(context: str) -> None:
    """Measure this process's next lines under the dynamic context ``context`` (a target, in the coverage map)."""
    for cov in _ACTIVE:
        cov.switch_context(context)


def stop() -> None:
    """Stop this process's measurement and save its data file."""
    while _ACTIVE:
        cov = _ACTIVE.pop()
        cov.stop()
        cov.save()
