"""The real-rank reproducer's main (``INV-RANK-*``; :mod:`spec.repro.ranks`): the engine-case file started once per
rank over gloo (loopback), each rank building its engine for its own ``sp_rank`` with an all-gather over the group,
the stand-in model run once over the joined packed row, the parent checking every rank's results. Vendored after
the engine-case file's own code (whose runtime names it reads, bound by the runtime's ``share``), with the launcher
(:mod:`.launch`) and the suite's ``ShardedTopKProcessor`` (spec/execute/rank_worker.py) before it."""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

#: what the file binds for this module: the SP group and world (the writer), the launcher's functions, the suite's
#: ShardedTopKProcessor, and the engine-case file's names (its runtime's, and the suite's checks: bound by share)
BOUND = ("SP_GROUP", "WORLD", "run_ranks", "join_group", "ShardedTopKProcessor", "logits_processor", "_side",
         "ToyCausalLM", "execution_context", "make_engine", "_settings", "_views_in", "check_model_inputs", "_tracked",
         "rank_outputs", "POISONS", "POISON", "_views_out", "RUNS", "build_micro_batch", "CHECK_NAMES", "INPUTS_ONLY",
         "CHECKS", "INVARIANT", "padded_length", "reference", "read_positions", "OUTPUT_SPAN", "TAIL_MULTIPLE",
         "HANDS_TEMPERATURE", "rank_pad_and_tail", "rank_shapes", "rank_labels")


def _rank_processor(c, rank):
    """The logits_processor_func this rank hands its engine: the engine's own (its snippet's logits_processor) where
    it gives one, else the stand-in aligned with this rank's shard of the row (the suite's ShardedTopKProcessor)."""
    if not c.distillation_use_topk:
        return None
    own = logits_processor(c, c.sp_size, rank) if "logits_processor" in globals() else None
    return _side("suite", own if own is not None else ShardedTopKProcessor(tuple(c.distillation_keys), c.sp_size, rank))



def _sp():
    return max(run["case"]["sp_size"] for run in RUNS)


GROUP_OF = None  # this process's gloo group of the SP ranks (set in rank_main)


def _gathered(local):
    # every rank's shard, rank order, along dim 0 (what the suite's all-gather seam returns), autograd kept
    try:
        from torch.distributed.nn.functional import all_gather as differentiable
        with warnings.catch_warnings():  # deprecated in newer torch, still the differentiable one
            warnings.simplefilter("ignore")
            parts = differentiable(local.contiguous(), group=GROUP_OF)
    except (ImportError, RuntimeError):
        parts = [torch.empty_like(local) for _ in range(_sp())]
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


def rank_execute(c, mb, poison, rank, inputs_only=False):
    # one rank: its engine, its inputs (inputs_only: nothing more), the stand-in model once over the joined row, its
    # slice of the output
    model = ToyCausalLM(c.vocab, seed=c.seed, out_dim=1 if c.head == "value" else None, dtype=c.logits_dtype)
    with execution_context(c):
        eng = make_engine(c.head, **_settings(c, rank, GlooAllGather()))
        mi, args = eng.prepare_model_inputs(mb)
        view = _views_in(mi, args)
        if inputs_only:
            return view, None
        check_model_inputs(mi, rank)
        shared = {k: mi[k].detach() for k in ("input_ids", "position_ids", "shift_labels")
                  if isinstance(mi.get(k), torch.Tensor)}
        everyone = [shared]  # sp = 1 (a run a plan compares with): every rank runs the whole case alone
        if c.sp_size > 1:
            everyone = [None] * _sp()
            dist.all_gather_object(everyone, shared, group=GROUP_OF)
        joined = dict(mi)
        for key in shared:
            joined[key] = torch.cat([e[key] for e in everyone], dim=-1)
        widths = [e["input_ids"].shape[-1] for e in everyone]
        out = rank_outputs(_tracked(model(**joined)), c, POISONS[poison], widths)[rank if c.sp_size > 1 else 0]
        raw = eng.prepare_model_outputs(out, args, mb, _rank_processor(c, rank))  # the engine's own or the stand-in
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
            view, outputs = rank_execute(c, build_micro_batch(run), POISON, rank,
                                         inputs_only=set(CHECK_NAMES) <= INPUTS_ONLY | RANK_HANDOFF)
            results[run["label"]] = {"view": _detached(view), "outputs": _detached(outputs)}
        except Exception as exc:  # noqa: BLE001 - reported by the parent
            traceback.print_exc()
            results[run["label"]] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(results, Path(out, f"rank{global_rank}.pt"))
    dist.destroy_process_group()


# ---- the checks of what each rank handed over (its view: pad_size, labels, temperature, shift_labels): the
# invariants' own (spec/truth/rank_checks.py, written out into repro_suite.py) ----
def _field(run, key):
    return [v[key] for v in run.views]


def _padded(c):
    # the packed row's length: the bucket, the engine's tail rule, then sp (spec/truth/rules.py)
    return padded_length(c.total_nnz, c.pad_to_length, c.sp_size, TAIL_MULTIPLE)


def _leaked(c, mb, run):
    """(sequence, position) of every output value a consumer reads that is not finite where the reference (the
    sample alone, unpadded) is: what the poisoned tail put there."""
    want = reference(c, mb, run.model)
    read = read_positions(c.prompt_lens, c.response_lens, OUTPUT_SPAN)

    def leaked(key, value):
        bad = []
        for i, seq in enumerate(value.unbind() if key in want else ()):
            at = read[i]
            got, exp = seq.detach().to("cpu", torch.float64)[at], want[key][i][0][at]
            bad += [(i, int(k)) for k in at[~torch.isfinite(got) & torch.isfinite(exp)]]
        return bad
    return leaked


def _handed_temperatures(run):
    """Every rank's per-token temperature hand-off, or None for an engine that declares none (HANDS_TEMPERATURE
    False: it lacks the hand-off, one float per forward, SkyRL's), as the suite reads it."""
    return _field(run, "temperature") if HANDS_TEMPERATURE else None


def check_rank_pad(c, mb, run):
    """INV-RANK-003."""
    rank_pad_and_tail(_field(run, "input_ids"), _field(run, "position_ids"), _field(run, "labels"),
                      _handed_temperatures(run), _field(run, "pad_size"), run.rank_outputs, c.seq_lens, _padded(c),
                      c.sp_size, c.pad_to_length, mb["position_ids"].values().dim() > 1, _leaked(c, mb, run))


def check_rank_shapes(c, mb, run):
    """INV-RANK-006."""
    positions = mb["position_ids"].values()
    rank_shapes(_field(run, "input_ids"), _field(run, "position_ids"), _field(run, "labels"),
                _handed_temperatures(run), _field(run, "model_labels"), _field(run, "pad_size"), c.total_nnz,
                c.sp_size, positions.shape[0] if positions.dim() > 1 else None, c.use_fused_kernels)


def check_rank_roll_exact(c, mb, run):
    """INV-RANK-008."""
    rank_labels(_field(run, "labels"), _field(run, "model_labels"), mb["input_ids"].values(), c.seq_lens, _padded(c),
                c.sp_size, c.use_fused_kernels, exact=True)


#: the checks of what each rank handed over, beside the engine-case runtime's CHECKS
RANK_CHECKS = {"rank_pad": check_rank_pad, "rank_shapes": check_rank_shapes, "rank_roll_exact": check_rank_roll_exact}
#: the rank checks that read the ranks' hand-off alone: with the runtime's INPUTS_ONLY, their ranks stop after
#: prepare_model_inputs
RANK_HANDOFF = {"rank_shapes", "rank_roll_exact"}


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
            try:
                problem = {**CHECKS, **RANK_CHECKS}[name](c, mb, result)
            except AssertionError as exc:  # a check the invariant states in spec/truth/handoff_checks.py failed
                problem = str(exc)
            except (RuntimeError, IndexError, ValueError) as exc:  # reading what a rank returned: the engine's fault
                problem = (f"engine fault: reading what the ranks returned raised {type(exc).__name__}: "
                           f"{' '.join(str(exc).split())[:300]} (a malformed output, e.g. values shorter than its "
                           "offsets claim)")
            if problem:
                print(f"FAIL {INVARIANT} ({name}) on {run['label']}, sp={_sp()} real ranks (global ranks {SP_GROUP} of "
                      f"{WORLD}): {problem}")
                return 1
        print(f"ok: {run['label']} on {_sp()} real ranks: {', '.join(CHECK_NAMES)}")
    print(f"PASS: {INVARIANT} holds on this case")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        sys.exit(0)
    sys.exit(main_on_ranks())
