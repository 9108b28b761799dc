"""Standalone reproducers for the real-rank invariants (``INV-RANK-*``): the file starts its own gloo ranks.

The file is the engine-case reproducer of the shrunk case (:mod:`.writer`: the micro-batch as data, the engine
built and called as its adapter does, the suite's stand-in model and hand-off, the float64 reference and the
checks of :mod:`.templates`), with its ``main`` run on real ranks instead of threads: started plainly it starts
``sp`` copies of itself (:mod:`.launch`), each joins one gloo group over loopback, builds the engine for its own
``sp_rank`` with an all-gather over that group (``torch.distributed.nn.functional.all_gather``, differentiable),
prepares its inputs, runs the stand-in model once over the joined packed row (every rank's inputs gathered, as the
suite's harness does) and hands the engine its own slice of the output, then saves what it handed the model and
the gathered outputs it returned. The parent checks every rank's outputs against the reference (the single-rank
answer: INV-RANK-001/009 every key, INV-RANK-005 the distillation keys, INV-RANK-007 with a bucket and fused
kernels), the ranks' labels joined against the global row rolled by one (INV-RANK-002), their positions joined
(INV-RANK-004).

Not written out: INV-RANK-003/006/008 check the engine's ``pad_size`` and the private shapes and every position
of its hand-off, which the written-out views (ids, positions, labels, mask) do not carry; and a topology of several
SP groups runs here as its first group only (the case as drawn, ranks ``0 .. sp-1``).
"""

from __future__ import annotations

from .launch import LAUNCH

__all__ = ["RANK_CHECKS", "on_real_ranks"]

#: invariant -> the checks of :mod:`.templates` its reproducer runs on the real ranks' results
RANK_CHECKS: dict[str, tuple[str, ...]] = {
    "INV-RANK-001": ("keys", "values"),
    "INV-RANK-009": ("keys", "values"),
    "INV-RANK-005": ("keys", "values"),
    "INV-RANK-007": ("keys", "values"),
    "INV-RANK-004": ("inputs", "keys", "values"),
    "INV-RANK-002": ("labels", "keys", "values"),
}

_GUARD = 'if __name__ == "__main__":\n    sys.exit(main())\n'


def on_real_ranks(source: str) -> str:
    """The engine-case reproducer ``source`` with its ``main`` run on real gloo ranks."""
    if not source.rstrip().endswith(_GUARD.rstrip()):
        raise ValueError("the engine-case reproducer does not end with its main guard")
    head = source.rstrip()[: -len(_GUARD.rstrip())]
    return head + "\n# ---- real ranks (gloo over loopback): this file started once per rank ----\n" + \
        "import os\nimport socket\nimport subprocess\nimport tempfile\nimport warnings\n\nimport torch.distributed as dist\n" + \
        LAUNCH + _RANKS


_RANKS = r'''

SP = RUNS[0]["case"]["sp_size"]


def _gathered(local):
    # every rank's shard, rank order, along dim 0 (what the suite's all-gather seam returns), autograd kept
    try:
        from torch.distributed.nn.functional import all_gather as differentiable
        with warnings.catch_warnings():  # deprecated in newer torch, still the differentiable one
            warnings.simplefilter("ignore")
            parts = differentiable(local.contiguous())
    except (ImportError, RuntimeError):
        parts = [torch.empty_like(local) for _ in range(SP)]
        dist.all_gather(parts, local.contiguous())
    return torch.cat(list(parts), dim=0)


class GlooAllGather:
    def member(self, rank):
        return _gathered


def _detached(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def rank_execute(c, mb, poison, rank):
    # one rank: its engine, its inputs, the stand-in model once over the joined row, its slice of the output
    model = ToyCausalLM(c.vocab, seed=c.seed, out_dim=1 if c.head == "value" else None, dtype=c.logits_dtype)
    with execution_context(c):
        eng = make_engine(c.head, **_settings(c, rank, GlooAllGather()))
        mi, args = eng.prepare_model_inputs(mb)
        view = _views_in(mi, args)
        check_model_inputs(mi, rank)
        shared = {k: mi[k].detach() for k in ("input_ids", "position_ids", "shift_labels")
                  if isinstance(mi.get(k), torch.Tensor)}
        everyone = [None] * SP
        dist.all_gather_object(everyone, shared)
        joined = dict(mi)
        for key in shared:
            joined[key] = torch.cat([e[key] for e in everyone], dim=-1)
        widths = [e["input_ids"].shape[-1] for e in everyone]
        out = rank_outputs(_tracked(model(**joined)), c, POISONS[poison], widths)[rank]
        processor = TopKProcessor(tuple(c.distillation_keys)) if c.distillation_use_topk else None
        raw = eng.prepare_model_outputs(out, args, mb, processor)
    return view, _views_out(raw)


def rank_main(rank, port, out):
    join_group(rank, SP, port)
    results = {}
    for run in RUNS:
        c = SimpleNamespace(**run["case"])
        try:
            view, outputs = rank_execute(c, build_micro_batch(run), POISON, rank)
            results[run["label"]] = {"view": _detached(view), "outputs": _detached(outputs)}
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            traceback.print_exc()
            results[run["label"]] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(results, Path(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def main_on_ranks():
    replies, problem = run_ranks(SP, "rank{rank}.pt", lambda path: torch.load(path, weights_only=False))
    if problem:
        print(f"FAIL {INVARIANT}: {problem}")
        return 1
    for run in RUNS:
        c = SimpleNamespace(**run["case"])
        mine = [reply[run["label"]] for reply in replies]
        errors = [(r, m["error"]) for r, m in enumerate(mine) if "error" in m]
        if errors:
            print(f"FAIL {INVARIANT} on {run['label']}: rank {errors[0][0]} got {errors[0][1]} (traceback above), "
                  "expected outputs (the micro-batch is valid)")
            return 1
        model = ToyCausalLM(c.vocab, seed=c.seed, out_dim=1 if c.head == "value" else None, dtype=c.logits_dtype)
        result = SimpleNamespace(model=model, views=[m["view"] for m in mine],
                                 rank_outputs=[m["outputs"] for m in mine])
        mb = build_micro_batch(run)
        for name in CHECK_NAMES:
            problem = CHECKS[name](c, mb, result)
            if problem:
                print(f"FAIL {INVARIANT} ({name}) on {run['label']}, sp={SP} real ranks: {problem}")
                return 1
        print(f"ok: {run['label']} on {SP} real ranks: {', '.join(CHECK_NAMES)}")
    print(f"PASS: {INVARIANT} holds on this case")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    sys.exit(main_on_ranks())
'''
