"""Measure how many planted bugs get a reproducer that fails standalone while its impl twin passes.

``python -m spec.repro.measure [--bugs a,b] [--invariants INV-X,...] [--examples 5] [--out DIR]``: for every planted
bug (spec/planted), its first ``caught_by`` invariant runs under the ci profile (a few examples, no shrinking, no
example database, as tests/test_repro.py's fixture runs it) in each of its modes until one fails; the failure's
reproducer is written and the same reproducer with impl's engine block (the bug fixed: its twin; for a planted
packer, the suite's reference packer) beside it. Then
both sets of files run in fresh processes: the twins with ``spec`` unimportable, the planted ones with only the
planted engine's adapter importing it (the text outside the engine block imports nothing of the suite, checked here),
or, a file importing neither ``spec`` nor ``impl`` (its engine written out), with neither importable.
Prints per bug the invariant, the mode, the planted reproducer's exit code and its twin's, and the totals. A
measurement, not a test: it takes minutes (the full run longer).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..cases.structure import EngineCase
from ..engines.impl.adapter import ImplEngine
from ..invariants import CATALOGUE
from ..planted import PLANTED
from ..run.registry import load_engine
from ..run.runner import run_invariant
from .packing import ReferencePackingEngine
from .writer import write_reproducer, write_reproducers

ROOT = Path(__file__).resolve().parents[2]
#: the script that runs the files (run by its path: it imports nothing of the suite), and the ``sitecustomize`` that
#: hides spec and impl from a file that imports neither (copied, never imported here: it would hide them from us)
RUN_FILES, NEITHER_SITE = Path(__file__).with_name("run_files.py"), Path(__file__).with_name("neither_site.py")
IMPL_SWITCHES = {switch.name for switch in ImplEngine().config_space()}
ENGINE_BEGIN, ENGINE_END = "# ---- engine under test (begin) ----", "# ---- engine under test (end) ----"

#: bugs the first five drawn cases (and the pinned ones) miss, as in tests/test_repro.py
EXAMPLES = {"sum_pi_squared_missing_padded": 30, "inplace_div_without_grad": 30}
#: and those the first five drawn cases miss here (quiet bugs of a rarer region), a few more
EXAMPLES.update(dict.fromkeys(("chunk_drops_tail", "last_partial_chunk_untempered", "rank_sp_rank_from_global_rank",
                               "restore_skipped_without_grad", "chunked_topk_drops_last_chunk",
                               # a vision-language mini-batch the balancing reorders: none among the first five
                               "media_sliced_not_selected"), 40))

def _outside_engine_imports_spec(text: str) -> bool:
    if ENGINE_BEGIN in text:
        head, rest = text.split(ENGINE_BEGIN, 1)
        text = head + rest.split(ENGINE_END, 1)[-1]
    return bool(re.search(r"^\s*(import|from)\s+spec\b", text, re.M))


#: an import of either package: at a line's start, or in a module written out as a string literal (after its "\\n")
_IMPORTS_EITHER = re.compile(r"(^|\\n)\s*(import|from)\s+(spec|impl)\b", re.M)


def _run_files(paths: list[Path], no_spec: bool, timeout: float, neither: bool = False) -> dict[str, int]:
    if not paths:
        return {}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    if neither:
        site = Path(tempfile.mkdtemp(prefix="repro-neither-"))
        shutil.copyfile(NEITHER_SITE, site / "sitecustomize.py")
        env["PYTHONPATH"] = str(site)
    cmd = [sys.executable, str(RUN_FILES), *(["--no-spec"] if no_spec else []), *map(str, paths)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(paths[0].parent), timeout=timeout)
        out = done.stdout
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
    codes = {}
    for line in out.splitlines():
        if line.startswith("EXIT "):
            _, code, how, path = line.split(" ", 3)
            codes[path] = (int(code), how)
    return codes


def _for_impl(case):
    """The case as impl takes it: a planted engine's own switches (its ``config_space``: the path the bug hides
    behind) that impl has not are left out of its twin."""
    if isinstance(case, EngineCase) and case.engine_config:
        return case.with_(engine_config=tuple(item for item in case.engine_config if item[0] in IMPL_SWITCHES))
    return case


def _twin_engine(invariant: str):
    """The bug fixed: impl, or for a planted packer the suite's reference packer (impl has no packer)."""
    return ReferencePackingEngine() if invariant.startswith("INV-MEG-") else ImplEngine()


def measure(bugs: list[str], folder: Path, examples: int, invariants: set[str] | None,
            every: bool = False) -> list[dict]:
    """One row per bug and invariant: its first ``caught_by`` (``every``: each of them)."""
    rows = []
    pairs = [(name, inv) for name in bugs for inv in (PLANTED[name].caught_by if every else PLANTED[name].caught_by[:1])]
    for name, invariant in pairs:
        if invariants and invariant not in invariants:
            continue
        info = CATALOGUE[invariant]
        engine = load_engine(f"planted:{name}")
        row = {"bug": name, "invariant": invariant, "mode": "-", "suite": "not caught", "planted": None, "twin": None,
               "why": "", "seconds": 0.0}
        start = time.perf_counter()
        modes = [m for m in info.modes]
        for mode in modes:
            try:
                outcome = run_invariant(info, engine, mode, "cpu", profile="ci", shrink=False,
                                        max_examples=EXAMPLES.get(name, examples), database=None)
            except Exception as exc:  # noqa: BLE001 - recorded
                row["why"] = f"run_invariant raised {type(exc).__name__}: {exc}"[:200]
                continue
            made = write_reproducers([outcome], engine, folder / name / invariant, check=False, known=True)
            if not made:
                row["suite"] = outcome.status
                continue
            rep = made[0]
            row.update(mode=mode, suite="fail" if not rep.known else "known", path=rep.path)
            if rep.status == "not standalone":
                row["why"], row["planted"] = rep.detail[:200], 2
                break
            case = _for_impl(outcome.case if not rep.known else next(iter(outcome.known_cases.values()))[0])
            twin, why = write_reproducer(rep.path.with_name(rep.path.stem + "-impl.py"), invariant=invariant,
                                         mode=mode, engine=_twin_engine(invariant), case=case)
            row["twin_path"] = None if why else twin
            if why:
                row["why"] = f"twin: {why}"[:200]
            if _outside_engine_imports_spec(rep.path.read_text()):
                row["why"] = "the file imports spec outside its engine block"
            break
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(f"  ran {name}: {row['invariant']} {row['mode']} {row['suite']} ({row['seconds']:.0f} s)", flush=True)
    written = [r for r in rows if r.get("path") and not r["why"]]
    for r in written:
        r["alone"] = not _IMPORTS_EITHER.search(r["path"].read_text())
    planted = _run_files([r["path"] for r in written if not r["alone"]], no_spec=False, timeout=1800)
    planted.update(_run_files([r["path"] for r in written if r["alone"]], no_spec=True, timeout=1800, neither=True))
    twins = _run_files([r["twin_path"] for r in rows if r.get("twin_path")], no_spec=True, timeout=1800)
    for r in rows:
        if r.get("path") and r["planted"] is None:
            r["planted"], r["how"] = planted.get(str(r["path"]), (None, ""))
        if r.get("twin_path"):
            r["twin"] = twins.get(str(r["twin_path"]), (None, ""))[0]
    return rows


def report(rows: list[dict]) -> str:
    lines = [f"{'bug':42s} {'invariant':15s} {'mode':7s} {'suite':10s} {'planted':15s} twin  note"]
    for r in rows:
        how = f" ({r['how']})" if r.get("planted") == 1 else ""
        lines.append(f"{r['bug']:42s} {r['invariant']:15s} {r['mode']:7s} {r['suite']:10s} "
                     f"{str(r['planted']) + how:15s} {str(r['twin']):5s} {r['why']}")
    failures = [r for r in rows if r["suite"] in ("fail", "known")]
    good = [r for r in failures if r["planted"] == 1 and r["twin"] == 0]
    standalone = [r for r in failures if r["planted"] != 2]
    by_check = [r for r in good if r.get("how") == "check"]
    lines.append("")
    lines.append(f"of {len(rows)} (planted bug, invariant) runs, {len(failures)} failed here; of those "
                 f"{len(failures)} failures, {len(good)} reproduce (exit 1; {len(by_check)} by a failed check, "
                 f"{len(good) - len(by_check)} by an exception of the engine's) and their twins pass (exit 0); "
                 f"{len(failures) - len(standalone)} got a 'not standalone' file (exit 2); "
                 f"{len(standalone) - len(good)} other; {sum(1 for r in good if r.get('alone'))} of the reproducing "
                 "files import neither spec nor impl and ran with neither importable")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spec.repro.measure", description=__doc__.splitlines()[0])
    parser.add_argument("--bugs", default="", help="comma-separated planted bug names (default: all)")
    parser.add_argument("--invariants", default="", help="only bugs whose first caught_by is one of these IDs")
    parser.add_argument("--skip-families", default="", help="skip bugs whose first invariant starts with one of "
                        "these prefixes, e.g. INV-RANK,INV-MEG")
    parser.add_argument("--examples", type=int, default=5)
    parser.add_argument("--every", action="store_true", help="each caught_by invariant of a bug, not only its first")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    os.environ.setdefault("SPEC_EXAMPLE_DB", ":memory:")
    bugs = [b for b in (args.bugs.split(",") if args.bugs else PLANTED) if b]
    skip = tuple(p for p in args.skip_families.split(",") if p)
    if skip:
        bugs = [b for b in bugs if not PLANTED[b].caught_by[0].startswith(skip)]
    folder = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="repro-measure-"))
    rows = measure(bugs, folder, args.examples, set(args.invariants.split(",")) if args.invariants else None,
                   every=args.every)
    print(report(rows))
    print(f"(files under {folder})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
