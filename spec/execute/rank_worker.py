"""The worker side of :mod:`spec.execute.ranks`: what one rank process runs.

Each rank joins the process group (``FileStore`` rendezvous), makes a subgroup for every set of two or more
ranks, then serves tasks from its queue until told to stop or its parent is gone: it finds its SP group in
the task's topology (:mod:`spec.cases.topology`), materialises that group's case, builds its engine with its
rank within the group and ``TorchDistributedAllGather(subgroup)``, runs
``prepare_model_inputs``, exchanges inputs and status with the other ranks, runs the toy model on
the full row and ``prepare_model_outputs``, and replies with pickled bytes. Its stdout, stderr and
faulthandler dumps (fatal signals, ``SIGUSR1``) go to ``rank<r>.log`` in the pool's directory.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import shutil
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from itertools import combinations
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

from impl.sequence_parallel import TorchDistributedAllGather

from . import coverage_hook, probe
from ..cases.microbatch import MiniBatchCase, materialize_minibatch
from ..cases.structure import EngineCase
from ..cases.topology import Topology
from ..protocol.engine import EngineUnderTest
from .attribution import ENGINE, EngineFault, check_outputs, tag
from .handoff import (POISONS, _call_model, check_media_inputs, _fields, _settings, _tracked, execution_context, model_for,
                      rank_outputs)
from .pickling import dumps
from ..cases.materialize import materialize, move
from .step_rank import STEP_TASK, RankStep
from ..truth.oracle import TopKProcessor, topk_terms

__all__ = ["WORLDS", "ShardedTopKProcessor", "task_timeout", "worker_main", "on_device", "micro_batch_task", "step_task",
           "dumps"]

WORLDS = (2, 3, 4)


def task_timeout() -> float:
    """Seconds one example may take on the ranks (``SPEC_RANKS_TIMEOUT``, default 120)."""
    return float(os.environ.get("SPEC_RANKS_TIMEOUT", "120"))



# ---------------------------------------------------------------------------------------------
# the processor under sequence parallelism
# ---------------------------------------------------------------------------------------------

class ShardedTopKProcessor(TopKProcessor):
    """:class:`spec.truth.oracle.TopKProcessor` that also takes one rank's Ulysses shard of the row.

    Under sequence parallelism verl (and impl) hand ``logits_processor_func`` this rank's
    ``(1, ceil(total_nnz / sp), V)`` slice of the padded packed row; verl's own top-K processor
    pads the teacher tensors to a multiple of ``sp`` and keeps the same slice
    (``verl.trainer.distillation.fsdp.losses``). This one does the same; whole-row logits are
    aligned with the whole row as before. The tail pad's teacher ids are 0 and log-probs 0.
    """

    def __init__(self, keys: tuple[str, ...], sp_size: int, sp_rank: int):
        super().__init__(keys)
        self.sp_size, self.sp_rank = sp_size, sp_rank

    def __call__(self, student_logits: torch.Tensor, data: TensorDict, **kw: object) -> dict[str, torch.Tensor]:
        teacher_ids = data["teacher_ids"].values()
        total = teacher_ids.shape[0]
        local = -(-total // self.sp_size)
        if self.sp_size == 1 or student_logits.dim() != 3 or student_logits.shape[1] == total:
            return super().__call__(student_logits, data, **kw)
        if student_logits.shape[:2] != (1, local):
            raise ValueError(f"student_logits {tuple(student_logits.shape)} align neither with the {total} "
                             f"teacher tokens nor with rank {self.sp_rank}'s shard of {local}")
        span = slice(self.sp_rank * local, (self.sp_rank + 1) * local)
        pad = local * self.sp_size - total
        ids = torch.cat([teacher_ids, teacher_ids.new_zeros(pad, teacher_ids.shape[1])])[span]
        lp = data["teacher_logprobs"].values().float()
        lp = torch.cat([lp, lp.new_zeros(pad, lp.shape[1])])[span]
        terms = topk_terms(student_logits[0].float(), ids, lp)
        return {key: terms[key].float().unsqueeze(0) for key in self.keys}  # float32, as TopKProcessor


# ---------------------------------------------------------------------------------------------
# the worker side
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Opaque:
    """What crosses the process boundary in place of an engine's own object that does not pickle (a handle in its
    ``output_args``): its type's name. The suite reads no such object (docs/verdict.md), so nothing is lost."""

    type_name: str


def _nested_safe(obj: Any) -> Any:
    """Detach and move to CPU whatever crosses the process boundary; an object that does not pickle travels as its
    type's name (:class:`Opaque`), not as an error of the suite's."""
    if isinstance(obj, torch.Tensor):
        obj = obj.detach()
        # .cpu() of a CPU tensor is the tensor itself; torch 2.4 has no such op for a jagged one in inference mode
        return obj if obj.device.type == "cpu" else obj.cpu()
    if isinstance(obj, dict):
        return {k: _nested_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_nested_safe(v) for v in obj)
    if obj is None or isinstance(obj, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return obj
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 - the engine's own object: only its type crosses
        return Opaque(f"{type(obj).__module__}.{type(obj).__qualname__}")
    return obj


def _exchange(everyone: list[Any], status: Any, group: Any) -> None:
    """``dist.all_gather_object`` of the ranks' status, outside ``torch.inference_mode()`` (the suite's exchange, not
    the engine's: under it torch 2.4's gloo refuses to write the gathered sizes, created as inference tensors)."""
    with torch.inference_mode(False):
        dist.all_gather_object(everyone, status, group=group)


def _namespace_dict(out: Any) -> dict[str, Any]:
    return dict(vars(out)) if hasattr(out, "__dict__") else dict(out)


def _clone_args(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


class _Worker:
    """State of one rank: its subgroups and the engines it has loaded."""

    def __init__(self, rank: int, backend: str, groups: dict[int, Any]):
        self.rank, self.backend, self.groups = rank, backend, groups
        self.engines: dict[str, EngineUnderTest] = {}

    def device(self, device: str) -> str:
        return f"cuda:{self.rank}" if torch.device(device).type == "cuda" else "cpu"

    def engine(self, name: str, recipe: tuple[Any, tuple[Any, ...]]) -> EngineUnderTest:
        """The engine ``name``, built once from ``recipe`` (a callable and its arguments, unpickled by
        reference: this module imports no adapter)."""
        if name not in self.engines:
            build, args = recipe
            self.engines[name] = build(*args)
        return self.engines[name]

    def run(self, task: dict[str, Any]) -> dict[str, Any]:
        """One example on this rank: the engine's calls and the model in the case's autograd context (the
        micro-batch and the model's weights made outside it, as in :func:`spec.execute.harness.execute`). A
        mutant or coverage context the parent asks (:mod:`spec.execute.probe`) applies once the engine is loaded and,
        where the mutant's module is not imported yet on this rank (a fresh rank whose first task is a training step),
        once the engine's object is made: the adapter imports its library its own way (stubs of the imports that do
        not import here), which importing the module for the swap would not."""
        engine = self.engine(task["engine"], task["recipe"])
        mutant = (task.get("probe") or {}).get("mutant")
        if mutant is not None and mutant[0] not in sys.modules:
            engine.make()
        probe.apply(task.get("probe"))
        if task.get("kind") == "microbatch":
            return micro_batch_task(engine, task["case"], self.rank, self.groups)
        if task.get("kind") == STEP_TASK:
            return step_task(engine, task, self.rank, self.groups)
        topology: Topology = task["topology"]
        index = topology.group_of(self.rank)  # this rank's SP group; its rank there is what it slices by
        members = topology.groups[index]
        case: EngineCase = topology.group_case(task["case"], index)
        device = self.device(task["device"])
        mb = materialize(case, device) if task["micro_batch"] is None else on_device(task["micro_batch"], device)
        model = model_for(case, device, engine)
        with execution_context(case):
            return self._run(task, case, device, mb, model, index, members)

    def _run(self, task: dict[str, Any], case: EngineCase, device: str, mb: TensorDict, model: Any, index: int,
             members: tuple[int, ...]) -> dict[str, Any]:
        world, rank = len(members), members.index(self.rank)
        group = self.groups[members]
        reply: dict[str, Any] = {"rank": rank, "group": index}
        status: tuple[str, Any] = ("ok", None)
        try:
            settings = _settings(case.with_(sp_size=1), rank, None)
            settings.update(sp_size=world, sp_rank=rank, all_gather=TorchDistributedAllGather(group))
            eng = self.engine(task["engine"], task["recipe"]).make(case.head, **settings)
            model_inputs, output_args = eng.prepare_model_inputs(mb)
            status = ("ok", (_nested_safe(model_inputs), _output_rows(output_args, model_inputs)))
        except Exception as exc:  # noqa: BLE001 - shared with the other ranks, re-raised below
            status = ("error", _describe(tag(exc, ENGINE)))  # the engine's constructor or prepare_model_inputs
        everyone: list[Any] = [None] * world
        _exchange(everyone, status, group)
        failed = [(r, s[1]) for r, s in enumerate(everyone) if s[0] == "error"]
        if failed:
            first_rank, (exc_bytes, text) = failed[0]
            reply["error"] = (members[first_rank], exc_bytes, text)  # its global rank
            return reply
        reply["inputs"], reply["output_args"] = _nested_safe(model_inputs), _nested_safe(output_args)
        if task["stop_after_inputs"]:
            return reply
        all_inputs = [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in s[1][0].items()}
                      for s in everyone]
        widths = [s[1][1] for s in everyone]
        model_output = _model_on_full_row(model, all_inputs, widths, case, POISONS[task["poison"]])[rank]
        output_snapshot = {k: v.detach().clone() for k, v in _fields(model_output).items()}
        args_snapshot = _clone_args(output_args)
        processor = None
        if case.distillation_use_topk:  # the engine's own companion where it gives one, else the suite's
            engine = self.engine(task["engine"], task["recipe"])
            processor = engine.logits_processor(case, world, rank)
            if processor is None:
                processor = ShardedTopKProcessor(case.distillation_keys, world, rank)
        try:
            outputs = eng.prepare_model_outputs(model_output, output_args, mb, processor)
        except Exception as exc:  # noqa: BLE001 - re-raised by the caller
            reply["error"] = (self.rank, *_describe(tag(exc, ENGINE)))
            return reply
        try:  # copied out as they are (the parent validates them where it reads them: spec.execute.handoff)
            shipped = _nested_safe(dict(outputs))
        except Exception as exc:  # noqa: BLE001 - reading the engine's own object failed: the engine's
            fault = EngineFault(f"rank {rank}: reading the engine's outputs raised {type(exc).__name__}: {exc}")
            try:
                check_outputs(outputs, rank)  # the precise reason where it is a malformed nested tensor
            except EngineFault as precise:
                fault = precise
            except Exception:  # noqa: BLE001 - not even a mapping: the reading error says it
                pass
            reply["error"] = (self.rank, *_describe(fault))
            return reply
        reply.update(model_output=_nested_safe(_namespace_dict(model_output)),
                     model_output_snapshot=_nested_safe(output_snapshot),
                     output_args_after=_nested_safe(dict(output_args)),
                     output_args_snapshot=_nested_safe(args_snapshot),
                     outputs=shipped)
        if rank == 0:
            reply["micro_batch"] = on_device(mb, "cpu")
        return reply


def micro_batch_task(engine: EngineUnderTest, case: MiniBatchCase, rank: int, groups: dict[int, Any]
                     ) -> dict[str, Any]:
    """One data-parallel rank of :func:`spec.execute.microbatch.dp_micro_batch_counts`: its own mini-batch cut alone
    and with the group. The ranks tell each other whether they failed before the collective call, so an error on
    one rank does not leave the others waiting in it."""
    mine = case.rank_case(rank)
    group = groups[case.world]
    reply: dict[str, Any] = {"rank": rank}
    layer = engine.microbatch_layer()
    kwargs = dict(num_batches_divided_by=mine.num_batches_divided_by, min_num_micro_batch=mine.min_num_micro_batch,
                  use_dynamic_bsz_balance=mine.balance)
    status: tuple[str, Any] = ("ok", None)
    try:
        data = materialize_minibatch(mine, "cpu")
        with execution_context(mine):  # the layer in the case's autograd context, the mini-batch made outside it
            alone = len(layer.get("prepare_micro_batches")(data, dp_group=None, **kwargs)[0])
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks, re-raised by the caller
        status = ("error", _describe(exc))
    everyone: list[Any] = [None] * case.world
    _exchange(everyone, status, group)
    failed = [(r, s[1]) for r, s in enumerate(everyone) if s[0] == "error"]
    if failed:
        first_rank, (exc_bytes, text) = failed[0]
        reply["error"] = (first_rank, exc_bytes, text)
        return reply
    try:
        with execution_context(mine):
            micro, indices = layer.get("prepare_micro_batches")(data, dp_group=group, same_micro_num_in_dp=True,
                                                                **kwargs)
        micro = list(micro)
    except Exception as exc:  # noqa: BLE001 - re-raised by the caller
        reply["error"] = (rank, *_describe(exc))
        return reply
    reply.update(alone=alone, count=len(micro),
                 rows=[[int(i) for i in part] for part in indices] if indices is not None else None,
                 tokens=[int(mb["input_ids"].offsets()[-1]) for mb in micro])
    return reply


def step_task(engine: EngineUnderTest, task: dict[str, Any], rank: int, groups: dict[Any, Any]) -> dict[str, Any]:
    """One data-parallel rank of :func:`spec.execute.step.run_step` (:class:`spec.execute.step_rank.RankStep`): the
    framework's own step function with the DP group (the whole world where the framework reads it there, else the
    subgroup of the case's ``dp`` ranks). What its loss was handed is replied even when the step raised."""
    case = task["case"]
    group = dist.group.WORLD if task["world_is_dp"] else groups[case.dp]
    step = RankStep(engine, case, rank, task["measure"])
    reply: dict[str, Any] = {"rank": rank}
    try:
        reply.update(_nested_safe(step.run(group)))
    except Exception as exc:  # noqa: BLE001 - the framework's step raised: re-raised by the caller
        reply["error"] = (rank, *_describe(tag(exc, ENGINE)))
    reply["handed"] = _nested_safe(step.handed)
    return reply


def _output_rows(output_args: dict[str, Any], model_inputs: dict[str, Any]) -> int:
    """A rank's number of model-output rows: the length of its per-token ``output_args`` (what it will
    read the model's output against), else its input width."""
    rolled = output_args.get("input_ids_rmpad_rolled")
    if isinstance(rolled, torch.Tensor):
        return int(rolled.reshape(-1).shape[0])
    return int(model_inputs["input_ids"].shape[-1])


def _model_on_full_row(model: Any, inputs: list[dict[str, Any]], widths: list[int], case: EngineCase,
                       poison: float) -> list[SimpleNamespace]:
    """The model on the whole packed row, each rank handed its ``widths[r]`` rows, tail poisoned.

    The row is the ranks' input slices concatenated (text models) or, when every rank was handed the
    same whole padded row (verl's vision-language path: the model slices after its embedding), that row.
    """
    replicated = len({mi["input_ids"].shape[-1] for mi in inputs}) == 1 and \
        inputs[0]["input_ids"].shape[-1] == sum(widths) and len(inputs) > 1 and \
        all(torch.equal(mi["input_ids"], inputs[0]["input_ids"]) for mi in inputs[1:])
    joined = dict(inputs[0])
    for key in ("input_ids", "position_ids", "shift_labels"):
        if key in joined and not (replicated and key != "shift_labels"):
            joined[key] = torch.cat([mi[key] for mi in inputs], dim=-1)
    if not replicated:
        return _call_model(model, inputs, case, poison)
    check_media_inputs(joined, case)
    return rank_outputs(_tracked(model(**joined)), case, poison, widths)


def on_device(micro_batch: TensorDict, device: str) -> TensorDict:
    on_cpu = all(v.device.type == "cpu" for v in micro_batch.values() if isinstance(v, torch.Tensor))
    return micro_batch if on_cpu and torch.device(device).type == "cpu" else move(micro_batch, device)


def _describe(exc: BaseException) -> tuple[bytes | None, str]:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text only
        blob = None
    return blob, text


def worker_main(rank: int, world: int, backend: str, store_path: str, log_dir: str, tasks: Any,
                 results: Any, parent: int) -> None:
    """One rank: join the group, then serve tasks until told to stop (or the parent is gone: torch's
    launcher also sends a rank SIGINT when its parent dies)."""
    torch.set_num_threads(1)
    coverage_hook.start(main=False)  # spec verify's engine-code coverage (spec.run.engine_coverage), if measured
    if os.path.isdir("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        with open(os.path.join(log_dir, f"rank{rank}.log"), "w", buffering=1) as log:
            for fd in (1, 2):  # the rank's own prints, warnings and fatal-signal tracebacks go to its log
                os.dup2(log.fileno(), fd)
            faulthandler.enable(file=log, all_threads=True)
            if hasattr(signal, "SIGUSR1"):
                faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
            try:
                _serve(rank, world, backend, store_path, tasks[rank], results, parent)
            except BaseException:
                log.write(traceback.format_exc())
                raise
            finally:
                faulthandler.disable()
    finally:
        coverage_hook.stop()
        if rank == 0 and orphaned(parent):  # the parent exited without closing the pool: tidy up
            shutil.rmtree(log_dir, ignore_errors=True)


def orphaned(parent: int) -> bool:
    """Whether the process that started the pool (pid ``parent``) is gone. A rank is its child when spawned, a
    child of the pool's fork server otherwise (:class:`spec.execute.ranks.RankPool`), so the parent is looked for
    by its pid, not only as ours."""
    if os.getppid() == parent:
        return False
    try:
        os.kill(parent, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a process of another user holds the pid now: ours is gone
        return True
    return False


def _serve(rank: int, world: int, backend: str, store_path: str, tasks: Any, results: Any, parent: int) -> None:
    timeout = timedelta(seconds=task_timeout())
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timeout)
    try:
        # every set of 2+ ranks, made once (every rank of the world takes part in each new_group): any topology's
        # SP groups; worlds [0, w) are also found by their size
        groups: dict[Any, Any] = {members: dist.new_group(list(members), timeout=timeout)
                                  for size in range(2, world + 1) for members in combinations(range(world), size)}
        groups.update({w: groups[tuple(range(w))] for w in WORLDS if w <= world})
        worker = _Worker(rank, backend, groups)
        results.put(dumps(("ready", rank, {})))
        while True:
            try:
                item = tasks.get(timeout=1.0)
            except queue.Empty:
                if orphaned(parent):  # the parent is gone: do not linger
                    return
                continue
            if item is None:
                return
            task_id, blob = item
            try:
                task = pickle.loads(blob)
                if task.get("load"):
                    worker.engine(task["engine"], task["recipe"])
                    reply = {"rank": rank, "loaded": True}
                else:
                    reply = worker.run(task)
            except Exception as exc:  # noqa: BLE001 - a suite-side failure is reported like an engine's
                reply = {"rank": rank, "error": (rank, *_describe(exc))}
            try:
                out = dumps((task_id, rank, reply))
            except Exception as exc:  # noqa: BLE001 - an unpicklable reply is an error, not a hang
                out = dumps((task_id, rank, {"rank": rank, "error": (rank, *_describe(exc))}))
            results.put(out)
    finally:
        dist.destroy_process_group()
