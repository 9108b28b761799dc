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
SP groups runs here as its first group only, at that group's global ranks of the topology's world (the other ranks
idle).
"""

from __future__ import annotations

from ..cases.structure import EngineCase
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


def on_real_ranks(source: str, case: EngineCase) -> str:
    """The engine-case reproducer ``source`` of ``case`` with its ``main`` run on real gloo ranks: its topology's
    first SP group at its global ranks (``[0, sp)`` without one), the other ranks of the world idle."""
    if not source.rstrip().endswith(_GUARD.rstrip()):
        raise ValueError("the engine-case reproducer does not end with its main guard")
    head = source.rstrip()[: -len(_GUARD.rstrip())]
    topology = getattr(case, "topology", None)
    group = list(topology.groups[0]) if topology is not None else list(range(case.sp_size))
    world = topology.world if topology is not None else case.sp_size
    return head + "\n# ---- real ranks (gloo over loopback): this file started once per rank ----\n" + \
        "import os\nimport socket\nimport subprocess\nimport tempfile\nimport warnings\n\nimport torch.distributed as dist\n" + \
        f"SP_GROUP = {group!r}\nWORLD = {world!r}\n" + LAUNCH + _RANKS


_RANKS = r'''

SP = max(run["case"]["sp_size"] for run in RUNS)
GROUP_OF = None  # this process's gloo group of the SP ranks (set in rank_main)


def _gathered(local):
    # every rank's shard, rank order, along dim 0 (what the suite's all-gather seam returns), autograd kept
    try:
        from torch.distributed.nn.functional import all_gather as differentiable
        with warnings.catch_warnings():  # deprecated in newer torch, still the differentiable one
            warnings.simplefilter("ignore")
            parts = differentiable(local.contiguous(), group=GROUP_OF)
    except (ImportError, RuntimeError):
        parts = [torch.empty_like(local) for _ in range(SP)]
        dist.all_gather(parts, local.contiguous(), group=GROUP_OF)
    return torch.cat(list(parts), dim=0)


class _Member:
    """A rank's all-gather over the gloo group (an engine that gathers itself, verl's, reads the group off it)."""

    def __call__(self, local):
        return _gathered(local)

    @property
    def group(self):
        return GROUP_OF


class GlooAllGather:
    def member(self, rank):
        return _Member()


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
        everyone = [shared]  # sp = 1 (a run a plan compares with): every rank runs the whole case alone
        if c.sp_size > 1:
            everyone = [None] * SP
            dist.all_gather_object(everyone, shared, group=GROUP_OF)
        joined = dict(mi)
        for key in shared:
            joined[key] = torch.cat([e[key] for e in everyone], dim=-1)
        widths = [e["input_ids"].shape[-1] for e in everyone]
        out = rank_outputs(_tracked(model(**joined)), c, POISONS[poison], widths)[rank if c.sp_size > 1 else 0]
        processor = TopKProcessor(tuple(c.distillation_keys)) if c.distillation_use_topk else None
        raw = eng.prepare_model_outputs(out, args, mb, processor)
    return view, _views_out(raw)


def rank_main(global_rank, port, out):
    global GROUP_OF
    join_group(global_rank, WORLD, port)
    GROUP_OF = dist.new_group(SP_GROUP)  # every rank of the world takes part in making it
    if global_rank not in SP_GROUP:  # a rank in no SP group idles
        torch.save({}, Path(out, f"rank{global_rank}.pt"))
        dist.destroy_process_group()
        return
    rank = SP_GROUP.index(global_rank)  # its rank within the SP group: what it slices by
    results = {}
    for run in RUNS:
        c = SimpleNamespace(**run["case"])
        try:
            view, outputs = rank_execute(c, build_micro_batch(run), POISON, rank)
            results[run["label"]] = {"view": _detached(view), "outputs": _detached(outputs)}
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            traceback.print_exc()
            results[run["label"]] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(results, Path(out, f"rank{global_rank}.pt"))
    dist.destroy_process_group()


def main_on_ranks():
    replies, problem = run_ranks(WORLD, "rank{rank}.pt", lambda path: torch.load(path, weights_only=False))
    if problem:
        print(f"FAIL {INVARIANT}: {problem}")
        return 1
    replies = [replies[r] for r in SP_GROUP]  # the SP group's ranks, in their group order
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
                print(f"FAIL {INVARIANT} ({name}) on {run['label']}, sp={SP} real ranks (global ranks {SP_GROUP} of "
                      f"{WORLD}): {problem}")
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
