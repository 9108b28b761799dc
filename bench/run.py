"""Benchmark impl against verl (when importable) and a copy floor; print a Markdown table.

    python -m bench [--quick] [--threads 1,2] [--out bench/results.md]
    python bench/run.py ...

Each row: one function on one seeded input, called by impl, verl and the floor on the very
same objects in this process. Times are ``torch.utils.benchmark`` medians
(``Timer.blocked_autorange``, ``num_threads`` set per column, three interleaved rounds). Outputs are compared in the
same run. Peak memory is the extra resident set of one call (see ``bench/memory.py``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Iterable

if __package__ in (None, ""):  # ``python bench/run.py``
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

warnings.filterwarnings("ignore", message="is_fx_tracing")

import tensordict  # noqa: E402
import torch  # noqa: E402
from torch.utils import benchmark  # noqa: E402

import impl  # noqa: E402
from bench import cases as C  # noqa: E402
from bench import memory, verl_adapter  # noqa: E402

Fn = Callable[[], Any]


# --------------------------------------------------------------------------- comparison

def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten an output (tensor, nested tensor, dict, TensorDict subset) to named dense tensors."""
    if isinstance(obj, torch.Tensor):
        if obj.is_nested:
            return {f"{prefix}values": obj.values(), f"{prefix}offsets": obj.offsets()}
        return {prefix.rstrip(".") or "out": obj}
    out: dict[str, torch.Tensor] = {}
    for key, value in obj.items():
        if isinstance(value, torch.Tensor):
            out.update(_tensors(value, f"{prefix}{key}."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[f"{prefix}{key}"] = torch.tensor(value)
    return out


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], *, atol: float, rtol: float) -> str:
    """'exact' (same dtype, bit-identical), 'close ...' (allclose), or 'DIFF ...'."""
    if sorted(a) != sorted(b):
        return f"DIFF keys {sorted(set(a) ^ set(b))}"
    exact, worst, dtypes = True, 0.0, set()
    for key in a:
        x, y = a[key], b[key]
        if tuple(x.shape) != tuple(y.shape):
            return f"DIFF shape {key} {tuple(x.shape)} vs {tuple(y.shape)}"
        if x.dtype != y.dtype:
            dtypes.add(f"{key}: {str(x.dtype)[6:]} vs {str(y.dtype)[6:]}")
            if x.is_floating_point() or y.is_floating_point():
                exact = False
        if exact and torch.equal(x.to(torch.promote_types(x.dtype, y.dtype)), y.to(torch.promote_types(x.dtype, y.dtype))):
            continue
        exact = False
        xd, yd = x.double(), y.double()
        diff = (xd - yd).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        if not torch.allclose(xd, yd, atol=atol, rtol=rtol):
            return f"DIFF max abs {worst:.2g}"
    if exact:
        return "exact"
    note = f" ({'; '.join(sorted(dtypes))})" if dtypes else ""
    return f"close, max abs {worst:.2g}{note}"


# --------------------------------------------------------------------------- rows


def _offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0))

@dataclass
class Row:
    function: str
    case: str
    impl: Fn
    floor: Fn
    verl: Fn | None = None
    extract: Callable[[Any], dict[str, torch.Tensor]] = _tensors
    atol: float = 0.0
    rtol: float = 0.0
    #: the best plain-torch gather of the same output elements (indices precomputed), slice helpers only
    gather: Fn | None = None
    group: str = "helper"  # helper | outputs-packed | outputs-padded
    batch: int = 0
    min_time: float | None = None
    # filled in
    check: str = "n/a"
    times: dict[int, dict[str, float]] = field(default_factory=dict)
    #: per-round medians (the spread of each column across the interleaved rounds)
    rounds: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    peaks: dict[int, dict[str, int | None]] = field(default_factory=dict)


def _clone_all(tensors: Iterable[torch.Tensor]) -> Fn:
    """The floor: one copy of the given output bytes."""
    tensors = [t for t in tensors]
    return lambda: [t.clone() for t in tensors]


def _floor_of(output: Any) -> Fn:
    return _clone_all(t for k, t in _tensors(output).items() if not k.endswith("offsets"))


def _inputs_view(pair: tuple[dict, dict]) -> dict[str, torch.Tensor]:
    model_inputs, output_args = pair
    keep = ("input_ids", "position_ids", "attention_mask")
    flat = {f"in.{k}": v for k, v in model_inputs.items() if k in keep and isinstance(v, torch.Tensor)}
    for key in ("input_ids_rmpad_rolled", "temperature_rmpad", "temperature", "pad_size"):
        if key in output_args:
            value = output_args[key]
            flat[f"args.{key}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return flat


def _index(rows: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, stride: int) -> torch.Tensor:
    """int32 flat indices ``rows[i] * stride + starts[i] + k`` for ``k < lengths[i]``, back to back."""
    rep = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return (rows[rep] * stride + starts[rep] + within).to(torch.int32)


def _gather(source: torch.Tensor, index: torch.Tensor, shape: tuple[int, ...] | None = None) -> Fn:
    """A plain gather of precomputed elements: what any implementation must at least do."""
    flat = source.reshape(-1)
    if shape is None:
        return lambda: flat.index_select(0, index)
    return lambda: flat.index_select(0, index).view(shape)


def helper_rows(case: C.HelperCase, verl: verl_adapter.Verl | None) -> list[Row]:
    geo = C.make_geometry(case.batch, case.max_prompt, case.max_response, seed=case.seed)
    pad_mode = verl.pad_mode if verl else "no_padding"
    label = f"{case.name} N={geo.total}"
    rows: list[Row] = []
    vp = verl.padding if verl else None

    mb = C.micro_batch(geo, pad_mode=pad_mode)
    ids, loss_mask = mb["input_ids"], mb["loss_mask"]
    g = torch.Generator().manual_seed(case.seed + 7)
    per_token = torch.nested.nested_tensor_from_jagged(torch.randn(geo.total, generator=g), ids.offsets())
    dense_resp = torch.randn(geo.batch, int(geo.response_lens.max()), generator=g)
    lr = C.left_right_batch(geo)

    def add(name: str, impl_fn: Fn, verl_fn: Fn | None, extract=_tensors, gather: Fn | None = None) -> None:
        if gather is not None:  # the gather floor returns exactly impl's output elements
            out = impl_fn()
            assert torch.equal(gather(), out.values() if out.is_nested else out), f"gather floor of {name}"
        rows.append(Row(name, label, impl_fn, _floor_of(impl_fn()), verl_fn, extract, gather=gather,
                        batch=geo.batch))

    # precomputed indices of the elements each slice helper returns
    resp, seq_end = geo.response_lens, _offsets_of(geo.seq_lens)[1:]
    width = int(resp.max())
    batch_rows = torch.arange(geo.batch)
    resp_src = _index(torch.zeros_like(resp), seq_end - resp - 1, resp, 0)  # into the packed values
    padded_values = torch.cat([per_token.values(), per_token.values().new_zeros(1)])  # pad slots read the 0
    slot = torch.full((geo.batch, width), geo.total, dtype=torch.int32)
    slot.view(-1)[_index(batch_rows, torch.zeros_like(resp), resp, width).long()] = resp_src

    add("build_attention_mask_from_nested", lambda: impl.build_attention_mask_from_nested(ids),
        vp and (lambda: vp.build_attention_mask_from_nested(ids)))
    add("no_padding_2_padding", lambda: impl.no_padding_2_padding(per_token, mb),
        vp and (lambda: vp.no_padding_2_padding(per_token, mb)),
        gather=_gather(padded_values, slot.view(-1), (geo.batch, width)))
    add("response_from_nested", lambda: impl.response_from_nested(per_token, loss_mask),
        vp and (lambda: vp.response_from_nested(per_token, loss_mask)),
        gather=_gather(per_token.values(), resp_src))
    add("response_to_nested", lambda: impl.response_to_nested(dense_resp, loss_mask),
        vp and (lambda: vp.response_to_nested(dense_resp, loss_mask)),
        gather=_gather(dense_resp, _index(batch_rows, torch.zeros_like(resp), resp, dense_resp.shape[1])))

    lr_keys = ("input_ids", "position_ids")

    def lr_extract(td: Any) -> dict[str, torch.Tensor]:
        flat = _tensors({k: td[k] for k in lr_keys})
        return {k: (v.long() if k.endswith("offsets") else v) for k, v in flat.items()}

    impl_lr = impl.left_right_2_no_padding(lr)
    produced = ("input_ids", "position_ids", "loss_mask")  # what it makes; the rest is carried over
    lr_width = lr["response_mask"].shape[1]
    lr_seq = lr["input_ids"].shape[1]
    tok_index = _index(batch_rows, lr_seq - lr_width - geo.prompt_lens, geo.seq_lens, lr_seq)
    resp_index = _index(batch_rows, torch.zeros_like(resp), resp, lr_width)
    lr_gathers = [_gather(lr["input_ids"], tok_index), _gather(lr["position_ids"], tok_index),
                  _gather(lr["response_mask"], resp_index)]
    assert all(torch.equal(g(), impl_lr[k].values()) for g, k in zip(lr_gathers, produced)), "left_right gather"
    rows.append(Row("left_right_2_no_padding", label, lambda: impl.left_right_2_no_padding(lr),
                    _clone_all(t for k, t in _tensors({k: impl_lr[k] for k in produced}).items()
                               if not k.endswith("offsets")),
                    # verl pops/sets keys of its argument: it gets a fresh shallow copy per call
                    vp and (lambda: verl_adapter.shallow(vp.left_right_2_no_padding)(lr)),
                    lr_extract, gather=lambda: [g() for g in lr_gathers], batch=geo.batch))

    engine = impl.LMHeadEngine()
    for packed in (True, False):
        batch = C.micro_batch(geo, use_remove_padding=packed, pad_mode=pad_mode)
        impl_fn = (lambda b=batch: engine.prepare_model_inputs(b))
        verl_fn = verl and (lambda b=batch: verl.engine.prepare_model_inputs(b))
        mode = "packed" if packed else "padded"
        rows.append(Row(f"prepare_model_inputs [{mode}]", label, impl_fn,
                        _clone_all(_inputs_view(impl_fn()).values()), verl_fn, _inputs_view, batch=geo.batch))
    return rows


def output_rows(case: C.OutputCase, verl: verl_adapter.Verl | None, dtypes: list[torch.dtype],
                min_time: float) -> Iterable[Row]:
    """Rows for prepare_model_outputs; yields lazily so only one logits tensor lives at a time."""
    geo = C.make_geometry(case.batch, case.max_prompt, case.max_response, vocab=case.vocab, seed=case.seed)
    pad_mode = verl.pad_mode if verl else "no_padding"
    engine = impl.LMHeadEngine()
    for dtype in dtypes:
        short = {torch.float32: "f32", torch.bfloat16: "bf16"}[dtype]
        for packed in (True, False):
            mode = "packed" if packed else "padded"
            logits = C.packed_logits(geo, dtype) if packed else C.padded_logits(geo, dtype)
            output = SimpleNamespace(logits=logits)
            gib = logits.numel() * logits.element_size() / 2**30
            for entropy in (False, True):
                mb = C.micro_batch(geo, use_remove_padding=packed, calculate_entropy=entropy, pad_mode=pad_mode)
                _, impl_args = engine.prepare_model_inputs(mb)
                impl_fn = (lambda a=impl_args, b=mb: engine.prepare_model_outputs(output, a, b))
                verl_fn = None
                if verl:
                    _, verl_args = verl.engine.prepare_model_inputs(mb)
                    verl_fn = (lambda a=verl_args, b=mb: verl.engine.prepare_model_outputs(output, a, b, None))
                # float32: same formula, but sums over V in a different order (entropy: softmax
                # vs exp(x - lse)), so up to ~V * eps apart; bf16: verl divides by T and runs
                # log_softmax in bf16 (bf16 results), impl upcasts first (float32 results).
                atol, rtol = (1e-3, 1e-5) if dtype == torch.float32 else (0.25, 0.02)
                name = f"prepare_model_outputs [{mode}, entropy {'on' if entropy else 'off'}]"
                label = f"{case.name} N={geo.total} {short} logits {gib:.2f}GiB"
                yield Row(name, label, impl_fn, lambda: logits.clone(), verl_fn, _tensors, atol, rtol,
                          group=f"outputs-{mode}", batch=geo.batch, min_time=min_time)
            del output, logits
            gc.collect()


# --------------------------------------------------------------------------- measuring

ROUNDS = 3


def median_times(who: list[tuple[str, Fn]], threads: int, min_time: float,
                 rounds: dict[str, list[float]] | None = None) -> dict[str, float]:
    """Median per-call time of each column, measured in interleaved rounds.

    Each round runs ``Timer.blocked_autorange`` for every column in turn (alternating the
    order); the per-run times of all rounds are pooled and the median taken. Interleaving
    keeps the ratios honest when the machine's load drifts during a row.
    """
    pooled: dict[str, list[float]] = {name: [] for name, _ in who}
    for r in range(ROUNDS):
        for name, fn in (who if r % 2 == 0 else who[::-1]):
            timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
            measured = timer.blocked_autorange(min_run_time=min_time / ROUNDS)
            pooled[name].extend(measured.times)
            if rounds is not None:
                rounds.setdefault(name, []).append(measured.median)
    return {name: statistics.median(times) for name, times in pooled.items()}


def _who(row: Row) -> list[tuple[str, Fn]]:
    return ([("impl", row.impl), ("floor", row.floor)] + ([("gather", row.gather)] if row.gather else [])
            + ([("verl", row.verl)] if row.verl else []))


def measure(row: Row, threads: list[int], min_time: float) -> Row:
    """Check impl against verl once, then time every column at every thread count."""
    torch.set_num_threads(threads[0])
    impl_out = row.impl()
    if row.verl:
        verl_out = row.verl()
        row.check = compare(row.extract(impl_out), row.extract(verl_out), atol=row.atol, rtol=row.rtol)
        del verl_out
    del impl_out
    gc.collect()
    for n in threads:
        row.rounds[n] = {}
        row.times[n] = median_times(_who(row), n, row.min_time or min_time, row.rounds[n])
    return row


def measure_memory(row: Row, threads: list[int]) -> dict[int, dict[str, int | None]]:
    """Peak extra RSS of one call per column (after one warm-up call), at the first thread count."""
    for _, fn in _who(row):
        fn()
    torch.set_num_threads(threads[0])
    return {threads[0]: {name: memory.peak_bytes(fn) for name, fn in _who(row)}}


def memory_child(argv: list[str], out_path: str) -> dict[str, dict]:
    """Run the memory pass in a fresh interpreter, where malloc is configured for it.

    Timing runs with the default allocator settings; ``memory.setup()`` changes them
    (every block >= 128 KiB is mmap'd and unmapped on free), which would add page faults
    to the timed calls. So the peaks come from a second process over the same seeded rows.
    """
    script = os.path.abspath(__file__)
    cmd = [sys.executable, script, *argv, "--_memory-child", out_path]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out_path) as f:
        return json.load(f)


# --------------------------------------------------------------------------- reporting

def fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fmt_mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:.1f}"


def _ratio_range(row: Row, n: int) -> str:
    """verl/impl per interleaved round: min-max (the run-to-run spread on this machine)."""
    got = row.rounds.get(n, {})
    ratios = [v / i for v, i in zip(got.get("verl", []), got.get("impl", []))]
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "n/a"


def table(rows: list[Row], n: int, with_memory: bool) -> str:
    head = ["function", "case", "impl median", "verl median", "floor median", "gather median", "impl/floor",
            "impl/gather", "verl/impl (range over rounds)", "outputs equal"]
    if with_memory:
        head += ["peak MiB impl", "peak MiB verl", "peak MiB floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        t = row.times[n]
        verl_t = t.get("verl")
        gather_t = t.get("gather")
        cells = [row.function, row.case, fmt_time(t["impl"]), fmt_time(verl_t), fmt_time(t["floor"]),
                 fmt_time(gather_t), f"{t['impl'] / t['floor']:.2f}",
                 "n/a" if gather_t is None else f"{t['impl'] / gather_t:.2f}",
                 "n/a" if verl_t is None else f"{verl_t / t['impl']:.2f} ({_ratio_range(row, n)})", row.check]
        if with_memory:
            p = row.peaks.get(n, {})
            cells += [fmt_mib(p.get("impl")), fmt_mib(p.get("verl")) if "verl" in p else "n/a",
                      fmt_mib(p.get("floor"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(rows: list[Row], threads: list[int], with_memory: bool, big_batch: int) -> str:
    out = []

    def verdict(ok: list[bool]) -> str:
        return "met" if all(ok) else f"NOT met ({ok.count(False)}/{len(ok)} rows miss)"

    for n in threads:
        helpers = [r for r in rows if r.group == "helper" and r.batch == big_batch]
        padded = [r for r in rows if r.group == "outputs-padded"]
        packed = [r for r in rows if r.group == "outputs-packed"]
        lines = [f"threads={n}:"]
        with_v = [r for r in rows if "verl" in r.times[n]]
        if with_v:
            ok = [r.times[n]["verl"] >= 1.2 * r.times[n]["impl"] for r in with_v]
            miss = "; ".join(f"{r.function} {r.case}: {r.times[n]['verl'] / r.times[n]['impl']:.2f}x "
                             f"(rounds {_ratio_range(r, n)})" for r, k in zip(with_v, ok) if not k)
            lines.append(f"- every row >= 1.2x verl's speed: {verdict(ok)}" + (f": {miss}" if miss else ""))
        if helpers:
            ok = [r.times[n]["impl"] <= 3 * r.times[n]["floor"] for r in helpers]
            miss = ", ".join(f"{r.function} {r.times[n]['impl'] / r.times[n]['floor']:.1f}x"
                             for r, k in zip(helpers, ok) if not k)
            lines.append(f"- helpers within 3x floor at B={big_batch}: {verdict(ok)}" + (f": {miss}" if miss else ""))
        if padded:
            ok = [r.times[n]["impl"] <= 5 * r.times[n]["floor"] for r in padded]
            worst = max(r.times[n]["impl"] / r.times[n]["floor"] for r in padded)
            lines.append(f"- padded outputs within 5x one logits copy: {verdict(ok)} (worst {worst:.1f}x)")
            with_v = [r for r in padded if "verl" in r.times[n]]
            if with_v:
                ok = [r.times[n]["verl"] >= 10 * r.times[n]["impl"] for r in with_v]
                least = min(r.times[n]["verl"] / r.times[n]["impl"] for r in with_v)
                lines.append(f"- padded outputs >= 10x faster than verl: {verdict(ok)} (least {least:.1f}x)")
        with_v = [r for r in packed if "verl" in r.times[n]]
        if with_v:
            ok = [r.times[n]["impl"] <= r.times[n]["verl"] for r in with_v]
            least = min(r.times[n]["verl"] / r.times[n]["impl"] for r in with_v)
            lines.append(f"- packed outputs no slower than verl: {verdict(ok)} (least verl/impl {least:.2f}x)")
        if with_memory:
            with_v = [r for r in rows if n in r.peaks and r.peaks[n].get("verl") is not None]
            # below 1 MiB the RSS reading is allocator noise; compare the rest
            big = [r for r in with_v if max(r.peaks[n]["impl"], r.peaks[n]["verl"]) >= 2**20]
            if big:
                ok = [r.peaks[n]["impl"] <= r.peaks[n]["verl"] for r in big]
                miss = "; ".join(f"{r.function} {r.case}: {fmt_mib(r.peaks[n]['impl'])} vs "
                                 f"{fmt_mib(r.peaks[n]['verl'])} MiB" for r, k in zip(big, ok) if not k)
                lines.append(f"- peak memory no higher than verl (rows >= 1 MiB): {verdict(ok)}"
                             + (f": {miss}" if miss else ""))
        out.append("\n".join(lines))
    return "\n\n".join(out)


def environment(verl: verl_adapter.Verl | None) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    verl_line = (f"verl {verl.version} (logprobs path on this machine: {verl.logprobs_path})"
                 if verl else "verl: not importable (verl columns n/a)")
    return (f"python {platform.python_version()}, torch {torch.__version__}, tensordict {tensordict.__version__}, "
            f"{verl_line}; CPU: {cpu}, {os.cpu_count()} cores")


def _load_average() -> str:
    try:
        return ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, float32 only (< 1 minute)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts (default 1,2)")
    parser.add_argument("--out", default=None, help="also write the Markdown report to this file")
    parser.add_argument("--min-time", type=float, default=None,
                        help="blocked_autorange min_run_time per measurement, helpers (default 0.3; quick 0.05)")
    parser.add_argument("--outputs-min-time", type=float, default=None,
                        help="min_run_time for prepare_model_outputs rows (default 0.6; quick 0.1)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory columns")
    parser.add_argument("--no-verl", action="store_true", help="do not import verl even if it is installed")
    parser.add_argument("--only", default="", help="run only functions whose name contains this substring")
    parser.add_argument("--_memory-child", dest="memory_child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    threads = [int(x) for x in args.threads.split(",") if x.strip()]
    min_time = args.min_time if args.min_time is not None else (0.05 if args.quick else 0.3)
    out_min = args.outputs_min_time if args.outputs_min_time is not None else (0.1 if args.quick else 0.6)
    if args.no_verl:
        os.environ["BENCH_NO_VERL"] = "1"
    child = args.memory_child is not None
    if child and not memory.setup():
        raise SystemExit("memory measurement unsupported here")
    verl = verl_adapter.load()
    helper_cases = C.QUICK_HELPER_CASES if args.quick else C.HELPER_CASES
    output_cases = C.QUICK_OUTPUT_CASES if args.quick else C.OUTPUT_CASES
    dtypes = [torch.float32] if args.quick else [torch.float32, torch.bfloat16]
    big_batch = max(c.batch for c in helper_cases)

    def all_rows() -> Iterable[Row]:
        for case in helper_cases:
            yield from helper_rows(case, verl)
        for case in output_cases:
            yield from output_rows(case, verl, dtypes, out_min)

    started = time.perf_counter()
    if child:
        peaks = {}
        for row in all_rows():
            if not args.only or args.only in row.function:
                peaks[f"{row.function}|{row.case}"] = measure_memory(row, threads)
        with open(args.memory_child, "w") as f:
            json.dump(peaks, f)
        return 0

    load_before = _load_average()
    print(environment(verl), f"load average before: {load_before}", file=sys.stderr)
    rows: list[Row] = []
    for row in all_rows():
        if args.only and args.only not in row.function:
            continue
        t0 = time.perf_counter()
        rows.append(measure(row, threads, min_time))
        print(f"  [{time.perf_counter() - started:6.1f}s] {row.function} | {row.case} | {row.check} "
              f"({time.perf_counter() - t0:.1f}s)", file=sys.stderr, flush=True)
    load_after = _load_average()

    with_memory = not args.no_memory
    if with_memory:
        print("  memory pass (separate process) ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                peaks = memory_child(argv, os.path.join(tmp, "peaks.json"))
            except (subprocess.CalledProcessError, OSError) as exc:
                print(f"  memory pass failed: {exc}", file=sys.stderr)
                peaks, with_memory = {}, False
        for row in rows:
            got = peaks.get(f"{row.function}|{row.case}", {})
            row.peaks = {int(n): value for n, value in got.items()}

    command = " ".join(["python -m bench", *[a for a in argv]])
    parts = [f"Environment: {environment(verl)}",
             f"Command: `{command}`; total wall time {time.perf_counter() - started:.0f} s; "
             f"load average (1/5/15 min) before {load_before}, after timing {load_after}."]
    for n in threads:
        parts.append(f"### torch.set_num_threads({n})\n\n{table(rows, n, with_memory and n == threads[0])}")
    parts.append("### Targets\n\n" + targets(rows, threads, with_memory, big_batch))
    report = "\n\n".join(parts) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
