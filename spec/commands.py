"""The commands of ``python -m spec`` (verify, fuzz, list, engines, mutate), run once :mod:`spec.__main__` has
parsed the arguments: this module imports torch, hypothesis and the suite, which ``--help`` and a usage error of the
parser never need (``__main__`` imports it after parsing, its one deferred import). A usage error found here (an
unknown engine, planted bug, profile or ``--only`` prefix) is one line on stderr with the closest names and exit
code 2; a failed verdict exits 1, a pass 0."""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import torch
from hypothesis import Verbosity

from . import docs, fuzz, mutate, report
from .cases.coverage import domains as coverage_domains
from .invariants import CATALOGUE
from .repro import write_reproducers
from .run import engine_coverage
from .protocol.errors import UsageError
from .run.database import DatabaseUnavailable, check_reachable, describe, example_database
from .run.parallel import default_workers, recorded_seconds, run_targets
from .run.registry import PLANTED, UnknownName, check_prefixes, checked_profile, describe_engines, load_engine
from .run.runner import instances

__all__ = ["run"]


def _usage(error: ValueError) -> UsageError:
    return UsageError(str(error))


def _load_engine(name: str):
    try:
        return load_engine(name)
    except UnknownName as exc:
        raise _usage(exc) from None


def _load_profile(name: str | None) -> str:
    try:
        return checked_profile(name)
    except UnknownName as exc:
        raise _usage(exc) from None


def _prefixes(only: str | None, *, split: bool = True) -> tuple[str, ...]:
    """``--only``'s prefixes (comma-separated where ``split``), each checked to match some invariant ID."""
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
    profile = _load_profile(args.profile)
    threads = int(os.environ.get("SPEC_TORCH_THREADS", "1"))
    torch.set_num_threads(threads)  # tiny tensors: threads only contend
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
                               threads=threads, overrides=quiet,
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
    if args.markdown:  # the table spec/README.md holds (one writer: spec.docs)
        print(docs.catalogue())
        return 0
    for key in sorted(CATALOGUE):
        info = CATALOGUE[key]
        print(f"{info.id:<14} [{','.join(info.modes)}] {info.title}"
              + (f" (facts: {', '.join(info.facts)})" if info.facts else ""))
    return 0


def _engines(args: argparse.Namespace) -> int:
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
    return mutate.main_mutate(args, _load_engine(args.engine))


#: the function of each subcommand (spec.__main__.SUBCOMMANDS adds its parser)
COMMANDS = {"verify": _verify, "fuzz": _fuzz, "list": _list, "engines": _engines, "mutate": _mutate}


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; a usage error is one line on stderr and exit code 2."""
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"python -m spec {args.command}: error: {exc}", file=sys.stderr)
        return 2
