"""Runs one case through an engine under test, end to end, with the model stand-in.

micro-batch -> engine.prepare_model_inputs -> toy model -> poisoned padding ->
engine.prepare_model_outputs. Sequence parallelism is simulated with one engine per
rank and an all-gather across threads; the model sees the whole packed row, as
Ulysses attention does.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any, Callable

import torch
from tensordict import TensorDict

from ..cases.materialize import materialize
from ..cases.structure import EngineCase
from ..protocol.engine import EngineUnderTest
from ..protocol.profile import padded_layout_of
from ..truth.oracle import TopKProcessor, scaled_logits
from . import coverage_hook, ranks
from .handoff import (
    POISONS,
    Run,
    ThreadedAllGather,
    _call_model,
    _fields,
    _settings,
    attach_outputs,
    attach_views,
    execution_context,
    model_for,
    snapshot,
)

__all__ = ["Run", "execute", "sp_runner_of", "processor_for", "FUSED_AUX_KEYS", "fused_linear_aux", "ThreadedAllGather", "POISONS", "model_for", "attach_views"]

def _in_threads(calls: list[Callable[[], Any]], gather: ThreadedAllGather) -> list[Any]:
    results: list[Any] = [None] * len(calls)
    errors: list[BaseException] = []

    def target(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)
            gather.barrier.abort()

    threads = [threading.Thread(target=target, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
        raise (real or errors)[0]
    return results


def sp_runner_of(engine: EngineUnderTest) -> Callable[..., Run] | None:
    """What runs ``engine``'s cases with ``sp_size > 1``: its own ``sp_runner``, real ranks where its sequence
    parallelism needs a process group (:func:`spec.execute.ranks.execute`), else None (threads in this process)."""
    return getattr(engine, "sp_runner", None) or (ranks.execute if engine.sp_on_real_ranks else None)


def execute(engine: EngineUnderTest, case: EngineCase, device: str = "cpu", *, poison: str = "nan",
            micro_batch: TensorDict | None = None, stop_after_inputs: bool = False,
            reuse: list[Any] | None = None) -> Run:
    """Run ``case`` through ``engine``; exceptions from the engine propagate.

    An engine whose sequence parallelism needs a real process group (verl's Ulysses path) sets
    :attr:`~spec.protocol.EngineUnderTest.sp_on_real_ranks` (or names its own ``sp_runner``): its ``sp > 1``
    cases run on real ranks (:func:`spec.execute.ranks.execute`).

    ``reuse``: engine objects kept across calls, as a trainer keeps its engine. An empty list is
    filled with the engine objects this call builds (one per rank); a filled one is used as is.

    The engine's calls and the model run in the case's execution context (autograd mode or autocast) (:func:`.handoff.execution_context`);
    the micro-batch, the model's weights and the snapshots the invariants compare with are made outside it."""
    sp_runner = sp_runner_of(engine)
    if reuse is not None and (case.sp_size > 1 or len(reuse) not in (0, case.sp_size)):
        raise ValueError(f"reuse holds {len(reuse)} engine objects for a case on {case.sp_size} rank(s); "
                         "engine objects are reused on one rank only")
    if case.sp_size > 1 and sp_runner is not None:
        return sp_runner(engine, case, device, poison=poison, micro_batch=micro_batch,
                         stop_after_inputs=stop_after_inputs)
    mb = materialize(case, device) if micro_batch is None else micro_batch
    run = Run(case, device, mb, snapshot(mb), model_for(case, device, engine))
    gather = ThreadedAllGather(case.sp_size) if case.sp_size > 1 else None
    with execution_context(case, device):
        return _execute(engine, case, run, mb, gather, poison, stop_after_inputs, reuse)


#: the per-token terms a fused LM-head kernel that also computes top-K distillation returns beside its log-probs
#: (VeOmni's chunk_topk_distill: the model output's ``fused_linear_aux``)
FUSED_AUX_KEYS = ("distillation_losses", "student_mass", "teacher_mass")


def fused_linear_aux(logits: torch.Tensor, case: EngineCase, mb: TensorDict, processor: Callable | None = None
                     ) -> SimpleNamespace:
    """The stand-in fused model's ``fused_linear_aux`` on one packed row: :data:`FUSED_AUX_KEYS`, ``(1, total_nnz)``
    float32 each, the top-K terms on the tempered logits (what the kernel computes chunk by chunk) by ``processor``
    (the engine's own companion where it has one: its loss definition) or the suite's."""
    z = scaled_logits(logits[:, :case.total_nnz], case.temperatures()[0])
    terms = (processor or TopKProcessor(FUSED_AUX_KEYS))(student_logits=z, data=mb)
    return SimpleNamespace(**{key: terms[key].float() for key in FUSED_AUX_KEYS})


def processor_for(engine: EngineUnderTest, case: EngineCase, sp_size: int, sp_rank: int) -> Callable | None:
    """The ``logits_processor_func`` rank ``sp_rank`` hands its engine for ``case``: None without top-K
    distillation, else the engine's own (:meth:`~spec.protocol.EngineUnderTest.logits_processor`) where it gives
    one, else the suite's stand-in (:class:`~spec.truth.oracle.TopKProcessor`)."""
    if not case.distillation_use_topk:
        return None
    own = engine.logits_processor(case, sp_size, sp_rank)
    return own if own is not None else TopKProcessor(case.distillation_keys)


def _execute(engine: EngineUnderTest, case: EngineCase, run: Run, mb: TensorDict, gather: ThreadedAllGather | None,
             poison: str, stop_after_inputs: bool, reuse: list[Any] | None) -> Run:
    engines = reuse if reuse else [engine.make(case.head, **_settings(case, r, gather)) for r in range(case.sp_size)]
    if reuse is not None and not reuse:
        reuse.extend(engines)
    for eng in engines:
        model_inputs, output_args = eng.prepare_model_inputs(mb)
        run.inputs.append(model_inputs)
        run.output_args.append(output_args)
    attach_views(run, engine)
    if stop_after_inputs:
        return run
    run.model_outputs = _call_model(run.model, run.inputs, case, POISONS[poison], padded_layout_of(engine, case))
    if case.use_fused_kernels and case.distillation_use_topk and case.fused_aux and case.use_remove_padding \
            and len(engines) == 1:
        run.model_outputs[0].fused_linear_aux = fused_linear_aux(run.model_outputs[0].logits, case, mb,
                                                                 processor_for(engine, case, 1, 0))
    run.model_output_snapshots = [{k: v.detach().clone() for k, v in _fields(o).items()} for o in run.model_outputs]
    run.output_args_snapshots = [{k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                                  for k, v in args.items()}
                                 for args in run.output_args]
    processors = [processor_for(engine, case, case.sp_size, r) for r in range(len(engines))]

    def call(eng: Any, r: int) -> Any:
        with execution_context(case, run.device):  # autograd's and autocast's modes are per thread: each rank's thread enters it again
            return eng.prepare_model_outputs(run.model_outputs[r], run.output_args[r], mb, processors[r])

    calls = [(lambda eng=eng, r=r: call(eng, r)) for r, eng in enumerate(engines)]
    if gather is None:
        raw = [calls[0]()]
    else:
        with coverage_hook.engine_code():  # the ranks' threads run the engine's code: measured (a gated measurement)
            raw = _in_threads(calls, gather)
    attach_outputs(run, engine, raw)
    return run
