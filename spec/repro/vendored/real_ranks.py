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
#: ShardedTopKProcessor, and the engine-case file's names (its runtime's, bound by share)
BOUND = ("SP_GROUP", "WORLD", "run_ranks", "join_group", "ShardedTopKProcessor", "logits_processor", "_side",
         "ToyCausalLM", "execution_context", "make_engine", "_settings", "_views_in", "check_model_inputs", "_tracked",
         "rank_outputs", "POISONS", "POISON", "_views_out", "RUNS", "build_micro_batch", "CHECK_NAMES", "INPUTS_ONLY",
         "CHECKS", "INVARIANT", "padded_length", "reference", "read_span")


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


# ---- the checks of what each rank handed over (its view: pad_size, labels, temperature, shift_labels) ----
def _count(tensor):
    # the tokens a per-token hand-off tensor holds, whatever its shape (-1 when the engine hands none)
    return -1 if not isinstance(tensor, torch.Tensor) else tensor.numel()


def _replicated(run):
    # every rank was handed the whole padded row (an engine whose model slices after its embedding)
    ids = [v["input_ids"].detach().cpu() for v in run.views]
    local = sum(_count(v["labels"]) for v in run.views)
    return len(ids) > 1 and ids[0].shape[-1] == local and all(torch.equal(x, ids[0]) for x in ids[1:])


def _rows(run, key):
    # model input `key` over the whole padded row: the ranks' slices joined (or the row every rank got)
    parts = [v[key].detach().cpu() for v in run.views]
    return parts[0] if _replicated(run) else torch.cat(parts, dim=-1)


def _restarts(tail):
    # tail positions start at 0 and each is 0 or its left neighbour + 1, on every axis (the pad is its own
    # sequence or sequences, never part of the last real one)
    if tail.shape[-1] == 0:
        return True
    steps = tail[..., 1:]
    return bool((tail[..., 0] == 0).all()) and bool(((steps == 0) | (steps == tail[..., :-1] + 1)).all())


def _mrope(mb):
    return mb["position_ids"].values().dim() > 1  # (C, total) positions: mRoPE


def _share(c):
    padded = padded_length(c.total_nnz, c.pad_to_length, c.sp_size)
    return padded, padded - c.total_nnz, padded // c.sp_size


def check_rank_pad(c, mb, run):
    """INV-RANK-003: pad_size = bucket pad + SP pad, each rank (total + pad) / sp tokens, the tail's positions from 0
    with temperature 1, and outputs of exactly the real tokens, finite where the reference is."""
    total, sp = c.total_nnz, c.sp_size
    padded, pad, local = _share(c)
    why = (f"total_nnz {total} rounded up to the bucket {c.pad_to_length}, then to a multiple of sp={sp}: "
           f"{padded} tokens, {local} per rank")
    for r, view in enumerate(run.views):
        if view["pad_size"] != pad:
            return f"rank {r}: pad_size: got {view['pad_size']!r}, expected {pad} ({why})"
        ids, rolled = view["input_ids"], _count(view["labels"])
        width = ids.shape[-1]
        if rolled != local or ids.shape[0] != 1 or not (width == local or (_replicated(run) and width == local * sp)):
            return (f"rank {r}: input_ids {tuple(ids.shape)}, rolled labels ({rolled},): expected {local} tokens = "
                    f"(total_nnz {total} + pad {pad}) / sp (input_ids may be the whole padded row on every rank)")
    ids, pos = _rows(run, "input_ids")[0], _rows(run, "position_ids")
    temps = [v["temperature"] for v in run.views]
    if any(not isinstance(t, torch.Tensor) for t in temps):
        return f"the packed hand-off carries temperature {temps[0]!r}, expected one per token (a tensor)"
    temps = torch.cat([t.detach().reshape(-1).cpu() for t in temps])
    tail_pos = pos[..., 0, total:] if pos.dim() == 3 else pos[0, total:]
    if ids.shape[0] != padded or not _restarts(tail_pos) or not torch.equal(temps[total:].float(), torch.ones(pad)):
        return (f"packed row of {ids.shape[0]} tokens (expected {padded}), tail positions {tail_pos.tolist()}, "
                f"temperature {temps[total:].tolist()}; expected positions from 0 on every axis (runs 0, 1, 2, ...) "
                "and ones")
    offsets = torch.tensor([0, *c.seq_lens]).cumsum(0)
    want = reference(c, mb, run.model)
    for r, outputs in enumerate(run.rank_outputs):
        for key, value in sorted(outputs.items()):
            if not (isinstance(value, torch.Tensor) and value.is_nested) or \
                    not torch.equal(value.offsets().cpu(), offsets) or value.values().shape[0] != total:
                held = value.values().shape[0] if isinstance(value, torch.Tensor) and value.is_nested else "-"
                return (f"rank {r}: output {key!r} holds {held} tokens (offsets "
                        f"{value.offsets().tolist() if isinstance(value, torch.Tensor) and value.is_nested else '-'}), "
                        f"expected the {total} real ones (offsets {offsets.tolist()})")
            for i, seq in enumerate(value.unbind() if key in want else ()):
                lo, hi = read_span(c, i)
                got, exp = seq.detach().to("cpu", torch.float64)[lo:hi], want[key][i][0][lo:hi]
                bad = (~torch.isfinite(got) & torch.isfinite(exp)).nonzero()
                if bad.numel():
                    t = lo + int(bad[0, 0])
                    return (f"rank {r}: output {key!r} of sequence {i} at token {t}: got {got[t - lo].item()}, expected "
                            f"{exp[t - lo].item():.8g} (finite: the tail is poisoned, and the sample alone gives a "
                            "finite value there)")
    return None


def check_rank_shapes(c, mb, run):
    """INV-RANK-006: each rank's (1, n) ids, (1, n) or (C, 1, n) positions, its labels, temperature (whatever their
    private shape) and fused shift_labels of its n tokens, n * sp = total_nnz + pad_size, n the same on every rank."""
    sp, widths = c.sp_size, set()
    for r, view in enumerate(run.views):
        width = view["input_ids"].shape[-1]
        n = width // sp if _replicated(run) else width
        widths.add(n)
        pos = view["position_ids"]
        shapes = {"input_ids": (tuple(view["input_ids"].shape), (1, width)),
                  "position_ids": (None if pos is None else tuple(pos.shape),
                                   (mb["position_ids"].values().shape[0], 1, width) if _mrope(mb) else (1, width)),
                  "labels": ((_count(view["labels"]),), (n,)),
                  "temperature": ((_count(view["temperature"]),), (n,))}
        if c.use_fused_kernels:
            labels = view["model_labels"]
            shapes["shift_labels"] = (None if labels is None else tuple(labels.shape), (1, n))
        for key, (got, want) in shapes.items():
            if got != want:
                return (f"rank {r}: {key} has shape {got}, expected {want} (the rank's model input and output hold "
                        f"{n} tokens)")
        if n * sp != c.total_nnz + int(view["pad_size"] or 0):
            return (f"rank {r}: {n} tokens x {sp} ranks != total_nnz {c.total_nnz} + pad_size {view['pad_size']} "
                    f"(expected {_share(c)[2]} tokens per rank, pad_size {_share(c)[1]})")
    if len(widths) != 1:
        return f"ranks hold different numbers of tokens {sorted(widths)}"
    return None


def check_rank_roll_exact(c, mb, run):
    """INV-RANK-008: each rank's labels (and fused shift_labels) are exactly its slice of the global packed row
    rolled left by one (the wrap at each sequence end included), then zeros."""
    ids = mb["input_ids"].values().cpu()
    padded, pad, local = _share(c)
    want = torch.cat([torch.roll(ids, -1), ids.new_zeros(pad)])
    for r, view in enumerate(run.views):
        if view["labels"] is None:
            return f"rank {r}: the engine hands no labels to its output step"
        got, mine = view["labels"].detach().reshape(-1).cpu(), want[r * local:(r + 1) * local]
        what = (f"rank {r}'s slice [{r * local}, {(r + 1) * local}) of the global row {ids.tolist()} rolled left by "
                f"one, then {pad} zeros")
        if got.shape != mine.shape or not torch.equal(got, mine):
            wrong = [k for k in range(min(len(got), len(mine))) if got[k] != mine[k]]
            at = f"; first wrong at local position {wrong[0]} (global {r * local + wrong[0]})" if wrong else ""
            return f"rank {r}: rolled labels {got.tolist()}, expected {mine.tolist()} ({what}{at})"
        labels = view["model_labels"]
        if c.use_fused_kernels and (labels is None or tuple(labels.shape) != (1, local)
                                    or not torch.equal(labels[0].cpu(), mine)):
            return (f"rank {r}: fused shift_labels {None if labels is None else labels.tolist()}, expected "
                    f"[{mine.tolist()}] ({what})")
    return None


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
