"""``python -m spec verify``: run the invariant catalogue against one engine, write the reports and print a
short summary (the counts, one line per failure, the slowest targets, the report paths, the next command).

Also ``fuzz`` (a campaign over the shared example database), ``list`` (the catalogue) and
``engines`` (the built-in engines and their capabilities).

The arguments are parsed before anything heavy is imported: ``--help`` and a bad option answer without
torch, hypothesis or the suite, which each command imports when it runs (its function-local imports, all
of lower layers). A usage error (an unknown engine, planted bug, profile or ``--only`` prefix) is one line
on stderr with the closest names and exit code 2; a failed verdict exits 1, a pass 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

__all__ = ["main"]


def _add_verify(sub) -> None:
    verify = sub.add_parser("verify", help="check every invariant against an engine")
    verify.add_argument("--engine", default="impl",
                        help="impl (default), verl, verl-veomni, verl-torchtitan, verl-automodel, verl-megatron, "
                             "planted:<bug>, or module:attr (a factory or EngineUnderTest; e.g. "
                             "spec.planted.harmless:PerSequenceLabels); see `python -m spec engines`")
    verify.add_argument("--profile", default=None,
                        help="hypothesis profile: default, dev, ci, pr, thorough, cuda, debug "
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
    fuzzing = sub.add_parser("fuzz", help="fuzz the catalogue on N worker processes, sharing the example database")
    fuzzing.add_argument("--engine", default="impl", help="as for verify (default: impl)")
    fuzzing.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                         help="worker processes (default: all cores)")
    fuzzing.add_argument("--seconds", type=float, default=300.0, help="time limit (default: 300)")
    fuzzing.add_argument("--only", default=None, help="fuzz only invariant IDs starting with this prefix")
    fuzzing.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    fuzzing.add_argument("--out", default="reports", help="folder for fuzz-<engine>.md/.json (default: reports/)")


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
    mutate_parser.add_argument("--min-score", type=float, default=None, help="exit 1 when the score is below this "
                               "share (e.g. 0.9; the nightly job's gate)")
    mutate_parser.add_argument("--resume", default=None, help="an earlier mutate-<engine>.json of the same sample: "
                               "the mutants it killed are carried over, not run again")


#: one function per subcommand: adding one is a line here and a branch in main()
SUBCOMMANDS = [_add_verify, _add_fuzz, _add_list, _add_engines, _add_mutate]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


class _Usage(Exception):
    """A usage error: printed as one line on stderr, exit code 2."""


def _usage(error: ValueError) -> _Usage:
    return _Usage(str(error))


def _load_engine(name: str):
    from .run.registry import UnknownName, load_engine

    try:
        return load_engine(name)
    except UnknownName as exc:
        raise _usage(exc) from None


def _load_profile(name: str | None) -> str:
    from .run.registry import UnknownName, checked_profile

    try:
        return checked_profile(name)
    except UnknownName as exc:
        raise _usage(exc) from None


def _prefixes(only: str | None, *, split: bool = True) -> tuple[str, ...]:
    """``--only``'s prefixes (comma-separated where ``split``), each checked to match some invariant ID."""
    from .run.registry import UnknownName, check_prefixes
    from .run.runner import instances

    prefixes = (tuple(p.strip() for p in only.split(",") if p.strip()) if split else (only,)) if only else ()
    try:
        check_prefixes(prefixes, [info.id for info, _ in instances()])
    except UnknownName as exc:
        raise _usage(exc) from None
    return prefixes


class _Captured:
    """The process's stderr (file descriptor 2, inherited by the worker processes and their ranks) sent to a
    temporary file while the targets run, so that what torch, the engine or a worker writes there (a
    ``logging`` warning, a C++ warning, a Python warning) never breaks the progress line; the progress line
    goes to the real stderr. :meth:`restore` prints what was written, each line once, after the line."""

    def __init__(self) -> None:
        import tempfile

        sys.stderr.flush()
        self.file = tempfile.TemporaryFile()
        self.real = os.dup(2)
        os.dup2(self.file.fileno(), 2)

    def write(self, text: str) -> None:
        os.write(self.real, text.encode())
        self.open_line = not text.endswith("\n")

    def restore(self) -> None:
        """The real stderr back (the progress line ended), then what was written meanwhile, each line once."""
        if getattr(self, "open_line", False):
            self.write("\n")
        sys.stderr.flush()
        os.dup2(self.real, 2)
        os.close(self.real)
        said = self.distinct()
        if said:
            print(f"written to stderr by torch, the engine or a worker ({len(said)} distinct line(s), each once):",
                  file=sys.stderr)
            print("\n".join(f"  {line[:300]}" for line in said[:20]), file=sys.stderr)
            if len(said) > 20:
                print(f"  (+{len(said) - 20} more)", file=sys.stderr)

    def distinct(self) -> list[str]:
        import re

        self.file.seek(0)
        lines: dict[str, str] = {}
        for line in self.file.read().decode(errors="replace").splitlines():
            # glog/torch.logging prefix ("W1203 22:18:57.625000 10764 path:56] ..."): time and pid differ per process
            key = re.sub(r"^[IWEF]\d{4} [\d:.]+ +\d+ ", "", line.strip())
            if key:
                lines.setdefault(key, line.rstrip())
        self.file.close()
        return list(lines.values())


def _verify(args: argparse.Namespace) -> int:
    import torch
    from hypothesis import Verbosity

    from . import report
    from .cases.coverage import domains as coverage_domains
    from .invariants import CATALOGUE
    from .repro import write_reproducers
    from .run import engine_coverage
    from .run.parallel import default_workers, recorded_seconds, run_targets
    from .run.runner import instances

    profile = _load_profile(args.profile)
    torch.set_num_threads(int(os.environ.get("SPEC_TORCH_THREADS", "1")))  # tiny tensors: threads only contend
    device = args.device or ("cuda" if profile == "cuda" else "cpu")
    only = _prefixes(args.only)
    engine = _load_engine(args.engine)
    todo = [(i, m) for i, m in instances() if (not only or i.id.startswith(only))
            and not (args.no_layout and i.layout)]
    quiet = {} if profile == "debug" else {"verbosity": Verbosity.quiet}
    workers = default_workers() if args.workers == "auto" else args.workers
    safe = report.safe_name(engine.name)
    stem = Path(args.out) / f"verify-{safe}"
    start = time.perf_counter()
    captured = _Captured()

    def progress(done: int, total: int, running: list[str]) -> None:
        captured.write(f"\r[{done:3d}/{total}] {time.perf_counter() - start:6.1f}s {', '.join(running)[:60]:<60}")

    measuring = engine_coverage.begin(engine)  # the engine's own code reached, in every process
    try:
        outcomes = run_targets(engine, todo, workers=workers, profile=profile, device=device, engine_name=args.engine,
                               threads=int(os.environ.get("SPEC_TORCH_THREADS", "1")), overrides=quiet,
                               recorded=recorded_seconds(report.report_paths(stem)[1]), progress=progress)
        seconds = time.perf_counter() - start
        reproducers = None
        if not args.no_repro and any(o.status == "fail" or (args.repro_known and o.known_cases) for o in outcomes):
            reproducers = write_reproducers(outcomes, engine, Path(args.out) / safe / "repro",
                                            titles={o.invariant: CATALOGUE[o.invariant].title for o in outcomes
                                                    if o.invariant in CATALOGUE}, known=args.repro_known)
        paths = report.write_reports(outcomes, stem, engine=engine.name, profile=profile, device=device,
                                     reproducers=reproducers, domains=coverage_domains(engine),
                                     companions=engine.companions())
        covered = engine_coverage.write_section(measuring.finish(), paths)
    finally:
        captured.restore()
    rerun = ["python", "-m", "spec", "verify", "--engine", args.engine, "--profile", profile]
    rerun += ["--device", device] if device != "cpu" else []
    rerun += ["--out", args.out] if args.out != "reports" else []
    print("\n".join(report.summary(outcomes, engine=engine.name, profile=profile, device=device, seconds=seconds,
                                   paths=paths, reproducers=reproducers, rerun=rerun)))
    print(covered)
    return 1 if report.failed(outcomes) else 0


def _fuzz(args: argparse.Namespace) -> int:
    """A fuzz campaign (spec/fuzz.py) on the database named by $SPEC_EXAMPLE_DB; exit 1 if it found a failure."""
    from . import fuzz
    from .run.database import DatabaseUnavailable, check_reachable, describe, example_database

    _load_engine(args.engine)  # an unknown name is a usage error before any worker starts
    _prefixes(args.only, split=False)  # fuzz takes one prefix
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
    from .invariants import CATALOGUE

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
    from .run.registry import PLANTED, describe_engines

    if args.capabilities:
        caps = _load_engine(args.capabilities).capabilities()
        print(f"engine {caps.engine}; CP layouts: {', '.join(layout.value for layout in caps.layouts)}")
        for feature, state in caps.table():
            print(f"  {feature:<34} {state}")
        return 0
    print("\n".join(describe_engines()))
    if args.planted:
        print("\n".join(f"planted:{name}" for name in PLANTED))
    return 0


def _mutate(args: argparse.Namespace) -> int:
    from . import mutate

    return mutate.main_mutate(args, _load_engine(args.engine))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    commands = {"verify": _verify, "fuzz": _fuzz, "list": _list, "engines": _engines, "mutate": _mutate}
    try:
        return commands[args.command](args)
    except _Usage as exc:
        print(f"python -m spec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
