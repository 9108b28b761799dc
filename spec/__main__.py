"""``python -m spec verify``: run the invariant catalogue against one engine and print the table."""

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
                        help="impl (default), verl, planted:<bug>, or module:attr (a factory or EngineUnderTest; e.g. "
                             "spec.planted.harmless:PerSequenceLabels)")
    verify.add_argument("--profile", default=None,
                        help="hypothesis profile: default, dev, ci, cuda, debug (default: $HYPOTHESIS_PROFILE or default)")
    verify.add_argument("--device", default=None, help="cpu or cuda (default: cuda under the cuda profile, else cpu)")
    verify.add_argument("--only", default=None, help="run only invariant IDs starting with this prefix (e.g. INV-MASK)")
    verify.add_argument("--no-layout", action="store_true",
                        help="skip the layout profile (verl's layout conventions, never part of the verdict)")
    verify.add_argument("--out", default="reports", help="folder for the Markdown and JSON reports (default: reports/)")


def _add_list(sub) -> None:
    listing = sub.add_parser("list", help="list the invariant catalogue")
    listing.add_argument("--markdown", action="store_true", help="as the Markdown table of spec/README.md")


def _add_engines(sub) -> None:
    sub.add_parser("engines", help="list the built-in engines")


#: one function per subcommand: adding one is a line here and a branch in main()
SUBCOMMANDS = [_add_verify, _add_list, _add_engines]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _verify(args: argparse.Namespace) -> int:
    from .engines import load_engine
    from .profiles import load_profile

    profile = load_profile(args.profile)
    import torch

    torch.set_num_threads(int(os.environ.get("SPEC_TORCH_THREADS", "1")))  # tiny tensors: threads only contend
    from .report import failed, markdown, summary_line, write_reports
    from .runner import instances, run_invariant
    from hypothesis import Verbosity

    device = args.device or ("cuda" if profile == "cuda" else "cpu")
    engine = load_engine(args.engine)
    todo = [(i, m) for i, m in instances() if (not args.only or i.id.startswith(args.only))
            and not (args.no_layout and i.layout)]
    quiet = {} if profile == "debug" else {"verbosity": Verbosity.quiet}
    outcomes = []
    start = time.perf_counter()
    for n, (info, mode) in enumerate(todo, 1):
        sys.stderr.write(f"\r[{n:3d}/{len(todo)}] {info.id:<14} {mode:<6} {time.perf_counter() - start:6.1f}s ")
        sys.stderr.flush()
        outcomes.append(run_invariant(info, engine, mode, device, **quiet))
    sys.stderr.write("\n")
    print(markdown(outcomes, engine=engine.name, profile=profile, device=device))
    safe = engine.name.replace(":", "-").replace("/", "-")
    paths = write_reports(outcomes, Path(args.out) / f"verify-{safe}", engine=engine.name, profile=profile,
                          device=device)
    layout = [o for o in outcomes if o.layout]
    verdict = [o for o in outcomes if not o.layout]
    print(f"verify: {summary_line(verdict)}" + (f" (layout profile: {summary_line(layout)})" if layout else "")
          + f"; verdict {'FAIL' if failed(outcomes) else 'pass'} in {time.perf_counter() - start:.1f}s; wrote "
          + ", ".join(str(p) for p in paths))
    return 1 if failed(outcomes) else 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    if args.command == "verify":
        return _verify(args)
    if args.command == "list":
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
    from .engines import builtin_engine_names

    print("\n".join(builtin_engine_names()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
