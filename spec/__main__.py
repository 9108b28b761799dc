"""``python -m spec verify``: run the invariant catalogue against one engine, write the reports and print a
short summary (the counts, one line per failure, the slowest targets, the report paths, the next command).

Also ``fuzz`` (a campaign over the shared example database), ``list`` (the catalogue) and
``engines`` (the built-in engines and their capabilities).

The arguments are parsed here, before anything heavy is imported: ``--help`` and a bad option answer without
torch, hypothesis or the suite. The commands themselves are :mod:`spec.commands`, imported once the arguments are
parsed. A usage error (an unknown engine, planted bug, profile or ``--only`` prefix) is one line on stderr with the
closest names and exit code 2; a failed verdict exits 1, a pass 0.
"""

from __future__ import annotations

import argparse
import os
import sys

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


#: one parser per subcommand: adding one is a line here and an entry in spec.commands.COMMANDS
SUBCOMMANDS = [_add_verify, _add_fuzz, _add_list, _add_engines, _add_mutate]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    # the one deferred import: the commands need torch, hypothesis and the suite; --help and the parser's usage
    # errors above answer without them
    from . import commands

    return commands.run(args)


if __name__ == "__main__":
    sys.exit(main())
