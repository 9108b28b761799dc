"""``spec verify -n N``: the catalogue's invariant x mode targets spread over N worker processes.

The unit of work is a task: the targets that share a case stream (spec/run/groups.py), run as one group
(:func:`spec.run.runner.run_group`), or a target alone. Each keeps what makes its run reproducible: its seed
and example-database key come from its stream key (:func:`spec.run.runner.stream_key`), not from the process, so
its derandomized draws, and so its outcomes, are those of a one-process run. The parent holds the queue
of tasks, longest first (:func:`schedule`: durations recorded in a previous report of the same
engine where there is one, else :func:`static_estimate`); every idle worker takes the next one
(greedy longest-processing-time scheduling), so the slowest targets never start last. The parent
merges the outcomes back into catalogue order: the report is that of a one-process run apart from
the timings.

Workers are started with ``forkserver`` where the platform has it (the server imports torch and
the suite once; each worker forks from it), else ``spawn``; never ``fork``, so a parent that has
touched CUDA or threads hands nothing of it on. Each worker loads the engine by name and, for
targets that run on real ranks, owns a rank pool (:mod:`spec.execute.ranks`: a ``FileStore`` in a private
temporary directory, no ports), stopped when the worker exits; every real-rank target goes to the one worker
that took the first (:func:`next_for`), so one pool is started, not one per worker. A worker that dies
mid-target (a segfault, the OOM killer) has that target reported as a suite error with the Python traceback
``faulthandler`` dumped (or the signal that killed it), and a fresh worker takes its place for the targets left.
"""

from __future__ import annotations

import faulthandler
import inspect
import json
import multiprocessing as mp
import os
import queue as queue_module
import re
import signal
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable

import torch

from ..execute import coverage_hook
from ..invariants import CATALOGUE, InvariantInfo
from .profiles import load_profile
from .registry import load_engine
from .groups import groups
from .runner import Outcome, run_group, runs_on_ranks

__all__ = ["Target", "default_workers", "static_estimate", "recorded_seconds", "schedule", "next_for", "run_parallel",
           "run_targets", "outcome_from_dict"]

#: a worker's answer: (worker index, kind, target index, payload)
_DONE, _READY, _CRASH = "done", "ready", "crash"


@dataclass(frozen=True)
class Target:
    """One invariant x mode, by name (what crosses the process boundary)."""

    invariant: str
    mode: str

    @property
    def key(self) -> str:
        return f"{self.invariant}/{self.mode}"

    def info(self) -> InvariantInfo:
        return CATALOGUE[self.invariant]


def default_workers() -> int:
    """Every core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


_RUNS = re.compile(r"\b(rerun|execute|_rows_match|_both_modes|_expect_error)\(")


def static_estimate(target: Target) -> float:
    """A relative cost when no duration was recorded: the engine runs the check's source asks for (each
    ``rerun``/``execute``/helper call one more run, ``ctx.run`` the first), doubled for a check comparing
    the modes and for the real-rank invariants (each run a round trip through worker processes)."""
    info = target.info()
    try:
        source = inspect.getsource(info.check)
    except (OSError, TypeError):
        source = ""
    runs = 1 + len(_RUNS.findall(source))
    if info.kind == "dense":
        runs = 0.5
    if "both" in info.modes or info.id.startswith("INV-RANK"):
        runs *= 2
    return float(runs)


def recorded_seconds(report: Path | None) -> dict[str, float]:
    """``invariant/mode`` -> seconds, from a JSON report written by ``spec verify`` (empty when absent)."""
    if report is None or not report.is_file():
        return {}
    try:
        outcomes = json.loads(report.read_text())["outcomes"]
        return {f"{o['invariant']}/{o['mode']}": float(o["seconds"]) for o in outcomes
                if o.get("status") != "skip"}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def schedule(targets: list[Target], recorded: dict[str, float] | None = None,
             tasks: list[list[int]] | None = None) -> list[int]:
    """Indices of ``tasks`` (groups of positions in ``targets``; default: each target alone), longest first: the
    sum of their targets' recorded seconds where known (a target never recorded is ranked by its static estimate
    scaled to the recorded ones), ties in catalogue order."""
    recorded = recorded or {}
    tasks = tasks if tasks is not None else [[n] for n in range(len(targets))]
    known = [(recorded[t.key], static_estimate(t)) for t in targets if t.key in recorded]
    scale = (sum(s for s, _ in known) / max(sum(e for _, e in known), 1e-9)) if known else 1.0
    cost = [recorded.get(t.key, static_estimate(t) * scale) for t in targets]
    task_cost = [sum(cost[n] for n in task) for task in tasks]
    return sorted(range(len(tasks)), key=lambda i: (-task_cost[i], i))


def outcome_from_dict(data: dict, case: Any = None, known_cases: dict | None = None) -> Outcome:
    names = {f.name for f in fields(Outcome)} - {"case", "known_cases"}
    return Outcome(**{k: v for k, v in data.items() if k in names}, case=case, known_cases=dict(known_cases or {}))


def next_for(waiting: list[int], on_ranks: frozenset[int], owner: int | None, worker: int) -> int | None:
    """The index in ``waiting`` (positions, longest first) of the target ``worker`` takes next: the first one,
    except that a real-rank target (in ``on_ranks``) goes only to the worker that owns the rank pool (``owner``),
    or to any worker while none does; None when nothing waiting is for this worker."""
    for n, position in enumerate(waiting):
        if position not in on_ranks or owner is None or owner == worker:
            return n
    return None


# ---------------------------------------------------------------------------------------------
# the worker side
# ---------------------------------------------------------------------------------------------

def _worker(index: int, engine_name: str, profile: str, device: str, threads: int, overrides: dict,
            tasks, results, crash_log: str) -> None:
    """Take targets from ``tasks`` until the ``None`` sentinel; answer each with its outcome."""
    coverage_hook.start()  # the engine-code coverage of spec verify (spec.run.engine_coverage), if measured
    with open(crash_log, "w") as log:
        faulthandler.enable(log)  # a fatal signal leaves the Python stack here for the parent
        try:
            _serve(index, engine_name, profile, device, threads, overrides, tasks, results)
        except BaseException:
            log.write(traceback.format_exc())
            log.flush()
            raise
        finally:
            _stop_rank_pools()
            coverage_hook.stop()


def _serve(index: int, engine_name: str, profile: str, device: str, threads: int, overrides: dict,
           tasks, results) -> None:
    warnings.simplefilter("ignore")
    load_profile(profile)
    torch.set_num_threads(threads)
    engine = load_engine(engine_name)
    results.put((index, _READY, None, None))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue_module.Empty:
            if os.getppid() != parent:  # the parent is gone: do not linger
                return
            continue
        if task is None:
            return
        positions, members = task
        try:
            outcomes = run_group([(CATALOGUE[invariant], mode) for invariant, mode in members], engine, device,
                                 **overrides)
            # the report's fields, plus the cases a reproducer is written from (spec/repro), pickled
            results.put((index, _DONE, positions, [(o.as_dict(), o.case, o.known_cases) for o in outcomes]))
        except Exception:  # noqa: BLE001 - the suite itself failed on this group
            results.put((index, _CRASH, positions, traceback.format_exc()))


def _stop_rank_pools() -> None:
    ranks = sys.modules.get("spec.execute.ranks")
    if ranks is not None:
        ranks.shutdown()


# ---------------------------------------------------------------------------------------------
# the parent side
# ---------------------------------------------------------------------------------------------

def _context(device: str):
    methods = mp.get_all_start_methods()
    ctx = mp.get_context("forkserver" if "forkserver" in methods else "spawn")
    if ctx.get_start_method() == "forkserver":
        ctx.set_forkserver_preload(["torch", "hypothesis", "spec.run.parallel"])
    return ctx


def _died(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}" + (" (out of memory?)" if -exitcode == 9 else "")
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class _Slot:
    """One worker process and what it is running."""

    def __init__(self, ctx, index: int, args: tuple, results, folder: str):
        self.index = index
        self.crash_log = os.path.join(folder, f"worker{index}.log")
        self.current: int | None = None  # the task (a group of targets) it holds: the parent hands one at a time
        self.tasks = ctx.Queue()
        # not daemonic: a worker may start its own rank pool (spec.execute.ranks), and daemonic processes may
        # have no children; a worker whose parent is gone stops by itself (_serve)
        self.process = ctx.Process(target=_worker, name=f"spec-verify-{index}", daemon=False,
                                   args=(index, *args, self.tasks, results, self.crash_log))
        self.process.start()

    def give(self, task: int, positions: list[int], targets: list[Target]) -> None:
        self.current = task
        self.tasks.put((positions, [(targets[p].invariant, targets[p].mode) for p in positions]))

    def traceback(self) -> str:
        try:
            with open(self.crash_log) as fh:
                return fh.read()[-8000:].strip()
        except OSError:
            return ""


class _ParallelRun:
    """One ``spec verify -n N`` run's state, seen from the parent: the worker slots, the tasks waiting (longest
    first), the outcomes settled so far and the worker that owns the rank pool. :meth:`run` drives it."""

    def __init__(self, engine_name: str, targets: list[Target], tasks: list[list[int]], *, workers: int,
                 profile: str, device: str, threads: int, overrides: dict, recorded: dict[str, float] | None,
                 progress: Callable[[int, int, list[str]], None] | None, startup_timeout: float,
                 on_ranks: frozenset[int]):
        self.engine_name, self.targets, self.tasks, self.device = engine_name, targets, tasks, device
        self.progress, self.startup_timeout = progress, startup_timeout
        self.tasks_on_ranks = frozenset(i for i, task in enumerate(tasks) if any(n in on_ranks for n in task))
        self.waiting = schedule(targets, recorded, tasks)  # longest first; each idle worker takes the first it may run
        self.outcomes: list[Outcome | None] = [None] * len(targets)
        self.done = 0
        self.ready: set[int] = set()
        #: the worker that owns the rank pool, once one took a real-rank target
        self.rank_owner: int | None = None
        self.ctx = _context(device)
        self.results = self.ctx.Queue()
        self.args = (engine_name, profile, device, threads, overrides)
        self.folder = tempfile.mkdtemp(prefix="spec-verify-")
        self.slots: dict[int, _Slot] = {}
        self.next_index = 0
        for _ in range(max(1, min(workers, len(tasks)))):
            self.start_worker()

    def start_worker(self) -> None:
        self.slots[self.next_index] = _Slot(self.ctx, self.next_index, self.args, self.results, self.folder)
        self.next_index += 1

    def report(self) -> None:
        if self.progress is not None:
            running = [_label(self.targets, self.tasks[s.current]) for s in self.slots.values() if s.current is not None]
            self.progress(self.done, len(self.targets), running)

    def settle(self, position: int, outcome: Outcome) -> None:
        if self.outcomes[position] is None:
            self.outcomes[position] = outcome
            self.done += 1

    def feed(self, slot: _Slot) -> None:
        if self.rank_owner is not None and self.rank_owner not in self.slots:  # it died: the next worker starts a pool
            self.rank_owner = None
        n = next_for(self.waiting, self.tasks_on_ranks, self.rank_owner, slot.index)
        if n is not None:
            task = self.waiting.pop(n)
            if task in self.tasks_on_ranks:
                self.rank_owner = slot.index
            slot.give(task, self.tasks[task], self.targets)

    def feed_idle(self) -> None:
        for slot in list(self.slots.values()):
            if slot.current is None and slot.index in self.ready:
                self.feed(slot)

    def error(self, position: int, message: str) -> Outcome:
        t = self.targets[position]
        return Outcome(t.invariant, self.engine_name, t.mode, self.device, "error", error=message,
                       layout=t.info().layout)

    def bury(self, slot: _Slot) -> None:
        """A worker that died: the targets it was running reported as suite errors, a fresh worker for those left."""
        slot.process.join()
        why = _died(slot.process.exitcode)
        if slot.current is not None:  # the targets it was running are reported, the others go on
            for position in self.tasks[slot.current]:
                self.settle(position, self.error(position, f"suite error: worker process {why} while running "
                                                 f"this target\n{slot.traceback() or '(no traceback)'}"))
        elif slot.index not in self.ready:
            raise RuntimeError(f"spec verify: worker {slot.index} {why} before it was ready\n{slot.traceback()}")
        del self.slots[slot.index]
        if self.waiting:  # a fresh worker for the targets left
            self.start_worker()
        self.feed_idle()
        self.report()

    def answer(self, index: int, kind: str, positions: list[int], payload: Any) -> None:
        """A worker's message: ready, or a task's outcomes (or the traceback it raised)."""
        slot = self.slots.get(index)
        if slot is None:
            return
        if kind == _READY:
            self.ready.add(index)
        elif kind in (_DONE, _CRASH):
            slot.current = None
            for n, position in enumerate(positions):
                self.settle(position, outcome_from_dict(*payload[n]) if kind == _DONE
                            else self.error(position, f"suite error: the worker raised\n{payload}"))
        if slot.current is None:
            self.feed(slot)
        self.feed_idle()  # a worker left idle (only real-rank targets waited) may take one now
        self.report()

    def run(self) -> list[Outcome]:
        started = time.monotonic()
        try:
            while self.done < len(self.targets):
                try:
                    message = self.results.get(timeout=0.5)
                except queue_module.Empty:
                    for slot in [s for s in self.slots.values() if not s.process.is_alive()]:
                        self.bury(slot)
                    if not self.ready and time.monotonic() - started > self.startup_timeout:
                        raise RuntimeError(f"spec verify: no worker was ready within {self.startup_timeout:.0f} s")
                    continue
                self.answer(*message)
        finally:
            self.close()
        return [o for o in self.outcomes if o is not None]

    def close(self) -> None:
        for slot in self.slots.values():
            slot.tasks.put(None)
        deadline = time.monotonic() + 30.0
        for slot in self.slots.values():
            slot.process.join(max(0.1, deadline - time.monotonic()))
            if slot.process.is_alive():
                slot.process.terminate()
                slot.process.join(5.0)
            slot.tasks.cancel_join_thread()
        self.results.cancel_join_thread()
        for path in Path(self.folder).glob("*"):
            path.unlink(missing_ok=True)
        os.rmdir(self.folder)


def run_parallel(engine_name: str, targets: list[Target], *, workers: int, profile: str, device: str = "cpu",
                 threads: int = 1, overrides: dict | None = None, recorded: dict[str, float] | None = None,
                 progress: Callable[[int, int, list[str]], None] | None = None,
                 startup_timeout: float = 600.0, on_ranks: frozenset[int] = frozenset(),
                 tasks: list[list[int]] | None = None) -> list[Outcome]:
    """Run ``targets`` on ``engine_name`` over ``workers`` processes; the outcomes in ``targets``' order.

    ``tasks``: the targets' positions in groups that share a case stream (spec/run/groups.py), each run by one
    worker in one go (default: every target alone). ``on_ranks``: the positions of the targets that run on real
    ranks. One worker takes every task holding one (the first that takes one; another, should it die), so one
    rank pool is started (:mod:`spec.execute.ranks`: each pool is :data:`~spec.execute.ranks.MAX_WORLD` processes
    that import torch, the suite and the engine); the other workers take the next task that needs none.

    ``progress(done, total, running)`` is called whenever a task starts or finishes."""
    tasks = tasks if tasks is not None else [[n] for n in range(len(targets))]
    return _ParallelRun(engine_name, targets, tasks, workers=workers, profile=profile, device=device, threads=threads,
                        overrides=dict(overrides or {}), recorded=recorded, progress=progress,
                        startup_timeout=startup_timeout, on_ranks=on_ranks).run()


def run_targets(engine, pairs: list[tuple[InvariantInfo, str]], *, workers: int, profile: str, device: str = "cpu",
                engine_name: str | None = None, threads: int = 1, overrides: dict | None = None, recorded: dict[str, float] | None = None,
                progress: Callable[[int, int, list[str]], None] | None = None) -> list[Outcome]:
    """The outcomes of ``pairs`` in their order: in this process for one worker (in catalogue order),
    else over ``workers`` processes (:func:`run_parallel`, the engine rebuilt there from ``engine_name``, by
    default its own name)."""
    overrides = dict(overrides or {})
    tasks = groups(pairs)  # targets that share a case stream run as one (spec/run/groups.py)
    targets = [Target(info.id, mode) for info, mode in pairs]
    if workers <= 1:
        outcomes: list[Outcome | None] = [None] * len(pairs)
        done = 0
        for task in tasks:
            if progress is not None:
                progress(done, len(pairs), [_label(targets, task)])
            for n, outcome in zip(task, run_group([pairs[n] for n in task], engine, device, **overrides)):
                outcomes[n] = outcome
            done += len(task)
        if progress is not None:
            progress(len(pairs), len(pairs), [])
        return [o for o in outcomes if o is not None]
    on_ranks = frozenset(n for n, (info, _) in enumerate(pairs) if runs_on_ranks(info, engine))
    return run_parallel(engine_name or engine.name, targets, workers=workers, profile=profile, device=device,
                        threads=threads, overrides=overrides, recorded=recorded, progress=progress, on_ranks=on_ranks,
                        tasks=tasks)


def _label(targets: list[Target], task: list[int]) -> str:
    """A task as the progress line names it: its first target, and how many share its stream."""
    first = targets[task[0]].key
    return first if len(task) == 1 else f"{first} +{len(task) - 1}"
