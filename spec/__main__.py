"""``python -m spec verify``: run the invariant catalogue against one engine and print the table.

Also ``fuzz`` (a campaign over the shared example database), ``list`` (the catalogue) and
``engines`` (the built-in engines and their capabilities).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from hypothesis import Verbosity

from . import fuzz, mutate, report
from .cases.coverage import domains as coverage_domains
from .invariants import CATALOGUE
from .repro import write_reproducers
from .run import engine_coverage
from .run.database import DatabaseUnavailable, check_reachable, describe, example_database
from .run.parallel import default_workers, recorded_seconds, run_targets
from .run.profiles import load_profile
from .run.registry import PLANTED, describe_engines, load_engine
from .run.runner import instances

__all__ = ["main"]


def _add_verify(sub) -> None:
    verify = sub.add_parser("verify", help="check every invariant against an engine")
    verify.add_argument("--engine", default="impl",
                        help="impl (default), verl, verl-veomni, verl-torchtitan, verl-automodel, verl-megatron, "
                             "planted:<bug>, or module:attr (a factory or EngineUnderTest; e.g. "
                             "spec.planted.harmless:PerSequenceLabels); see `python -m spec engines`")
    verify.add_argument("--profile", default=None,
                        help="hypothesis profile: default, dev, ci, thorough, cuda, debug "
                             "(default: $HYPOTHESIS_PROFILE or default)")
    verify.add_argument("--device", default=None, help="cpu or cuda (default: cuda under the cuda profile, else cpu)")
    verify.add_argument("--only", default=None, help="run only invariant IDs starting with this prefix (e.g. INV-MASK; several: "
                             "comma-separated, INV-MASK,INV-VAL-001)")
    verify.add_argument("--no-layout", action="store_true",
                        help="skip the layout profile (verl's layout conventions, never part of the verdict)")
    verify.add_argument("--out", default="reports", help="folder for the Markdown and JSON reports (default: reports/)")
    verify.add_argument("--no-repro", action="store_true",
                        help="write no standalone reproducers (default: one per failure, <out>/<engine>/repro/)")
    verify.add_argument("--repro-known", action="store_true",
                        help="also write a reproducer for each known failure that fired (its first excused case)")
    verify.add_argument("-n", "--workers", default="auto", type=_workers,
                        help="worker processes: a number or auto (default: auto, every core); the targets run "
                             "longest first (durations from the previous report in --out); 1 runs in this process")


def _workers(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--workers takes a positive number or auto, not {text!r}")
    return int(text)


def _add_fuzz(sub) -> None:
    fuzz = sub.add_parser("fuzz", help="fuzz the catalogue on N worker processes, sharing the example database")
    fuzz.add_argument("--engine", default="impl", help="as for verify (default: impl)")
    fuzz.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="worker processes (default: all cores)")
    fuzz.add_argument("--seconds", type=float, default=300.0, help="time limit (default: 300)")
    fuzz.add_argument("--only", default=None, help="fuzz only invariant IDs starting with this prefix")
    fuzz.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    fuzz.add_argument("--out", default="reports", help="folder for fuzz-<engine>.md/.json (default: reports/)")


def _add_list(sub) -> None:
    listing = sub.add_parser("list", help="list the invariant catalogue")
    listing.add_argument("--markdown", action="store_true", help="as the Markdown table of spec/README.md")


def _add_engines(sub) -> None:
    engines = sub.add_parser("engines", help="list the built-in engines")
    engines.add_argument("--planted", action="store_true", help="list the planted-bug engines too")
    engines.add_argument("--capabilities", metavar="ENGINE", default=None,
                         help="probe one engine and print what it offers, with the reason for each lacking feature")


def _add_mutate(sub) -> None:
    mutate_parser = sub.add_parser("mutate", help="mutation analysis of the engine's preparation code (by hand, "
                                   "nightly; spec/mutate.py)")
    mutate_parser.add_argument("--engine", default="impl", help="as for verify (default: impl)")
    mutate_parser.add_argument("--sample", type=int, default=200, help="mutants sampled (default: 200)")
    mutate_parser.add_argument("--seed", type=int, default=0, help="the sample's seed (default: 0)")
    mutate_parser.add_argument("--profile", default="dev", help="the cheap profile every mutant runs first (dev)")
    mutate_parser.add_argument("--confirm", default="ci", help="the profile a survivor runs again (ci; none: no rerun)")
    mutate_parser.add_argument("--only", default=None, help="only invariant IDs starting with these prefixes")
    mutate_parser.add_argument("--timeout", type=int, default=300, help="seconds one target may take per mutant")
    mutate_parser.add_argument("--out", default="reports", help="folder for mutate-<engine>.md/.json")


#: one function per subcommand: adding one is a line here and a branch in main()
SUBCOMMANDS = [_add_verify, _add_fuzz, _add_list, _add_engines, _add_mutate]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _verify(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile)
    torch.set_num_threads(int(os.environ.get("SPEC_TORCH_THREADS", "1")))  # tiny tensors: threads only contend
    device = args.device or ("cuda" if profile == "cuda" else "cpu")
    engine = load_engine(args.engine)
    only = tuple(p.strip() for p in args.only.split(",") if p.strip()) if args.only else ()
    todo = [(i, m) for i, m in instances() if (not only or i.id.startswith(only))
            and not (args.no_layout and i.layout)]
    quiet = {} if profile == "debug" else {"verbosity": Verbosity.quiet}
    workers = default_workers() if args.workers == "auto" else args.workers
    safe = engine.name.replace(":", "-").replace("/", "-")
    stem = Path(args.out) / f"verify-{safe}"
    start = time.perf_counter()

    def progress(done: int, total: int, running: list[str]) -> None:
        sys.stderr.write(f"\r[{done:3d}/{total}] {time.perf_counter() - start:6.1f}s {', '.join(running)[:60]:<60}")
        sys.stderr.flush()

    measuring = engine_coverage.begin(engine)  # the engine's own code reached, in every process (issue 36)
    outcomes = run_targets(engine, todo, workers=workers, profile=profile, device=device, engine_name=args.engine,
                           threads=int(os.environ.get("SPEC_TORCH_THREADS", "1")), overrides=quiet,
                           recorded=recorded_seconds(stem.with_suffix(".json")), progress=progress)
    sys.stderr.write("\n")
    reached = measuring.finish()
    reproducers = None
    if not args.no_repro and any(o.status == "fail" or (args.repro_known and o.known_cases) for o in outcomes):
        reproducers = write_reproducers(outcomes, engine, Path(args.out) / safe / "repro",
                                        titles={o.invariant: CATALOGUE[o.invariant].title for o in outcomes
                                                if o.invariant in CATALOGUE}, known=args.repro_known)
    domains = coverage_domains(engine)
    companions = engine.companions()
    print(report.markdown(outcomes, engine=engine.name, profile=profile, device=device, reproducers=reproducers,
                   base=Path(args.out), domains=domains, companions=companions))
    paths = report.write_reports(outcomes, stem, engine=engine.name, profile=profile, device=device,
                          reproducers=reproducers, domains=domains, companions=companions)
    print(engine_coverage.write_section(reached, paths))
    for rep in reproducers or ():
        print(f"reproducer {rep.path}: {rep.status}" + (f" ({rep.detail})" if rep.detail else ""))
    layout = [o for o in outcomes if o.layout]
    verdict = [o for o in outcomes if not o.layout]
    print(f"verify: {report.summary_line(verdict)}"
          + (f" (layout profile: {report.summary_line(layout)})" if layout else "")
          + f"; verdict {'FAIL' if report.failed(outcomes) else 'pass'} in {time.perf_counter() - start:.1f}s; wrote "
          + ", ".join(str(p) for p in paths))
    return 1 if report.failed(outcomes) else 0


def _fuzz(args: argparse.Namespace) -> int:
    """A fuzz campaign (spec/fuzz.py) on the database named by $SPEC_EXAMPLE_DB; exit 1 if it found a failure."""
    try:
        database = example_database()
        check_reachable(database)
    except (DatabaseUnavailable, ValueError) as exc:
        print(f"fuzz: {exc}", file=sys.stderr)
        return 2
    where = describe(database)
    print(f"fuzz: engine {args.engine}, {args.workers} workers, {args.seconds:.0f}s, database {where}", file=sys.stderr)
    stats = fuzz.run_campaign(args.engine, workers=args.workers, seconds=args.seconds, only=args.only, device=args.device)
    paths = fuzz.write_reports(stats, Path(args.out) / f"fuzz-{fuzz.safe_name(args.engine)}", engine=args.engine,
                          seconds=args.seconds, workers=args.workers, database=where)
    for s in stats.values():
        if s.status != "pass":
            print(f"{'FAIL' if s.status == 'fail' else 'known failure'} {s.target}: {s.counterexample} -> {s.error}")
    print(f"fuzz: wrote {', '.join(str(p) for p in paths)}")
    return 1 if fuzz.failed(stats) else 0


def _list(args: argparse.Namespace) -> int:
    if args.markdown:
        print("| ID | title | contract | modes | needs |\n|---|---|---:|---|---|")
    for key in sorted(CATALOGUE):
        info = CATALOGUE[key]
        if args.markdown:
            print(f"| {info.id} | {info.title} | {info.contract} | {', '.join(info.modes)} | "
                  f"{', '.join(info.needs) or '-'} |")
        else:
            print(f"{info.id:<14} [{','.join(info.modes)}] {info.title}")
    return 0


def _engines(args: argparse.Namespace) -> int:
    if args.capabilities:
        caps = load_engine(args.capabilities).capabilities()
        print(f"engine {caps.engine}; CP layouts: {', '.join(layout.value for layout in caps.layouts)}")
        for feature, state in caps.table():
            print(f"  {feature:<34} {state}")
        return 0
    print("\n".join(describe_engines()))
    if args.planted:
        print("\n".join(f"planted:{name}" for name in PLANTED))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    commands = {"verify": _verify, "fuzz": _fuzz, "list": _list, "engines": _engines,
                "mutate": lambda a: mutate.main_mutate(a, load_engine(a.engine))}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
