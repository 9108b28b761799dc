"""Real ranks: sequence parallelism run in separate processes joined by ``torch.distributed``.

One pool of :data:`MAX_WORLD` long-lived worker processes per backend (``gloo`` for CPU
batches, ``nccl`` for CUDA ones), started lazily with ``torch.multiprocessing`` (forked by a fork server
that imported the rank side once, :func:`start_method`; else spawned) and
a ``FileStore`` in a fresh temporary directory (no port or path is shared between pytest-xdist
workers), shut down at exit. Every set of two or more ranks is a subgroup of the one pool, made once at
start-up, so any process topology (:mod:`spec.cases.topology`: the case's ``topology``, by default
one SP group ``[0, sp)``; else groups that start elsewhere, several contiguous or interleaved
groups) costs no extra processes.

Per example every rank of the topology's SP groups, its rank within its group ``r``:

1. materialises its group's micro-batch from the group's case (``Topology.group_case``: the
   case with its own seed; or unpickles the one it is sent, for a one-group topology);
2. builds its engine, ``load_engine(name).make(head, sp_size=w, sp_rank=r,
   all_gather=TorchDistributedAllGather(subgroup), ...)`` (verl's adapter reads the group off
   the gather and sets verl's Ulysses group from it);
3. runs ``prepare_model_inputs``; the ranks exchange their inputs (``all_gather_object``,
   which also tells every rank whether another one failed, so an error raised on one rank
   does not leave the others waiting in a collective);
4. runs the toy model on the all-gathered full row (the model sees the whole packed row, as
   Ulysses attention does: :func:`spec.execute.harness._call_model`), takes its slice with the tail
   poisoned, and runs ``prepare_model_outputs`` (the engine's own all-gather, on the real group);
5. sends back its inputs, ``output_args``, model output, snapshots and outputs.

A rank that raises has its exception re-raised in the caller (original type, rank traceback
attached as a note). A worker that dies, or does not answer within the task timeout
(``SPEC_RANKS_TIMEOUT`` seconds, default 120), fails the call with :class:`RankFailure`
carrying each rank's traceback (faulthandler dumps on fatal signals and on demand), and the
pool is replaced. Every collective has the process group's timeout. What a rank runs: :mod:`spec.execute.rank_worker`.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import shutil
import signal
import sys
import tempfile
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp
from tensordict import TensorDict

from ..cases.structure import EngineCase
from ..cases.topology import Topology
from ..protocol.engine import EngineUnderTest
from ..protocol.errors import RankFailure, RankFault
from . import probe
from .handoff import Run, attach_views, model_for, snapshot, attach_outputs
from ..cases.materialize import materialize
from .rank_worker import WORLDS, ShardedTopKProcessor, dumps, on_device, task_timeout, worker_main

__all__ = ["RankFault", "restarts", "MAX_WORLD", "PRELOAD", "WORLDS", "start_method", "RankFailure", "RankPool", "ShardedTopKProcessor", "execute", "pool", "raise_rank_error",
           "shutdown", "backend_for", "unavailable", "task_timeout"]

MAX_WORLD = 4
#: what a pool's fork server imports before it forks the ranks (torch, tensordict, impl and the suite's rank side:
#: about 3 s of CPU each rank paid again when spawned)
PRELOAD = ("torch", "spec.execute.rank_worker")
_STARTUP_TIMEOUT = 180.0
#: seconds the other ranks get to answer once one rank reported an error
_ERROR_GRACE = 3.0


def start_method() -> str:
    """How a pool's ranks start: ``forkserver`` where the platform has it (a fork server that imported
    :data:`PRELOAD` once forks each rank: a fresh process that touched no CUDA, threads or process group), else
    ``spawn``; ``SPEC_RANKS_START=spawn`` forces spawn."""
    wanted = os.environ.get("SPEC_RANKS_START", "").strip() or "forkserver"
    if wanted not in ("forkserver", "spawn"):
        raise ValueError(f"SPEC_RANKS_START={wanted!r}: use forkserver or spawn")
    return wanted if wanted in tmp.get_all_start_methods() else "spawn"


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def unavailable(device: str = "cpu", world: int = MAX_WORLD) -> str | None:
    """Why real ranks cannot run here for ``device`` (None when they can)."""
    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    backend = backend_for(device)
    if backend == "gloo" and not dist.is_gloo_available():
        return "torch.distributed has no gloo backend"
    if backend == "nccl":
        if not dist.is_nccl_available():
            return "torch.distributed has no nccl backend"
        if torch.cuda.device_count() < world:
            return f"nccl needs one GPU per rank: {torch.cuda.device_count()} GPU(s) for world size {world}"
    return None


# ---------------------------------------------------------------------------------------------
# the parent side
# ---------------------------------------------------------------------------------------------

class RankPool:
    """:data:`MAX_WORLD` worker processes for one backend; see the module docstring."""

    def __init__(self, backend: str, world: int = MAX_WORLD):
        self.backend, self.world = backend, world
        self.dir = tempfile.mkdtemp(prefix="spec-ranks-")
        method = start_method()
        ctx = tmp.get_context(method)
        if method == "forkserver":  # the server imports the suite's rank side once; each rank forks from it
            ctx.set_forkserver_preload(list(PRELOAD))
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.loaded: set[str] = set()
        self.next_id = 0
        self.closed = False
        self._error_seen = 0.0
        env_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = "1"
        main = sys.modules.get("__main__")
        hidden = {k: getattr(main, k) for k in ("__file__", "__spec__") if hasattr(main, k)}
        try:
            # the workers run spec.execute.ranks only: never re-run the caller's main module (a script
            # without a __main__ guard, pytest's, python -m spec's), which also saves start-up time
            if "__file__" in hidden:
                del main.__file__
            if "__spec__" in hidden:
                main.__spec__ = None
            self.context = tmp.start_processes(
                worker_main, args=(world, backend, os.path.join(self.dir, "store"), self.dir, self.tasks,
                                    self.results, os.getpid()),
                nprocs=world, join=False, daemon=True, start_method=method)
        finally:
            for key, value in hidden.items():
                setattr(main, key, value)
            if env_threads is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = env_threads
        self._collect("ready", range(world), _STARTUP_TIMEOUT, "start-up")

    @property
    def processes(self) -> list[Any]:
        return list(self.context.processes)

    def alive(self) -> bool:
        return not self.closed and all(p.is_alive() for p in self.processes)

    # -- talking to the ranks ----------------------------------------------------------------
    def _logs(self, ranks) -> str:
        parts = []
        for r in ranks:
            path = os.path.join(self.dir, f"rank{r}.log")
            try:
                with open(path) as fh:
                    text = fh.read()[-6000:]
            except OSError:
                text = ""
            parts.append(f"--- rank {r} (exit code {self.processes[r].exitcode}) ---\n{text.strip() or '(no traceback)'}")
        return "\n".join(parts)

    def _fail(self, what: str, ranks, fault: bool = False) -> RankFailure:
        for p in self.processes:  # ask every live rank for its stack, then give them a moment to write
            if p.is_alive() and hasattr(signal, "SIGUSR1"):
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except OSError:
                    pass
        time.sleep(0.5)
        message = f"{what}\n{self._logs(ranks)}"
        self.close(force=True)
        return (RankFault if fault else RankFailure)(message)

    def _collect(self, task_id: Any, ranks, timeout: float, what: str, fault: bool = False
                 ) -> dict[int, dict[str, Any]]:
        """Every rank's reply; once one rank reported an error, the others get :data:`_ERROR_GRACE`
        seconds (they may be waiting in a collective the failed rank never joined): the pool is then
        replaced and the replies so far are returned. A rank that died (checked on every poll, so a death is seen
        within a poll, and before the error its peers then report: "Connection closed by peer" is a symptom) or
        did not answer within ``timeout`` raises :class:`RankFault` for an example (``fault``), else
        :class:`RankFailure`."""
        want = set(ranks)
        got: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while want - set(got):
            dead = [r for r, p in enumerate(self.processes) if not p.is_alive()]
            if dead:
                time.sleep(0.2)  # its last words (a fatal signal's traceback) reach its log
                codes = ", ".join(f"rank {r}: exit code {self.processes[r].exitcode}" for r in dead)
                raise self._fail(f"real ranks: rank(s) {dead} died ({codes}) during {what}",
                                 [*dead, *sorted(want - set(dead))], fault)
            if any("error" in body for body in got.values()):
                if time.monotonic() > min(deadline, self._error_seen + _ERROR_GRACE):
                    self.close(force=True)
                    return got
            try:
                blob = self.results.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    late = sorted(want - set(got))
                    raise self._fail(f"real ranks: rank(s) {late} did not answer within {timeout:.0f} s during "
                                     f"{what} (hung, e.g. waiting in a collective)", late, fault)
                continue
            tid, rank, body = pickle.loads(blob)
            if tid == task_id:
                got[rank] = body
                if "error" in body and len([b for b in got.values() if "error" in b]) == 1:
                    self._error_seen = time.monotonic()
        return got

    def submit(self, task: dict[str, Any], world: int | tuple[int, ...], timeout: float | None = None
               ) -> dict[int, dict[str, Any]]:
        """Send ``task`` to ranks ``[0, world)`` (or to the global ranks ``world`` names) and collect their
        replies, keyed by global rank."""
        ranks = tuple(range(world)) if isinstance(world, int) else tuple(world)
        if len(ranks) < 2 or min(ranks) < 0 or max(ranks) >= self.world:
            raise ValueError(f"ranks {list(ranks)}: need 2 or more of the pool's [0, {self.world})")
        timeout = task_timeout() if timeout is None else timeout
        name = task["engine"]
        if name not in self.loaded:  # the first use of an engine imports it (verl takes seconds)
            self._broadcast({"engine": name, "recipe": task["recipe"], "load": True}, range(self.world),
                            _STARTUP_TIMEOUT,
                            f"loading engine {name!r}")
            self.loaded.add(name)
        task = {**task, "probe": probe.current()}  # a mutant to run, a coverage context (spec mutate)
        return self._broadcast(task, ranks, timeout, f"case {task['case']!r} on engine {name!r}", fault=True)

    def _broadcast(self, task: dict[str, Any], ranks, timeout: float, what: str, fault: bool = False
                   ) -> dict[int, dict[str, Any]]:
        if not self.alive():
            raise RankFailure("real ranks: the pool is closed or a rank is dead")
        self.next_id += 1
        blob = dumps(task)
        for r in ranks:
            self.tasks[r].put((self.next_id, blob))
        return self._collect(self.next_id, ranks, timeout, what, fault)

    def close(self, force: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if not force:
            for q in self.tasks:
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001 - a broken queue: terminate below
                    pass
            deadline = time.monotonic() + 5.0
            for p in self.processes:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for q in (*self.tasks, self.results):
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[tuple[str, int], RankPool] = {}
_RESTARTS = [0]  # pools replaced after a rank died, hung or errored (a run's bound on them: spec.run.runner)


def restarts() -> int:
    """How many times a pool was replaced in this process (a dead, hung or failed rank closes its pool; the next
    example starts a fresh one). The runner bounds the restarts one target may cause (``SPEC_FAULT_BUDGET``)."""
    return _RESTARTS[0]


def pool(device: str = "cpu", world: int = MAX_WORLD) -> RankPool:
    """The live pool of ``world`` ranks for ``device``'s backend, started (or restarted) on demand. Every check uses
    the pool of :data:`MAX_WORLD` ranks (its subgroups), except a training step whose framework reads its DP size off
    the whole world (``StepLayer.world_is_dp``): that one runs in a pool of exactly ``dp`` ranks."""
    if not 2 <= world <= MAX_WORLD:
        raise ValueError(f"a rank pool holds 2..{MAX_WORLD} ranks, not {world}")
    key = (backend_for(device), world)
    current = _POOLS.get(key)
    if current is None or not current.alive():
        if current is not None:
            current.close(force=True)
            _RESTARTS[0] += 1
        _POOLS[key] = RankPool(key[0], world)
    return _POOLS[key]


def shutdown() -> None:
    """Stop every pool (registered at exit)."""
    for backend in list(_POOLS):
        _POOLS.pop(backend).close()


atexit.register(shutdown)


def raise_rank_error(first_rank: int, blob: bytes | None, text: str) -> None:
    note = f"raised on real rank {first_rank}:\n{text}"
    exc: BaseException | None = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:  # noqa: BLE001
            exc = None
    if not isinstance(exc, Exception):
        raise RankFailure(note)
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    raise exc


def execute(engine: EngineUnderTest, case: EngineCase, device: str = "cpu", *, poison: str = "nan",
            micro_batch: TensorDict | None = None, stop_after_inputs: bool = False,
            timeout: float | None = None, workers: RankPool | None = None) -> Run:
    """:func:`spec.execute.harness.execute` for ``case.sp_size`` (2 to 4) real ranks, on ``case.topology``.

    Returns group 0's :class:`Run`; ``Run.groups`` holds every SP group's, in the topology's order, each with
    its own case (:meth:`spec.cases.topology.Topology.group_case`).

    ``engine`` is rebuilt in each worker from its recipe (:meth:`spec.protocol.EngineUnderTest.recipe`: the
    callable and arguments that built it, pickled by reference) and cached there under ``engine.name``. Exceptions raised by the engine on a rank are
    re-raised here; a dead or hung rank raises :class:`RankFailure`. ``workers``: a pool of one's own
    (default: the shared pool of the device's backend).
    """
    if not 2 <= case.sp_size <= MAX_WORLD:
        raise ValueError(f"real ranks run sp_size 2..{MAX_WORLD}, the case has sp={case.sp_size}")
    topology = case.topology or Topology.single(case.sp_size)
    if topology.sp != case.sp_size or topology.world > MAX_WORLD:
        raise ValueError(f"topology sp_groups={topology!r} does not fit sp={case.sp_size} on a pool of "
                         f"{MAX_WORLD} ranks")
    if micro_batch is not None and topology.dp > 1:
        raise ValueError(f"a micro_batch of one's own is one SP group's: the topology sp_groups={topology!r} has "
                         f"{topology.dp} (each runs its own case's micro-batch)")
    reason = unavailable(device, topology.world)
    if reason:
        raise RankFailure(f"real ranks cannot run here: {reason}")
    engine.load_library()  # a rank's reply may name the library's objects: imported here as the adapter imports them
    task = {"engine": engine.name, "recipe": engine.recipe(), "case": case, "topology": topology, "device": device,
            "poison": poison, "micro_batch": None if micro_batch is None else on_device(micro_batch, "cpu"),
            "stop_after_inputs": stop_after_inputs}
    replies = (workers or pool(device)).submit(task, topology.ranks, timeout)
    errors = sorted((body["error"] for body in replies.values() if "error" in body), key=lambda e: e[0])
    if errors:
        raise_rank_error(*errors[0])
    runs = [_group_run(engine, topology.group_case(case, g), device, [replies[r] for r in members],
                       micro_batch, stop_after_inputs) for g, members in enumerate(topology.groups)]
    runs[0].groups = runs
    return runs[0]


def _group_run(engine: EngineUnderTest, case: EngineCase, device: str, ordered: list[dict[str, Any]],
               micro_batch: TensorDict | None, stop_after_inputs: bool) -> Run:
    """One SP group's :class:`Run` from its ranks' replies (in group-rank order)."""
    mb = materialize(case, device) if micro_batch is None else micro_batch
    run = Run(case, device, mb, snapshot(mb), model_for(case, device, engine))
    to_dev = lambda obj: _to_device(obj, device)  # noqa: E731
    run.inputs = [to_dev(b["inputs"]) for b in ordered]
    run.output_args = [to_dev(b["output_args"]) for b in ordered]
    attach_views(run, engine)
    if stop_after_inputs:
        return run
    run.output_args = [to_dev(b["output_args_after"]) for b in ordered]
    run.model_outputs = [SimpleNamespace(**to_dev(b["model_output"])) for b in ordered]
    run.model_output_snapshots = [to_dev(b["model_output_snapshot"]) for b in ordered]
    run.output_args_snapshots = [to_dev(b["output_args_snapshot"]) for b in ordered]
    attach_outputs(run, engine, [to_dev(b["outputs"]) for b in ordered])
    run.micro_batch = on_device(ordered[0]["micro_batch"], device)
    return run


def _to_device(obj: Any, device: str) -> Any:
    if torch.device(device).type == "cpu":
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    return obj
