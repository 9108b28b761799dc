"""``python -m spec fuzz``: the catalogue as a fuzz campaign on N local worker processes.

Each worker cycles through the catalogue's (invariant, mode) targets and runs short rounds of
:func:`spec.run.runner.run_invariant`, each with a fresh seed, against the shared example database
(``SPEC_EXAMPLE_DB``, see :mod:`spec.run.database`). A round first replays every failure saved for
its target (by any worker, on any machine sharing the database), then draws new cases; a failure
is shrunk and saved under the target's key, which is exactly the key the ``ci`` profile replays
first. A target stops being fuzzed once it has failed. Workers on other machines join the same
campaign by pointing ``SPEC_EXAMPLE_DB`` at the same Redis server.

This is a plain multi-process loop, not HypoFuzz: HypoFuzz fuzzes pytest ``@given`` functions
and keys their examples by pytest node id, so what it found would sit under keys that
``run_invariant`` (and so the ``ci`` profile) never reads; see docs/fuzzing.md.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_module
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from hypothesis import Verbosity

from .run.database import example_database
from .run.registry import load_engine
from .run.runner import instances, run_invariant, skip_reason

__all__ = ["TargetStats", "targets", "run_campaign", "markdown"]

#: Examples per round: short rounds rotate the targets and keep the time limit tight.
ROUND_EXAMPLES = 25
_DONE, _READY = "done", "ready"
#: Seconds a worker may take to import torch and the engine before its clock starts.
STARTUP = 60.0


@dataclass
class TargetStats:
    target: str  # "INV-MASK-001/padded"
    examples: int = 0
    rounds: int = 0
    seconds: float = 0.0
    status: str = "pass"  # pass (nothing found) | fail | xfail (a known failure of the engine)
    counterexample: str | None = None
    error: str | None = None
    worker: int | None = None  # the worker that found the failure


def targets(engine, only: str | None = None, device: str = "cpu") -> list[tuple]:
    """The (invariant, mode) pairs to fuzz: the catalogue filtered by ``only``, less those the engine skips."""
    return [(info, mode) for info, mode in instances()
            if (not only or info.id.startswith(only)) and skip_reason(info, engine, device, mode) is None]


def _worker(index: int, workers: int, engine_name: str, only: str | None, device: str, seconds: float,
            round_examples: int, stopped, results) -> None:
    """One fuzzing process: rounds of run_invariant with fresh seeds for ``seconds`` once it is ready."""
    torch.set_num_threads(1)
    engine = load_engine(engine_name)
    todo = targets(engine, only, device)
    database = example_database()
    rng = random.SystemRandom()
    position = index * len(todo) // max(workers, 1)
    deadline = time.time() + seconds  # the clock starts once torch and the engine are imported
    results.put((index, _READY, None))
    try:
        while time.time() < deadline and not all(stopped):
            position = (position + 1) % len(todo)
            if stopped[position]:
                continue
            info, mode = todo[position]
            outcome = run_invariant(info, engine, mode, device, profile="default", seed=rng.getrandbits(32),
                                    explicit=False,
                                    database=database, max_examples=round_examples, verbosity=Verbosity.quiet)
            if outcome.status in ("fail", "xfail"):
                stopped[position] = 1
            results.put((index, position, outcome.as_dict()))
    finally:
        results.put((index, _DONE, None))


def _progress(start: float | None, seconds: float, workers: int, stats: dict[str, TargetStats], final: bool = False) -> str:
    elapsed = time.time() - start if start is not None else 0.0
    examples = sum(s.examples for s in stats.values())
    failures = [k for k, s in stats.items() if s.status == "fail"]
    known = sum(s.status == "xfail" for s in stats.values())
    touched = sum(s.rounds > 0 for s in stats.values())
    line = (f"fuzz: {min(elapsed, seconds):5.0f}s/{seconds:.0f}s  {workers} workers  {examples} examples "
            f"({examples / max(elapsed, 1e-9):.0f}/s)  {touched}/{len(stats)} targets  failures: {len(failures)}")
    if known:
        line += f" (+{known} known)"
    if failures:
        line += " [" + ", ".join(failures[:3]) + (", ..." if len(failures) > 3 else "") + "]"
    return line + ("" if final else " ")


def run_campaign(engine_name: str, *, workers: int, seconds: float, only: str | None = None, device: str = "cpu",
                 round_examples: int = ROUND_EXAMPLES, grace: float | None = None,
                 log=sys.stderr) -> dict[str, TargetStats]:
    """Fuzz for ``seconds`` on ``workers`` processes; return the statistics per target.

    Each worker's clock starts once it has imported torch and the engine. Workers finish their
    current round after their deadline (so a failure being shrunk is saved
    shrunk); any still running ``grace`` seconds later (default: a quarter of ``seconds``, at
    least 15) are terminated: a failure is saved as soon as it is found, shrunk or not.
    """
    engine = load_engine(engine_name)
    todo = [f"{info.id}/{mode}" for info, mode in targets(engine, only, device)]
    if not todo:
        raise ValueError(f"no invariant to fuzz on engine {engine_name}" + (f" matching {only!r}" if only else ""))
    stats = {key: TargetStats(key) for key in todo}
    # CPU: fork (the workers inherit the imported torch and engine; the parent has run no torch op).
    # CUDA cannot cross a fork: a fresh interpreter per worker.
    forkable = device == "cpu" and "fork" in mp.get_all_start_methods()
    ctx = mp.get_context("fork" if forkable else "spawn")
    stopped = ctx.Array("b", len(todo), lock=False)
    results = ctx.Queue()
    start = time.time()
    procs = [ctx.Process(target=_worker, name=f"spec-fuzz-{i}", daemon=True,
                         args=(i, workers, engine_name, only, device, seconds, round_examples, stopped, results))
             for i in range(workers)]
    for proc in procs:
        proc.start()
    interactive = getattr(log, "isatty", lambda: False)()
    every = 0.5 if interactive else 10.0
    hard_stop = start + STARTUP + seconds + (grace if grace is not None else max(15.0, seconds / 4))
    running, shown, clock = set(range(workers)), 0.0, None  # clock: when the first worker was ready
    try:
        while running and time.time() < hard_stop:
            try:
                index, position, outcome = results.get(timeout=0.5)
            except queue_module.Empty:
                if not any(p.is_alive() for p in procs):
                    break
            else:
                if position == _DONE:
                    running.discard(index)
                elif position == _READY:
                    if clock is None:
                        clock = time.time()
                        log.write(("\r" if interactive else "") + f"fuzz: workers ready after {clock - start:.1f}s\n")
                else:
                    _record(stats[todo[position]], outcome, index)
            if time.time() - shown >= every:
                shown = time.time()
                log.write(("\r" if interactive else "") + _progress(clock, seconds, workers, stats)
                          + ("" if interactive else "\n"))
                log.flush()
    finally:
        for proc in procs:
            proc.join(timeout=max(0.0, hard_stop - time.time()) if running else 5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
    log.write(("\r" if interactive else "") + _progress(clock, seconds, workers, stats, final=True) + "\n")
    log.flush()
    crashed = [p.name for p in procs if p.exitcode not in (0, -signal.SIGTERM)]
    if crashed:
        raise RuntimeError(f"fuzz worker(s) {', '.join(crashed)} crashed (traceback above)")
    return stats


def _record(stats: TargetStats, outcome: dict, worker: int) -> None:
    stats.examples += outcome["examples"]
    stats.rounds += 1
    stats.seconds += outcome["seconds"]
    if outcome["status"] in ("fail", "xfail") and stats.status == "pass":
        stats.status, stats.worker = outcome["status"], worker
        stats.counterexample, stats.error = outcome["counterexample"], outcome["error"]


def markdown(stats: dict[str, TargetStats], *, engine: str, seconds: float, workers: int, database: str) -> str:
    found = [s for s in stats.values() if s.status != "pass"]
    examples = sum(s.examples for s in stats.values())
    lines = [f"# Fuzz campaign: engine `{engine}`", "",
             f"{workers} workers, {seconds:.0f} s, database {database}: {examples} examples over {len(stats)} "
             f"targets; **{sum(s.status == 'fail' for s in found)} failures**, "
             f"{sum(s.status == 'xfail' for s in found)} known failures", "",
             "| target | examples | rounds | result | counterexample |", "|---|---:|---:|---|---|"]
    for s in sorted(stats.values(), key=lambda s: (s.status == "pass", s.target)):
        result = {"pass": "nothing found", "fail": "FAIL", "xfail": "known failure"}[s.status]
        detail = f"`{s.counterexample}` → {s.error}" if s.status != "pass" else ""
        lines.append(f"| {s.target} | {s.examples} | {s.rounds} | {result} | {detail.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"


def write_reports(stats: dict[str, TargetStats], stem: Path, **meta) -> list[Path]:
    stem.parent.mkdir(parents=True, exist_ok=True)
    md, js = stem.with_suffix(".md"), stem.with_suffix(".json")
    md.write_text(markdown(stats, **meta))
    js.write_text(json.dumps({**meta, "targets": [asdict(s) for s in stats.values()]}, indent=2))
    return [md, js]


def failed(stats: dict[str, TargetStats]) -> bool:
    return any(s.status == "fail" for s in stats.values())


def safe_name(engine: str) -> str:
    return engine.replace(":", "-").replace("/", "-").replace(os.sep, "-")
