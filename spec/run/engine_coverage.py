"""Engine-code coverage: which lines and branches of the engine's own preparation code a ``spec verify`` run reached.

The engine's profile names its surface (:attr:`spec.protocol.profile.EngineProfile.surface`): ``package.module``
(every function and method body of the module; module-level statements, run at import, are not counted) or
``package.module:qualname`` (that function's body only, e.g. ``verl.workers.engine.fsdp.transformer_impl:
FSDPEngineWithLMHead.prepare_model_inputs``). coverage.py measures them (branch coverage, ``include=`` the surface's
files) in every process that runs engine code: the verify process, its workers (:mod:`spec.run.parallel`) and the
real-rank workers (:mod:`spec.execute.rank_worker`), each through :mod:`spec.execute.coverage_hook`; the parent
combines the per-process data files.

A *branch* is one exit of a line with two or more (coverage.py's arcs: ``if``/``for``/``while``/``try`` and the
like; an exit that leaves the function is written ``->exit``). Each one is either reached or declared in the
profile (:attr:`~spec.protocol.profile.EngineProfile.unreachable`) with its reason, under one of the keys

* ``module:LINE->DEST`` (one exit; ``DEST`` a line or ``exit``),
* ``module:LINE`` (every exit of that line),
* ``*:raise`` (every exit into a ``raise`` statement: the error paths of inputs the contract rejects),
* ``module:qualname`` (every branch of that function: e.g. a CUDA-only function),

the first that is declared giving the reason.

What the preparation never passes through is declared off its path instead
(:attr:`~spec.protocol.profile.EngineProfile.off_path`): a function (``module:qualname``, its lines not counted) or
one branch of an on-path function (``module:LINE->DEST``, or ``module:LINE`` for every exit of that line: an exit
only a caller outside the preparation takes). Such branches are not counted either, the report lists them with their
reasons, and ``spec mutate`` mutates nothing in the blocks they enter; an ``off_path`` key that names no function or
no branch of the surface is listed with the surface entries not found.

A reason starting ``gap:`` is no reason at all but an open gap of the case space: it names the input a real trainer
sends that would reach the branch, so that the next case-space change can draw it; the report counts such branches
apart from those declared unreachable.

The report (:func:`write_section`) gives the share of branches reached and lists each unreached one with its
source line and its reason or ``**no reason declared**``; tests/test_engine_coverage.py fails on the latter.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any, Mapping

from ..execute import coverage_hook

__all__ = ["Region", "Branch", "CoverageResult", "regions", "off_path_nodes", "branch_key", "entered_blocks",
           "Measurement", "begin", "write_section", "from_dict", "main", "SECTION", "RAISE", "GAP"]

#: the key declaring every exit into a ``raise`` statement (an error path: the input the contract rejects)
RAISE = "*:raise"
#: a declared reason starting so is no reason the branch cannot be reached: an open gap of the case space, naming
#: the input that would reach it (listed and counted apart; the test lets it pass, the report does not hide it)
GAP = "gap:"
#: set to 1: spec verify measures nothing (the report says so)
OFF = "SPEC_NO_ENGINE_COVERAGE"
#: the JSON report's key and the Markdown section's title
SECTION = "engine_coverage"
TITLE = "## Engine-code coverage (the engine's own preparation code, coverage.py)"


@dataclass(frozen=True)
class Region:
    """One surface entry resolved: its module, file, and the lines of the function bodies it counts, each line
    with the qualname of the innermost function holding it."""

    entry: str
    module: str
    file: str
    lines: Mapping[int, str]
    raises: frozenset[int] = frozenset()  # the lines that start a raise statement


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualname, node) of every function and method, outer ones first."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _functions(node, f"{name}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def _body_lines(node: ast.AST) -> range:
    return range(node.body[0].lineno, node.end_lineno + 1)


def source_file(module: str) -> str | None:
    """The source file of ``module`` (a dotted name), found without importing it or its packages (an engine's
    package may import only under the adapter's stubs); the loaded module's own file where it is imported."""
    loaded = sys.modules.get(module)
    if getattr(loaded, "__file__", None) and str(loaded.__file__).endswith(".py"):
        return str(loaded.__file__)
    path, spec = None, None
    for part in module.split("."):
        spec = PathFinder.find_spec(part, path)
        if spec is None:
            break
        path = spec.submodule_search_locations
    if spec is None:  # not on sys.path (an editable install's own finder): ask the import system
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            return None
    origin = spec.origin if spec is not None else None
    return origin if origin and origin.endswith(".py") else None


def branch_key(key: str) -> tuple[str, int, str | None] | None:
    """``(module, line, dest)`` of a key naming a branch (``module:LINE->DEST``, ``DEST`` a line or ``exit``) or a
    branch line (``module:LINE``, ``dest`` None); None for any other key (a function, ``*:raise``)."""
    module, _, where = key.rpartition(":")
    line, arrow, dest = where.partition("->")
    if not module or not line.isdigit() or arrow and not (dest.isdigit() or dest == "exit"):
        return None
    return module, int(line), dest if arrow else None


def _off(module: str, name: str, off_path: Mapping[str, str]) -> bool:
    """Whether function ``name`` of ``module`` lies in a function the profile declares off the preparation's path."""
    return any(f"{module}:{name}" == key or f"{module}:{name}".startswith(key + ".") for key in off_path
               if branch_key(key) is None)


def entered_blocks(tree: ast.AST, line: int, dest: str | None) -> list[list[ast.stmt]]:
    """The statement blocks a branch enters: ``LINE->DEST``'s, the block whose first statement starts at ``DEST``
    (none for ``exit``); ``LINE``'s (every exit), the body and ``else`` of the statement at ``LINE``."""
    if dest is not None:
        if not dest.isdigit():
            return []
        return [block for node in ast.walk(tree) for name in ("body", "orelse", "finalbody", "handlers")
                if isinstance(block := getattr(node, name, None), list) and block and isinstance(block[0], ast.AST)
                and getattr(block[0], "lineno", None) == int(dest)][:1]
    stmt = next((n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno == line), None)
    return [b for b in (getattr(stmt, "body", None), getattr(stmt, "orelse", None)) if isinstance(b, list) and b]


def regions(surface: tuple[str, ...], off_path: Mapping[str, str] = {}) -> tuple[list[Region], dict[str, str]]:
    """The surface's entries resolved to files and lines (less the functions ``off_path`` declares off the
    preparation's path), and each entry that names no module or function of the installed engine with why
    (reported, never an empty measurement in silence: a surface that rotted shows); an ``off_path`` entry that
    names no function of the surface, or a branch key whose line is not in the surface's functions, is reported the
    same way (that the line has the branch is known only after the run: :func:`analyse`)."""
    out, missing = [], {}
    matched: set[str] = set()
    for entry in surface:
        module, _, qualname = entry.partition(":")
        origin = source_file(module)
        if origin is None:
            missing[entry] = f"module {module!r} not found (or has no Python source)"
            continue
        tree = ast.parse(Path(origin).read_text(), origin)
        functions = list(_functions(tree))
        if qualname:
            chosen = [(q, n) for q, n in functions if q == qualname or q.startswith(qualname + ".<locals>.")]
            if not chosen:
                missing[entry] = f"no function {qualname!r} in {origin}"
                continue
        else:
            chosen = functions
        lines: dict[int, str] = {}
        for name, node in chosen:  # outer first: an inner function's lines get its own name
            lines.update(dict.fromkeys(_body_lines(node), name))
        for key in off_path:
            if any(_off(module, name, {key: ""}) for name in set(lines.values())):
                matched.add(key)
        lines = {line: name for line, name in lines.items() if not _off(module, name, off_path)}
        blocked: set[int] = set()  # the lines of the blocks the branches off the path enter: not counted either
        for key in off_path:
            branch = branch_key(key)
            if branch is not None and branch[0] == module and branch[1] in lines:
                matched.add(key)
                blocked.update(line for block in entered_blocks(tree, branch[1], branch[2]) for stmt in block
                               for line in range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
        lines = {line: name for line, name in lines.items() if line not in blocked}
        raises = frozenset(n.lineno for n in ast.walk(tree) if isinstance(n, ast.Raise))
        out.append(Region(entry, module, origin, lines, raises))
    for key in set(off_path) - matched:
        missing[key] = ("declared off the path, but no function of the surface has this name" if branch_key(key) is None
                        else "declared off the path, but this line is in no counted function of the surface")
    return out, missing


def off_path_nodes(module: str, qualname: str, node: ast.AST, off_path: Mapping[str, str]) -> set[int]:
    """The ``id`` of every ast node inside the functions nested in ``node`` (function ``qualname`` of ``module``)
    that ``off_path`` declares off the preparation's path, and inside the blocks its branches of ``module`` enter
    (their lines are not counted; nothing in them is mutated)."""
    prefix = f"{qualname}.<locals>." if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else f"{qualname}."
    off = {id(sub) for name, inner in _functions(node, prefix) if _off(module, name, off_path)
           for sub in ast.walk(inner)}
    for branch in filter(None, map(branch_key, off_path)):
        if branch[0] == module:
            off |= {id(sub) for block in entered_blocks(node, branch[1], branch[2]) for stmt in block
                    for sub in ast.walk(stmt)}
    return off


@dataclass(frozen=True)
class Branch:
    """One exit of a branch line."""

    module: str
    function: str
    line: int
    dest: int
    source: str
    reached: bool
    reason: str | None = None

    @property
    def key(self) -> str:
        return f"{self.module}:{self.line}->{self.dest if self.dest > 0 else 'exit'}"

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "function": self.function, "source": self.source, "reached": self.reached,
                "reason": self.reason}


@dataclass
class CoverageResult:
    """What a run reached of the surface (``measured`` False: why not, in ``note``)."""

    surface: tuple[str, ...]
    measured: bool
    note: str = ""
    branches: list[Branch] = field(default_factory=list)
    statements: int = 0
    executed: int = 0
    stale: list[str] = field(default_factory=list)  # declared keys that name no unreached branch
    missing: dict[str, str] = field(default_factory=dict)  # surface entries not found, with why
    off_path: dict[str, str] = field(default_factory=dict)  # functions, branches of the surface not counted, with why

    @property
    def reached(self) -> int:
        return sum(b.reached for b in self.branches)

    @property
    def unreached(self) -> list[Branch]:
        return [b for b in self.branches if not b.reached]

    @property
    def without_reason(self) -> list[Branch]:
        return [b for b in self.unreached if b.reason is None]

    @property
    def gaps(self) -> list[Branch]:
        return [b for b in self.unreached if b.reason is not None and b.reason.startswith(GAP)]

    @property
    def share(self) -> float:
        return self.reached / len(self.branches) if self.branches else 1.0

    def summary(self) -> str:
        if not self.measured:
            return f"engine coverage: not measured ({self.note})"
        declared = len(self.unreached) - len(self.without_reason) - len(self.gaps)
        return (f"engine coverage: {self.share:.1%} of {len(self.branches)} branches reached "
                f"({self.reached}; unreached: {declared} declared unreachable, {len(self.gaps)} open gaps, "
                f"{len(self.without_reason)} without a reason); "
                f"lines {self.executed}/{self.statements}"
                + (f"; {len(self.missing)} surface entries not found" if self.missing else ""))

    def as_dict(self) -> dict[str, Any]:
        return {"surface": list(self.surface), "measured": self.measured, "note": self.note,
                "branches": len(self.branches), "reached": self.reached, "share": round(self.share, 4),
                "statements": self.statements, "executed": self.executed,
                "unreached_without_reason": len(self.without_reason), "open_gaps": len(self.gaps),
                "unreached": [b.as_dict() for b in self.unreached], "stale_declarations": self.stale,
                "surface_not_found": self.missing, "off_path": self.off_path}

    def markdown(self) -> list[str]:
        lines = ["", TITLE, ""]
        if not self.measured:
            return lines + [f"Not measured: {self.note}."]
        lines += [f"**{self.summary().removeprefix('engine coverage: ')}**", "",
                  "Surface (the profile's `surface`): " + ", ".join(f"`{s}`" for s in self.surface) + ".", ""]
        if self.off_path:
            lines += ["Not counted, off the preparation's path (the profile's `off_path`): "
                      + "; ".join(f"`{k}`: {v}" for k, v in self.off_path.items()) + ".", ""]
        if self.unreached:
            lines += ["| branch | function | source line | why unreached |", "|---|---|---|---|"]
            for b in self.unreached:
                why = (b.reason or "**no reason declared**").replace("|", "/")
                why = f"**open gap**: {why.removeprefix(GAP).strip()}" if why.startswith(GAP) else why
                lines.append(f"| `{b.key}` | `{b.function}` | `{b.source.replace('|', '/')}` | {why} |")
        else:
            lines.append("Every branch of the surface was reached.")
        if self.missing:
            lines += ["", "**Surface entries not found** (the profile names code the installed engine lacks): "
                      + "; ".join(f"`{k}`: {v}" for k, v in self.missing.items()) + "."]
        if self.stale:
            lines += ["", "Declared unreachable but reached (or no such branch): "
                      + ", ".join(f"`{k}`" for k in self.stale) + "."]
        return lines


def _reason(unreachable: Mapping[str, str], module: str, function: str, line: int, dest: int,
            raises: bool = False) -> tuple[str | None, str | None]:
    """The declared reason of one unreached exit and the key it was declared under (the most precise first)."""
    keys = [f"{module}:{line}->{dest if dest > 0 else 'exit'}", f"{module}:{line}", *([RAISE] if raises else [])]
    parts = function.split(".<locals>.")
    keys += [f"{module}:{'.<locals>.'.join(parts[:n])}" for n in range(len(parts), 0, -1)]
    for key in keys:
        if key in unreachable:
            return unreachable[key], key
    return None, None


def analyse(cov: Any, surface: tuple[str, ...], unreachable: Mapping[str, str], found: list[Region],
            off_path: Mapping[str, str] = {}) -> CoverageResult:
    """The branches of ``found`` in ``cov``'s (combined) data, less those ``off_path`` declares off the path (not
    counted; a key that names no branch of the surface is in ``missing``, one whose branch was reached in ``stale``)."""
    result = CoverageResult(surface, True)
    used: set[str] = set()
    off = {key for key in off_path if branch_key(key) is not None}
    off_used: set[str] = set()
    seen: set[tuple[str, int, int]] = set()
    for region in found:
        analysis = cov._analyze(region.file)  # coverage.py's per-file analysis (statements, arcs, exit counts)
        source = Path(region.file).read_text().splitlines()
        lines = region.lines
        result.statements += len(analysis.statements & lines.keys())
        result.executed += len(analysis.executed & lines.keys())
        for start, end in analysis.arc_possibilities:
            if (start not in lines or analysis.exit_counts.get(start, 0) < 2 or start in analysis.no_branch
                    or end in analysis.excluded or (region.module, start, end) in seen):
                continue
            seen.add((region.module, start, end))
            function = lines[start]
            reached = (start, end) in analysis.arcs_executed_set
            declared_off = off & {f"{region.module}:{start}->{end if end > 0 else 'exit'}", f"{region.module}:{start}"}
            if declared_off:  # off the preparation's path: not counted (reached, the declaration is stale)
                off_used |= declared_off
                if reached:
                    result.stale += sorted(declared_off)
                continue
            reason, key = (None, None) if reached else _reason(unreachable, region.module, function, start, end,
                                                                 end in region.raises)
            if key:
                used.add(key)
            result.branches.append(Branch(region.module, function, start, end, source[start - 1].strip(), reached,
                                          reason))
    result.branches.sort(key=lambda b: (b.module, b.line, b.dest))
    result.stale = sorted(set(unreachable) - used | set(result.stale))
    result.missing = {key: "declared off the path, but no branch of the surface leaves this line so"
                      for key in sorted(off - off_used)}
    return result


class Measurement:
    """One run's measurement: :meth:`start` before the targets run (this process measures too, and every process
    started after it that calls :func:`spec.execute.coverage_hook.start`), :meth:`finish` after them. ``gated`` (spec
    verify's): the processes that run checks measure only inside the engine's calls
    (:func:`spec.execute.coverage_hook.engine_code`), where its code runs; the suite's own lines run untraced."""

    def __init__(self, surface: tuple[str, ...], unreachable: Mapping[str, str], off_path: Mapping[str, str] = {},
                 gated: bool = False):
        self.surface, self.unreachable, self.off_path = tuple(surface), dict(unreachable), dict(off_path)
        self.found, self.missing = regions(self.surface, self.off_path)
        self.folder = Path(tempfile.mkdtemp(prefix="spec-engine-coverage-"))
        coverage_hook.write_config(self.folder, sorted({r.file for r in self.found}), gated)
        #: after :meth:`finish`: file -> line -> the coverage contexts (targets) that ran it, where contexts were
        #: switched (``spec mutate``'s coverage map); empty otherwise
        self.line_contexts: dict[str, dict[int, set[str]]] = {}
        self._previous = os.environ.get(coverage_hook.ENV)

    def start(self) -> "Measurement":
        os.environ[coverage_hook.ENV] = str(self.folder)
        coverage_hook.start()
        return self

    def finish(self) -> CoverageResult:
        """Stop measuring (the rank pools this process started are shut down first, so their ranks save their
        data), combine every process's data and analyse it."""
        ranks = sys.modules.get("spec.execute.ranks")  # loaded only where a target ran on real ranks
        if ranks is not None:
            ranks.shutdown()
        coverage_hook.stop()
        if self._previous is None:
            os.environ.pop(coverage_hook.ENV, None)
        else:
            os.environ[coverage_hook.ENV] = self._previous
        try:
            cov = coverage_hook.new(self.folder, sorted({r.file for r in self.found}))
            if any(self.folder.glob(coverage_hook.DATA + ".*")):
                cov.combine([str(self.folder)], keep=False)
            cov.load()
            data = cov.get_data()
            self.line_contexts = {f: {line: {c for c in ctx if c} for line, ctx in data.contexts_by_lineno(f).items()}
                                  for f in data.measured_files()}
            result = analyse(cov, self.surface, self.unreachable, self.found, self.off_path)
            result.missing, result.off_path = {**result.missing, **self.missing}, self.off_path
            return result
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


class _Unmeasured:
    def __init__(self, surface: tuple[str, ...], note: str):
        self.result = CoverageResult(tuple(surface), False, note)

    def start(self) -> "_Unmeasured":
        return self

    def finish(self) -> CoverageResult:
        return self.result


def begin(engine: Any) -> Measurement | _Unmeasured:
    """Start measuring ``engine``'s surface (its profile's); a stand-in that reports why not where there is no
    surface or no coverage.py."""
    profile = getattr(engine, "profile", None)
    if os.environ.get(OFF, "") not in ("", "0"):
        return _Unmeasured(getattr(profile, "surface", ()), f"turned off by ${OFF}")
    if profile is None or not profile.surface:
        return _Unmeasured((), f"the engine's profile declares no surface ({type(engine).__name__})")
    if not coverage_hook.available():
        return _Unmeasured(profile.surface, "coverage.py is not installed (pip install coverage)")
    return Measurement(profile.surface, profile.unreachable, getattr(profile, "off_path", {}), gated=True).start()


def write_section(result: CoverageResult, paths: list[Path]) -> str:
    """Add the coverage section to the reports ``spec verify`` wrote (Markdown: appended; JSON: the ``engine_coverage``
    key); the one line for stdout."""
    for path in paths:
        if path.suffix == ".md":
            path.write_text(path.read_text().rstrip("\n") + "\n" + "\n".join(result.markdown()) + "\n")
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
            data[SECTION] = result.as_dict()
            path.write_text(json.dumps(data, indent=2))
    return result.summary()


def from_dict(data: Mapping[str, Any]) -> CoverageResult:
    """A report's ``engine_coverage`` section back as a result (its unreached branches; the reached ones by count)."""
    result = CoverageResult(tuple(data["surface"]), bool(data["measured"]), data.get("note", ""),
                            statements=data.get("statements", 0), executed=data.get("executed", 0),
                            stale=list(data.get("stale_declarations", [])),
                            missing=dict(data.get("surface_not_found", {})), off_path=dict(data.get("off_path", {})))
    for b in data.get("unreached", []):
        module, _, arc = b["key"].rpartition(":")
        line, _, dest = arc.partition("->")
        result.branches.append(Branch(module, b["function"], int(line), -1 if dest == "exit" else int(dest),
                                      b["source"], False, b["reason"]))
    result.branches += [Branch("", "", 0, 0, "", True)] * int(data.get("reached", 0))
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m spec.run.engine_coverage REPORT.json``: the coverage section of a report ``spec verify`` wrote
    (Markdown, as in the report; for the docs)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m spec.run.engine_coverage reports/verify-<engine>.json", file=sys.stderr)
        return 2
    data = json.loads(Path(args[0]).read_text())
    if SECTION not in data:
        print(f"{args[0]}: no {SECTION} section", file=sys.stderr)
        return 1
    print("\n".join(from_dict(data[SECTION]).markdown()).strip())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
