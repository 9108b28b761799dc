"""Benchmark impl's micro-batch layer against verl 0.9.1's; print a Markdown table.

    python bench/microbatch.py [--quick] [--out bench/results-microbatch.md]

Rows at mini-batch sizes 256, 1024, 4096, 8192 (quick: 64, 256): dynamic batch size
(``rearrange_micro_batches``: partition + per-micro-batch selection), restore
(``postprocess_batch_func``: the micro-batches' nested outputs concatenated and put back
in mini-batch order), fixed-size chunking (``prepare_micro_batches`` without dynamic
batch size) and ``concat_tensordict`` of the chunks. impl and verl run on the very same
seeded objects in one process; times are medians of ``torch.utils.benchmark`` runs pooled
over interleaved rounds (``bench/run.py``'s ``median_times``), peak memory is the extra
resident set of one call measured in a second process (``bench/memory.py``). Outputs are
compared in the same run; for the dynamic rows (impl's partition is not verl's) the check
is verl's contract and the balance: each column's largest micro-batch workload over the
lower bound ``ceil(total / k)``, and the micro-batch counts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

if __package__ in (None, ""):  # ``python bench/microbatch.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from tensordict import NonTensorData, NonTensorStack, TensorDict  # noqa: E402

import impl  # noqa: E402
from bench import memory  # noqa: E402
from bench.run import _load_average, environment, fmt_mib, fmt_time, median_times  # noqa: E402

Fn = Callable[[], Any]

SIZES = [256, 1024, 4096, 8192]
QUICK_SIZES = [64, 256]
MAX_PROMPT, MAX_RESPONSE = 1024, 4096
BUDGET = 65536  # max_token_len_per_gpu * sp_size (e.g. 32768 x 2)
MICRO = 16  # micro_batch_size_per_gpu of the fixed-size rows
SLOW_S = 10.0  # a verl call slower than this is timed once (its check call), not in rounds
SLOW_BATCH = 4096  # default: verl's rearrange from this size gets no memory pass (one call can take minutes)
VERL_MEMORY_MAX: int = SLOW_BATCH - 1  # --verl-memory-max: the largest size whose verl rearrange is measured
VERL_REARRANGE_MAX: int | None = None  # --verl-rearrange-max: larger batches time impl's rearrange alone


def load_verl():
    if os.environ.get("BENCH_NO_VERL"):
        return None
    try:
        from verl.utils import seqlen_balancing, tensordict_utils
        from verl.workers.engine import utils as engine_utils
    except Exception:  # noqa: BLE001 - verl absent: impl columns only
        return None
    import verl

    return type("Verl", (), {"version": verl.__version__, "sb": seqlen_balancing, "tu": tensordict_utils,
                             "eu": engine_utils})


def mini_batch(batch: int, seed: int = 0) -> TensorDict:
    """A NO_PADDING mini-batch as verl's trainer hands it: prompt/response lengths uniform in [1, max]."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, MAX_PROMPT + 1, (batch,), generator=gen)
    response = torch.randint(1, MAX_RESPONSE + 1, (batch,), generator=gen)
    seq = prompt + response
    off = torch.nn.functional.pad(seq.cumsum(0), (1, 0))
    poff = torch.nn.functional.pad(prompt.cumsum(0), (1, 0))
    roff = torch.nn.functional.pad(response.cumsum(0), (1, 0))
    total, rtotal = int(seq.sum()), int(response.sum())

    def nested(values, offsets):
        return torch.nested.nested_tensor_from_jagged(values, offsets)

    rows = torch.repeat_interleave(torch.arange(batch), seq)
    td = TensorDict({
        "input_ids": nested(torch.randint(0, 32000, (total,), generator=gen), off),
        "position_ids": nested(torch.arange(total) - off[:-1][rows], off),
        "prompts": nested(torch.randint(0, 32000, (int(prompt.sum()),), generator=gen), poff),
        "responses": nested(torch.randint(0, 32000, (rtotal,), generator=gen), roff),
        "response_mask": nested(torch.ones(rtotal, dtype=torch.int64), roff),
        "old_log_probs": nested(-torch.rand(rtotal, generator=gen), roff),
        "advantages": nested(torch.randn(rtotal, generator=gen), roff),
        "uid": NonTensorStack.from_list([NonTensorData(f"u{i // 8}") for i in range(batch)]),
    }, batch_size=[batch])
    td["temperature"] = NonTensorData(1.0)
    td["max_token_len_per_gpu"] = NonTensorData(BUDGET)
    return td


@dataclass
class Row:
    function: str
    case: str
    impl: Fn
    verl: Fn | None
    check: Callable[[], str]
    times: dict[str, float] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)
    peaks: dict[str, int | None] = field(default_factory=dict)
    note: str = ""
    #: verl's single call (timed in the check) when it exceeds SLOW_S: then it is verl's only timing
    verl_once: float | None = None
    #: whether the memory pass measures verl too (not for the rows where one verl call takes minutes)
    verl_memory: bool = True


def _same_nested(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (torch.equal(a.values(), b.values()) and torch.equal(a.offsets(), b.offsets())
            and a._ragged_idx == b._ragged_idx)


def _same_td(a: TensorDict, b: TensorDict) -> bool:
    for key in a.keys():
        x, y = a.get(key), b.get(key)
        if isinstance(x, torch.Tensor):
            if not (_same_nested(x, y) if x.is_nested else torch.equal(x, y)):
                return False
        elif hasattr(x, "tolist") and x.tolist() != y.tolist():
            return False
    return sorted(a.keys()) == sorted(b.keys())


def rows_for(batch: int, verl) -> list[Row]:
    td = mini_batch(batch, seed=batch)
    lens = td["input_ids"].offsets().diff()
    case = f"B={batch} N={int(lens.sum())}"
    rows: list[Row] = []
    workload = impl.calculate_workload(lens)

    def balance(parts: list[list[int]]) -> str:
        top = max(int(workload[p].sum()) for p in parts)
        bound = impl.ceildiv(int(workload.sum()), len(parts))
        fits = all(int(lens[p].sum()) <= BUDGET for p in parts) and sorted(sum(parts, [])) == list(range(batch))
        return f"k={len(parts)} max/LB={top / bound:.6f}{'' if fits else ' BROKEN'}"

    def rearrange_check() -> str:
        mine_mb, mine = impl.rearrange_micro_batches(td, BUDGET)
        same = all(_same_td(m, impl.index_select_tensor_dict(td, p)) for m, p in zip(mine_mb, mine))
        text = f"impl {balance(mine)}"
        if verl_rearranges:
            t0 = time.perf_counter()
            _, theirs = verl.sb.rearrange_micro_batches(td, BUDGET)
            once = time.perf_counter() - t0
            if once > SLOW_S:
                rows[0].verl_once = once
            text += f"; verl {balance(theirs)}"
        return text + ("" if same else " (micro-batch rows DIFF)")

    verl_rearranges = verl and (VERL_REARRANGE_MAX is None or batch <= VERL_REARRANGE_MAX)
    rows.append(Row("rearrange_micro_batches (dynamic bsz)", case, lambda: impl.rearrange_micro_batches(td, BUDGET),
                    verl_rearranges and (lambda: verl.sb.rearrange_micro_batches(td, BUDGET)), rearrange_check,
                    verl_memory=batch <= VERL_MEMORY_MAX))

    # restore: the model's per-response outputs of each micro-batch, back in mini-batch order
    micro, idx = impl.rearrange_micro_batches(td, BUDGET)
    outputs = [{"model_output": {"log_probs": m["old_log_probs"].clone(), "entropy": m["advantages"].clone()},
                "loss": torch.tensor(0.0), "metrics": {}} for m in micro]
    flags = TensorDict({}, batch_size=[])

    def restore_check() -> str:
        mine = impl.postprocess_batch_func(outputs, idx, flags)["model_output"]
        ok = _same_nested(mine["log_probs"], td["old_log_probs"]) and _same_nested(mine["entropy"], td["advantages"])
        if verl:
            theirs = verl.eu.postprocess_batch_func(outputs, idx, flags)["model_output"]
            ok = ok and all(_same_nested(mine[k], theirs[k]) for k in mine)
        return "exact" if ok else "DIFF"

    rows.append(Row("postprocess_batch_func (concat + restore)", case,
                    lambda: impl.postprocess_batch_func(outputs, idx, flags),
                    verl and (lambda: verl.eu.postprocess_batch_func(outputs, idx, flags)), restore_check))

    fixed = td.clone(recurse=False)
    fixed["use_dynamic_bsz"] = NonTensorData(False)
    fixed["micro_batch_size_per_gpu"] = NonTensorData(MICRO)

    def chunk_check() -> str:
        if not verl:
            return "n/a"
        mine, theirs = impl.prepare_micro_batches(fixed)[0], verl.eu.prepare_micro_batches(fixed)[0]
        return "exact" if all(_same_td(a, b) for a, b in zip(mine, theirs)) and len(mine) == len(theirs) else "DIFF"

    rows.append(Row(f"prepare_micro_batches (fixed, {MICRO} per micro-batch)", case,
                    lambda: impl.prepare_micro_batches(fixed), verl and (lambda: verl.eu.prepare_micro_batches(fixed)),
                    chunk_check))

    parts = (verl.tu if verl else impl).chunk_tensordict(td, batch // MICRO)

    def concat_check() -> str:
        mine = impl.concat_tensordict(parts)
        ok = _same_td(mine, td)
        if verl:
            ok = ok and _same_td(mine, verl.tu.concat_tensordict(parts))
        return "exact" if ok else "DIFF"

    rows.append(Row(f"concat_tensordict ({batch // MICRO} parts)", case, lambda: impl.concat_tensordict(parts),
                    verl and (lambda: verl.tu.concat_tensordict(parts)), concat_check))
    return rows


def measure(row: Row, min_time: float) -> None:
    torch.set_num_threads(1)
    row.note = row.check()
    slow = row.verl_once is not None
    who = [("impl", row.impl)] + ([("verl", row.verl)] if row.verl and not slow else [])
    row.times = median_times(who, 1, min_time, row.rounds)
    if slow:  # one call of verl's (the check's): rounds of it would take hours on this VM
        row.times["verl"] = row.verl_once
        row.rounds["verl"] = [row.verl_once] * len(row.rounds["impl"])
        row.note += f" (verl timed once: {row.verl_once:.0f} s)"


def table(rows: list[Row], with_memory: bool) -> str:
    head = ["function", "case", "impl median", "verl median", "verl/impl (range over rounds)", "outputs"]
    if with_memory:
        head += ["peak MiB impl", "peak MiB verl"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        t = row.times
        ratio = "n/a"
        if "verl" in t:
            spread = [v / i for v, i in zip(row.rounds.get("verl", []), row.rounds.get("impl", []))]
            ratio = f"{t['verl'] / t['impl']:.2f} ({min(spread):.2f}-{max(spread):.2f})"
        cells = [row.function, row.case, fmt_time(t["impl"]), fmt_time(t.get("verl")), ratio, row.note]
        if with_memory:
            cells += [fmt_mib(row.peaks.get("impl")),
                      fmt_mib(row.peaks.get("verl")) if row.verl_memory else "not measured"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: list[Row], with_memory: bool) -> str:
    timed = [r for r in rows if "verl" in r.times and int(r.case.split()[0][2:]) >= 256]
    lines = []
    miss = [f"{r.function} {r.case}: {r.times['verl'] / r.times['impl']:.2f}x" for r in timed
            if r.times["verl"] < 1.2 * r.times["impl"]]
    lines.append(f"- every row at B >= 256 >= 1.2x verl's speed: {'met' if not miss else 'NOT met: ' + '; '.join(miss)}")
    if with_memory:
        big = [r for r in timed if r.peaks.get("verl") is not None and r.peaks.get("impl") is not None]
        miss = [f"{r.function} {r.case}: {fmt_mib(r.peaks['impl'])} vs {fmt_mib(r.peaks['verl'])} MiB" for r in big
                if r.peaks["impl"] > r.peaks["verl"] and r.peaks["impl"] >= 2**20]
        lines.append(f"- peak memory no higher than verl's (rows >= 1 MiB): "
                     f"{'met' if not miss else 'NOT met: ' + '; '.join(miss)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"sizes {QUICK_SIZES} only")
    parser.add_argument("--sizes", default=None, help="comma-separated mini-batch sizes (default 256,1024,4096,8192)")
    parser.add_argument("--min-time", type=float, default=0.3, help="blocked_autorange time per column and row")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--only", default="", help="rows whose function contains this substring")
    parser.add_argument("--out", default=None)
    parser.add_argument("--verl-rearrange-max", type=int, default=None,
                        help="skip verl's rearrange_micro_batches above this mini-batch size (one call takes "
                             "longer than a run can wait on a loaded VM)")
    parser.add_argument("--verl-memory-max", type=int, default=SLOW_BATCH - 1,
                        help=f"measure the peak memory of verl's rearrange_micro_batches up to this mini-batch size "
                             f"(default {SLOW_BATCH - 1}: above it one call can take minutes on a loaded VM)")
    parser.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = ([int(s) for s in args.sizes.split(",")] if args.sizes else QUICK_SIZES if args.quick else SIZES)
    verl = load_verl()
    torch.set_num_threads(1)
    global VERL_REARRANGE_MAX, VERL_MEMORY_MAX
    VERL_REARRANGE_MAX = args.verl_rearrange_max
    VERL_MEMORY_MAX = args.verl_memory_max

    def all_rows():
        for batch in sizes:
            for row in rows_for(batch, verl):
                if args.only in row.function:
                    yield row

    if args.memory_child:
        if not memory.setup():
            raise SystemExit("memory measurement unsupported here")
        peaks = {}
        for row in all_rows():
            who = [("impl", row.impl)] + ([("verl", row.verl)] if row.verl and row.verl_memory else [])
            for _, fn in who:
                fn()  # warm-up: lazy imports and first-call caches
            peaks[f"{row.function}|{row.case}"] = {name: memory.peak_bytes(fn) for name, fn in who}
        with open(args.memory_child, "w") as f:
            json.dump(peaks, f)
        return 0

    started = time.perf_counter()
    load_before = _load_average()
    rows = []
    for row in all_rows():
        t0 = time.perf_counter()
        measure(row, args.min_time)
        rows.append(row)
        print(f"  [{time.perf_counter() - started:6.1f}s] {row.function} | {row.case} | {row.note} "
              f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
    load_after = _load_average()
    with_memory = not args.no_memory
    if with_memory:
        print("  memory pass (separate process) ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "peaks.json")
            try:
                subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--_memory-child", out], check=True,
                               stdout=subprocess.DEVNULL)
                with open(out) as f:
                    peaks = json.load(f)
            except (subprocess.CalledProcessError, OSError) as exc:
                print(f"  memory pass failed: {exc}", file=sys.stderr)
                peaks, with_memory = {}, False
        for row in rows:
            row.peaks = peaks.get(f"{row.function}|{row.case}", {})
    venv = "verl " + verl.version if verl else "verl: not importable"
    report = "\n\n".join([
        f"Environment: {environment(None).replace('verl: not importable (verl columns n/a); ', '')}; {venv}; 1 thread",
        f"Command: `python bench/microbatch.py {' '.join(argv)}`; budget max_token_len={BUDGET}, prompt/response "
        f"lengths uniform in [1, {MAX_PROMPT}] / [1, {MAX_RESPONSE}], fixed rows {MICRO} samples per micro-batch; "
        f"total wall time {time.perf_counter() - started:.0f} s; load average (1/5/15 min) before {load_before}, "
        f"after timing {load_after}.",
        table(rows, with_memory),
        "### Targets\n\n" + targets(rows, with_memory),
    ]) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
