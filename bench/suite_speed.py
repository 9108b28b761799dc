"""Suite speed: examples per second per invariant, and where an example's time goes.

    python -m bench.suite_speed [--profile ci] [--engine impl] [--only INV-VAL]
    python -m bench.suite_speed --trees base=/path/to/old/checkout,new=. [--rounds 2] [--only ...]

Runs ``python -m spec verify``'s code path in one process (one worker, 1 thread) and prints a
Markdown table per invariant x mode (examples, examples/s) and the share of the run's time in each
stage of an example: the suite's own work (materialization, the stand-in model, poisoning, the
float64 oracle, the comparisons, the harness's snapshots and views, the top-K processor, the
real-rank round trips) and the engine's own calls; what is left is hypothesis's own overhead
(drawing, shrinking, the database) and the checks' glue. A stage's time is exclusive: the model called
inside the oracle counts as model. Stage timing wraps the suite's functions by name and costs a little
itself, so its wall time is not the figure to quote; ``--no-stages`` runs without it.

``--trees name=path,... --verify`` times the whole command instead, ``python -m spec verify --engine E --profile P
-n W`` (``--workers``, default 2) in each checkout, alternating them ``--rounds`` times: the median wall time per
tree, its ratio to the first tree's, the verdict line each printed, and the load average before each run (the
issue's figure: ``--trees base=/tmp/base,new=. --engine verl --verify``).

``--trees name=path,...`` runs the same measurement for each checkout (``PYTHONPATH=path``; e.g. the
commit before a speed-up, extracted with ``git archive``), alternating them ``--rounds`` times, and prints
them side by side: the median examples/s and the stage shares, with the load average before each run.
Wall time includes shrinking where an engine fails.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

#: stage -> functions (``module:qualname``) whose time, less that of nested stages, it is; a name that a
#: checkout lacks is skipped (so the bench runs on older and newer layouts alike)
STAGES: dict[str, tuple[str, ...]] = {
    "materialize": ("materialize:materialize", "materialize:materialize_dense", "materialize:select_rows",
                    "materialize:draws", "materialize:jagged"),
    "model": ("toy_model:ToyCausalLM.logits", "toy_model:ToyCausalLM.__call__", "toy_model:ToyCausalLM.sequence_logits"),
    "poison": ("harness:_poison_padded", "harness:_poison_tail"),
    "oracle": ("oracle:expected", "oracle:expected_loop", "oracle:Expected.response_log_probs"),
    "processor (top-K)": ("oracle:TopKProcessor.__call__",),
    "compare": ("invariants.core:close", "invariants.core:same", "invariants.core:held", "invariants.core:per_seq",
                "invariants.core:match_oracle", "invariants.core:match_runs", "invariants.core:close_sequence"),
    "harness (snapshots, views)": ("harness:execute", "handoff:attach_views", "handoff:_call_model",
                                   "handoff:snapshot", "harness:attach_views", "harness:_call_model"),
    "real ranks (round trip)": ("ranks:execute",),
}
#: where a module lived before the package was layered (spec/<module>.py) and after (spec/<layer>/<module>.py)
HOMES = {"materialize": ("materialize", "cases.materialize"), "toy_model": ("toy_model", "truth.toy_model"),
         "oracle": ("oracle", "truth.oracle"), "harness": ("harness", "execute.harness"),
         "handoff": ("execute.handoff",),
         "ranks": ("ranks", "execute.ranks"), "attribution": ("attribution", "execute.attribution"),
         "invariants.core": ("invariants.core",)}


class Stages:
    """Exclusive time per stage on the main thread (engine threads of simulated ranks are not split out)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [stage, started]
        self.main = threading.get_ident()

    def wrap(self, stage: str, fn):
        stages = self

        def timed(*args, **kwargs):
            if threading.get_ident() != stages.main:
                return fn(*args, **kwargs)
            now = stages.clock()
            if stages.stack:
                top = stages.stack[-1]
                stages.seconds[top[0]] += now - top[1]
            stages.stack.append([stage, now])
            try:
                return fn(*args, **kwargs)
            finally:
                end = stages.clock()
                name, started = stages.stack.pop()
                stages.seconds[name] += end - started
                if stages.stack:
                    stages.stack[-1][1] = end
        timed.__wrapped__ = fn  # type: ignore[attr-defined]
        timed.__name__ = getattr(fn, "__name__", "timed")
        return timed

    def install(self) -> list[str]:
        """Wrap every stage's functions in every spec module that holds them; the names wrapped."""
        wrapped = []
        for stage, names in STAGES.items():
            for name in names:
                module_key, qual = name.split(":")
                for home in HOMES.get(module_key, (module_key,)):
                    if self._wrap_one(stage, f"spec.{home}", qual):
                        wrapped.append(f"spec.{home}:{qual}")
                        break
        for home in HOMES["attribution"]:  # the engine's own calls: each engine-side wrapper, timed
            try:
                module = importlib.import_module(f"spec.{home}")
            except ImportError:
                continue
            original = module._engine_side
            module._engine_side = lambda fn, where, _o=original: self.wrap("engine", _o(fn, where))
            wrapped.append(f"spec.{home}:_engine_side")
            break
        return wrapped

    def _wrap_one(self, stage: str, module_name: str, qual: str) -> bool:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return False
        owner, _, attr = qual.rpartition(".")
        holder = getattr(module, owner, None) if owner else module
        original = getattr(holder, attr, None) if holder is not None else None
        if original is None:
            return False
        timed = self.wrap(stage, original)
        setattr(holder, attr, timed)
        if not owner:  # functions imported by name elsewhere: rebind those too
            for other in list(sys.modules.values()):
                if getattr(other, "__name__", "").startswith("spec") and getattr(other, attr, None) is original:
                    setattr(other, attr, timed)
        return True


def measure(engine_name: str, profile: str, only: str | None, stages: bool, clock: str = "wall") -> dict:
    """One catalogue run in this process: per target examples and seconds, per stage seconds."""
    try:  # the layered package (spec/run/...), else the flat one it came from
        from spec.run.profiles import load_profile
        from spec.run.registry import load_engine
        from spec.run.runner import instances, run_invariant
    except ImportError:
        from spec.engines import load_engine
        from spec.profiles import load_profile
        from spec.runner import instances, run_invariant

    load_profile(profile)
    import torch
    from hypothesis import Verbosity

    import spec.invariants  # noqa: F401 - the catalogue, so every stage's module is imported before wrapping

    torch.set_num_threads(1)
    tick = time.perf_counter if clock == "wall" else time.thread_time
    timer = Stages(tick)
    wrapped = timer.install() if stages else []
    engine = load_engine(engine_name)
    rows = []
    start, cpu = time.perf_counter(), time.thread_time()
    for info, mode in instances():
        if only and not info.id.startswith(tuple(only.split(","))):
            continue
        outcome = run_invariant(info, engine, mode, "cpu", verbosity=Verbosity.quiet)
        if outcome.status != "skip":
            rows.append({"target": f"{info.id}/{mode}", "examples": outcome.examples, "exercised": outcome.exercised,
                         "status": outcome.status, "seconds": outcome.seconds})
    total = time.perf_counter() - start
    cpu = time.thread_time() - cpu
    return {"engine": engine_name, "profile": profile, "total": total, "cpu": cpu, "clock": clock, "rows": rows,
            "stages": dict(timer.seconds), "wrapped": wrapped}


def _shares(result: dict) -> dict[str, float]:
    total = result["cpu"] if result.get("clock") == "cpu" else result["total"]
    shares = {k: v / total for k, v in result["stages"].items()}
    shares["hypothesis and glue (rest)"] = max(0.0, 1.0 - sum(shares.values()))
    return shares


def _table(results: dict[str, list[dict]]) -> str:
    """Side by side: per target examples/s (median over rounds), then the stage shares."""
    names = list(results)
    first = results[names[0]][0]
    lines = ["| target | examples | " + " | ".join(f"{n} ex/s" for n in names)
             + (" | speed-up |" if len(names) == 2 else " |"),
             "|---|---:|" + "---:|" * len(names) + ("---:|" if len(names) == 2 else "")]
    for i, row in enumerate(first["rows"]):
        rates = []
        for name in names:
            secs = statistics.median(r["rows"][i]["seconds"] for r in results[name])
            rates.append(row["examples"] / max(secs, 1e-9))
        counts = {r["rows"][i]["examples"] for name in names for r in results[name]}
        count = str(row["examples"]) if len(counts) == 1 else "DIFFER " + "/".join(map(str, sorted(counts)))
        extra = f" {rates[1] / rates[0]:.2f}x |" if len(names) == 2 else ""
        lines.append(f"| {row['target']} | {count} | " + " | ".join(f"{r:.1f}" for r in rates) + " |" + extra)
    totals = [statistics.median(r["total"] for r in results[n]) for n in names]
    cpus = [statistics.median(r["cpu"] for r in results[n]) for n in names]
    examples = sum(row["examples"] for row in first["rows"])
    extra = f" {totals[0] / totals[1]:.2f}x |" if len(names) == 2 else ""
    lines.append(f"| **all** (median wall {' / '.join(f'{t:.0f}s' for t in totals)}) | {examples} | "
                 + " | ".join(f"{examples / t:.1f}" for t in totals) + " |" + extra)
    extra = f" {cpus[0] / cpus[1]:.2f}x |" if len(names) == 2 else ""
    lines.append(f"| **all**, main thread CPU ({' / '.join(f'{t:.0f}s' for t in cpus)}) | {examples} | "
                 + " | ".join(f"{examples / t:.1f}" for t in cpus) + " |" + extra)
    lines += ["", "| stage | " + " | ".join(f"{n} share" for n in names) + " | " + " | ".join(
        f"{n} s/example (ms)" for n in names) + " |", "|---|" + "---:|" * (2 * len(names))]
    shares = {n: [_shares(r) for r in results[n]] for n in names}
    keys = sorted({k for n in names for s in shares[n] for k in s}, key=lambda k: (k.startswith("hypothesis"), k))
    for key in keys:
        cells = [statistics.median(s.get(key, 0.0) for s in shares[n]) for n in names]
        per_ex = [statistics.median(s.get(key, 0.0) * (r["cpu"] if r.get("clock") == "cpu" else r["total"]) for s, r in zip(shares[n], results[n]))
                  * 1000 / max(examples, 1) for n in names]
        lines.append(f"| {key} | " + " | ".join(f"{c:.1%}" for c in cells) + " | "
                     + " | ".join(f"{p:.2f}" for p in per_ex) + " |")
    return "\n".join(lines)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _compare(args) -> int:
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    results: dict[str, list[dict]] = {name: [] for name in trees}
    loads = []
    for round_ in range(args.rounds):
        for name, path in trees.items():
            # no example database: "none" reads the same in every checkout (before 2026-12-01 ":memory:" was a
            # directory path, and an old tree measured here wrote one into the repository)
            env = {**os.environ, "PYTHONPATH": str(Path(path).resolve()), "SPEC_EXAMPLE_DB": "none"}
            cmd = [sys.executable, str(Path(__file__).resolve()), "--engine", args.engine, "--profile", args.profile,
                   "--json", "--clock", args.clock] + (["--only", args.only] if args.only else []) + ([] if args.stages else ["--no-stages"])
            loads.append(f"round {round_ + 1} {name}: load {_load()}")
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(Path(path).resolve()))
            if out.returncode != 0:
                sys.stderr.write(out.stderr[-4000:])
                return out.returncode
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"{loads[-1]}: {results[name][-1]['total']:.1f}s", file=sys.stderr)
    print(f"Suite speed: engine `{args.engine}`, profile `{args.profile}`, 1 worker, 1 thread; "
          f"{args.rounds} round(s) alternating {', '.join(trees)} (medians)\n")
    print(_table(results))
    print("\n" + "; ".join(loads))
    return 0


def _verify_side_by_side(args) -> int:
    """``spec verify`` end to end in each tree, alternating: the wall times side by side."""
    trees = dict(item.split("=", 1) for item in args.trees.split(","))
    walls: dict[str, list[float]] = {name: [] for name in trees}
    verdicts: dict[str, str] = {}
    loads = []
    for round_ in range(args.rounds):
        for name, path in trees.items():
            root = Path(path).resolve()
            env = {**os.environ, "PYTHONPATH": str(root), "SPEC_EXAMPLE_DB": "none"}
            with tempfile.TemporaryDirectory(prefix="suite-speed-") as out_dir:
                cmd = [sys.executable, "-m", "spec", "verify", "--engine", args.engine, "--profile", args.profile,
                       "-n", str(args.workers), "--out", out_dir, "--no-repro"] + (
                    ["--only", args.only] if args.only else [])
                loads.append(f"round {round_ + 1} {name}: load {_load()}")
                start = time.perf_counter()
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(root))
                walls[name].append(time.perf_counter() - start)
            line = next((l for l in out.stdout.splitlines() if l.startswith("verify:")), "(no verdict line)")
            verdicts[name] = line
            if out.returncode not in (0, 1):
                sys.stderr.write(out.stderr[-4000:])
                return out.returncode
            print(f"{loads[-1]}: {walls[name][-1]:.1f}s", file=sys.stderr)
    first = statistics.median(walls[next(iter(trees))])
    print(f"spec verify: engine `{args.engine}`, profile `{args.profile}`, -n {args.workers}; {args.rounds} round(s) "
          f"alternating {', '.join(trees)} (median wall time)\n")
    base = next(iter(trees))
    print(f"| tree | wall (s) | speed-up vs {base} | verdict |")
    print("|---|---|---|---|")
    for name in trees:
        wall = statistics.median(walls[name])
        print(f"| {name} | {wall:.1f} | {first / wall:.2f}x | {verdicts[name].split(': ', 1)[-1][:110]} |")
    print("\n" + "; ".join(loads))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="ci")
    parser.add_argument("--engine", default="impl")
    parser.add_argument("--only", default=None, help="comma-separated invariant ID prefixes")
    parser.add_argument("--no-stages", dest="stages", action="store_false", help="no stage timing")
    parser.add_argument("--trees", default=None, help="name=path,...: measure each checkout, side by side")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="stage shares of wall time (default) or of the main thread's CPU time (steadier on a "
                             "loaded machine; a real-rank round trip's waiting is then not counted)")
    parser.add_argument("--json", action="store_true", help="print one JSON line (used by --trees)")
    parser.add_argument("--verify", action="store_true",
                        help="with --trees: time `spec verify` end to end in each tree (its wall time, side by side)")
    parser.add_argument("--workers", type=int, default=2, help="spec verify -n (with --verify)")
    args = parser.parse_args(argv)
    if args.verify and not args.trees:
        parser.error("--verify compares trees: give --trees name=path,...")
    if args.trees:
        return _verify_side_by_side(args) if args.verify else _compare(args)
    result = measure(args.engine, args.profile, args.only, args.stages, args.clock)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"Suite speed: engine `{args.engine}`, profile `{args.profile}`, 1 thread, one process\n")
    print(_table({"this tree": [result]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
