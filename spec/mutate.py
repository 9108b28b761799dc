"""``python -m spec mutate --engine X``: mutation analysis of the engine's own preparation code (a first
skeleton, by hand or nightly, never in ``.ci/run``).

1. **The coverage map.** Every invariant x mode target runs once in this process under the cheap profile
   (``--profile``, default ``dev``) with coverage.py's dynamic context switched per target: which targets'
   examples ran each line of the engine's surface (:mod:`spec.run.engine_coverage`). Targets on real ranks run
   in other processes and are left out of the map (their lines count as uncovered here).
2. **Mutants** of every function of the surface (``ast``; operators :data:`OPERATORS`: comparisons, ``+``/``-``,
   slice bounds and signs, ``dim=`` arguments, dtype casts, clamps, cat/stack order, dropped dict keys and
   subscript stores, in-place against out-of-place, branches negated, accumulators reset), a seeded random sample
   of ``--sample`` of them.
3. **Each mutant** is installed by swapping its function's ``__code__`` in this process (the module is not
   re-imported; a decorated function other than a method decorator is not mutated), then only the targets whose
   examples ran the mutated line are run, stopping at the first that fails (killed). A survivor of the cheap
   profile is run again under ``--confirm`` (default ``ci``) before it counts as one.
4. **The report** (``<out>/mutate-<engine>.md`` and ``.json``): the score over covered mutants, and every survivor
   with its diff and the targets that ran it; classifying each (equivalent and why, or a gap and how it was
   closed) is left to whoever reads it.
"""

from __future__ import annotations

import ast
import copy
import difflib
import json
import random
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from hypothesis import Verbosity

from .execute import coverage_hook
from .invariants import CATALOGUE
from .run.engine_coverage import regions
from .run.profiles import load_profile
from .run.runner import instances, run_invariant, runs_on_ranks

__all__ = ["Mutant", "OPERATORS", "mutants_of", "coverage_map", "install", "run_mutants", "main_mutate"]

_INPLACE = {"add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div", "masked_fill_": "masked_fill",
            "clamp_": "clamp", "copy_": "copy_", "fill_": "fill_", "index_copy_": "index_copy",
            "scatter_": "scatter", "zero_": "zero_"}
_OUT_OF_PLACE = {v: k for k, v in _INPLACE.items() if k != v}
_CASTS = ("float", "double", "long", "int", "bool", "half", "bfloat16", "contiguous")
_CLAMPS = ("clamp", "clamp_min", "clamp_max", "clip")
_COMPARE = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}


@dataclass
class Mutant:
    """One change to one function of the surface."""

    module: str
    file: str
    function: str
    line: int
    operator: str
    description: str
    original: str = ""
    mutated: str = ""
    targets: list[str] = field(default_factory=list)
    status: str = ""  # killed, survived, uncovered, not installed, timeout
    killed_by: str = ""

    def diff(self) -> str:
        return "".join(difflib.unified_diff(self.original.splitlines(True), self.mutated.splitlines(True),
                                            f"{self.module}:{self.function}", "mutant", n=1))


def _edits(node: ast.AST) -> Iterator[tuple[str, str, Callable[[], None]]]:
    """(operator, description, apply) for every mutation of ``node`` itself (apply edits the node in place)."""
    if isinstance(node, ast.Compare) and type(node.ops[0]) in _COMPARE:
        new = _COMPARE[type(node.ops[0])]
        yield "compare", f"{type(node.ops[0]).__name__} -> {new.__name__}", lambda: node.ops.__setitem__(0, new())
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)):
        new_op = ast.Sub if isinstance(node.op, ast.Add) else ast.Add
        yield "arith", f"{type(node.op).__name__} -> {new_op.__name__}", lambda: setattr(node, "op", new_op())
    if isinstance(node, ast.Slice):
        for part in ("lower", "upper"):
            bound = getattr(node, part)
            if bound is not None:
                yield "slice", f"slice {part} + 1", (lambda p=part, b=bound: setattr(
                    node, p, ast.BinOp(b, ast.Add(), ast.Constant(1))))
                if isinstance(bound, ast.UnaryOp) and isinstance(bound.op, ast.USub):
                    yield "slice", f"slice {part} sign", lambda p=part, b=bound: setattr(node, p, b.operand)
    if isinstance(node, ast.keyword) and node.arg == "dim" and isinstance(node.value, (ast.Constant, ast.UnaryOp)):
        yield "dim", "dim -> other dim", lambda: setattr(node, "value", ast.Constant(
            0 if ast.unparse(node.value) != "0" else -1))
    if isinstance(node, ast.keyword) and node.arg == "dtype":
        yield "dtype", "dtype= dropped", lambda: setattr(node, "arg", "_spec_dropped_dtype")
    if isinstance(node, ast.If):
        yield "branch", "condition negated", lambda: setattr(node, "test", ast.UnaryOp(ast.Not(), node.test))
    if isinstance(node, ast.Dict) and node.keys and node.keys[0] is not None:
        yield "dict key", f"key {ast.unparse(node.keys[-1])} dropped", lambda: (node.keys.pop(), node.values.pop())
    if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
        yield "accumulator", "+= -> =", lambda: setattr(node, "op", None)
    if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("cat", "stack", "concat") and node.args and isinstance(node.args[0], (ast.List, ast.Tuple)) \
                and len(node.args[0].elts) > 1:
            yield "order", f"{name} order reversed", lambda: node.args[0].elts.reverse()
        if isinstance(func, ast.Attribute) and name in _INPLACE and _INPLACE[name] != name:
            yield "inplace", f".{name} -> .{_INPLACE[name]}", lambda: setattr(func, "attr", _INPLACE[name])
        if isinstance(func, ast.Attribute) and name in _OUT_OF_PLACE:
            yield "inplace", f".{name} -> .{_OUT_OF_PLACE[name]}", lambda: setattr(func, "attr", _OUT_OF_PLACE[name])


class _Replace(ast.NodeTransformer):
    """Casts and clamps removed (``x.float()`` -> ``x``), a dropped dtype= removed, ``+=`` made ``=``, by marker."""

    def __init__(self, target: ast.AST):
        self.target = target

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        node.keywords = [k for k in node.keywords if k.arg != "_spec_dropped_dtype"]
        if node is self.target and isinstance(node.func, ast.Attribute):
            return node.func.value
        return node

    def visit_AugAssign(self, node: ast.AugAssign) -> ast.AST:
        if node.op is None:
            return ast.Assign(targets=[node.target], value=node.value, lineno=node.lineno)
        return node


def _removals(node: ast.AST) -> Iterator[tuple[str, str]]:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args \
            and node.func.attr in _CASTS:
        yield "cast", f".{node.func.attr}() removed"
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _CLAMPS:
        yield "clamp", f".{node.func.attr}(...) removed"


def _function_nodes(tree: ast.Module, qualname: str) -> ast.AST | None:
    scope: list[ast.AST] = [tree]
    for part in qualname.split("."):
        found = next((n for s in scope for n in ast.iter_child_nodes(s)
                      if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.name == part), None)
        if found is None:
            return None
        scope = [found]
    return scope[0]


def mutants_of(surface: tuple[str, ...]) -> list[Mutant]:
    """Every mutant of every top-level function and method of the surface (nested functions inside them)."""
    out: list[Mutant] = []
    found, _ = regions(surface)
    for region in found:
        tree = ast.parse(Path(region.file).read_text())
        names = sorted({q.split(".<locals>.")[0] for q in region.lines.values()})
        for qualname in names:
            node = _function_nodes(tree, qualname)
            if node is None or any(not (isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod"))
                                   for d in node.decorator_list):
                continue
            original = ast.unparse(node)
            for index, sub in enumerate(ast.walk(node)):
                if sub is node:
                    continue
                edits = [(op, text, None) for op, text, _ in _edits(sub)] + [(op, text, "remove")
                                                                           for op, text in _removals(sub)]
                for k, (op, text, how) in enumerate(edits):
                    clone = copy.deepcopy(node)
                    target = [n for n in ast.walk(clone) if n is not clone][index - 1]
                    if how == "remove":
                        clone = _Replace(target).visit(clone)
                    else:
                        list(_edits(target))[k][2]()
                        clone = _Replace(None).visit(clone)
                    ast.fix_missing_locations(clone)
                    try:
                        mutated = ast.unparse(clone)
                    except Exception:  # noqa: BLE001 - an edit that does not unparse is no mutant
                        continue
                    if mutated != original:
                        out.append(Mutant(region.module, region.file, qualname, getattr(sub, "lineno", node.lineno),
                                          op, text, original, mutated))
    return out


def coverage_map(engine: Any, pairs: list, device: str, include: list[str],
                 overrides: dict) -> dict[str, dict[int, set[str]]]:
    """file -> line -> the targets (``invariant/mode``) whose examples ran it, from one in-process run."""
    folder = Path(tempfile.mkdtemp(prefix="spec-mutate-"))
    cov = coverage_hook.new(folder, include)
    cov.start()
    try:
        for info, mode in pairs:
            cov.switch_context(f"{info.id}/{mode}")
            run_invariant(info, engine, mode, device, **overrides)
    finally:
        cov.stop()
    data = cov.get_data()
    return {f: {line: {c for c in ctx if c} for line, ctx in data.contexts_by_lineno(f).items()}
            for f in data.measured_files()}


def _function_object(module: str, qualname: str) -> Any:
    obj = sys.modules[module]
    for part in qualname.split("."):
        obj = obj.__dict__[part] if hasattr(obj, "__dict__") and part in obj.__dict__ else getattr(obj, part)
    return getattr(obj, "__func__", obj)


def install(mutant: Mutant) -> Callable[[], None]:
    """Swap the mutated code into the live function; the undo."""
    fn = _function_object(mutant.module, mutant.function)
    owner = mutant.function.rsplit(".", 1)[0] if "." in mutant.function else None
    body = mutant.mutated if owner is None else "class _Owner:\n" + "\n".join(
        "    " + line for line in mutant.mutated.splitlines())
    namespace = dict(vars(sys.modules[mutant.module]))
    exec(compile(body, f"<mutant {mutant.module}:{mutant.function}:{mutant.line}>", "exec"), namespace)
    name = mutant.function.rsplit(".", 1)[-1]
    new = namespace[name] if owner is None else namespace["_Owner"].__dict__[name]
    new = getattr(new, "__func__", new)
    old = fn.__code__
    fn.__code__ = new.__code__
    return lambda: setattr(fn, "__code__", old)


class _Timeout(Exception):
    pass


def _alarm(signum, frame):  # noqa: ARG001
    raise _Timeout()


def _kills(mutant: Mutant, engine: Any, by_key: dict, device: str, overrides: dict, seconds: int) -> str:
    """The first target that fails with the mutant installed, or ''."""
    undo = install(mutant)
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for key in mutant.targets:
            info, mode = by_key[key]
            signal.alarm(seconds)
            try:
                outcome = run_invariant(info, engine, mode, device, shrink=False, **overrides)
            except _Timeout:
                return f"{key} (timeout)"
            finally:
                signal.alarm(0)
            if outcome.status in ("fail", "error"):
                return key
        return ""
    finally:
        signal.signal(signal.SIGALRM, previous)
        undo()


def run_mutants(engine: Any, *, sample: int, seed: int, profile: str, confirm: str | None, device: str = "cpu",
                only: tuple[str, ...] = (), seconds: int = 300,
                progress: Callable[[str], None] = print) -> list[Mutant]:
    load_profile(profile)
    quiet = {"verbosity": Verbosity.quiet}
    pairs = [(i, m) for i, m in instances() if (not only or i.id.startswith(only)) and not runs_on_ranks(i, engine)]
    by_key = {f"{i.id}/{m}": (i, m) for i, m in pairs}
    found, _ = regions(engine.profile.surface)
    progress(f"mutate: coverage map of {len(pairs)} targets under {profile}")
    lines = coverage_map(engine, pairs, device, sorted({r.file for r in found}), quiet)
    mutants = mutants_of(engine.profile.surface)
    chosen = random.Random(seed).sample(mutants, min(sample, len(mutants)))
    progress(f"mutate: {len(mutants)} mutants, {len(chosen)} sampled (seed {seed})")
    for n, mutant in enumerate(chosen):
        mutant.targets = sorted(lines.get(mutant.file, {}).get(mutant.line, set()))
        if not mutant.targets:
            mutant.status = "uncovered"
            continue
        try:
            mutant.killed_by = _kills(mutant, engine, by_key, device, quiet, seconds)
        except Exception as exc:  # noqa: BLE001 - a mutant that cannot be installed
            mutant.status, mutant.killed_by = "not installed", f"{type(exc).__name__}: {exc}"
            continue
        if not mutant.killed_by and confirm:
            load_profile(confirm)
            try:
                mutant.killed_by = _kills(mutant, engine, by_key, device, quiet, seconds)
            finally:
                load_profile(profile)
        mutant.status = "killed" if mutant.killed_by else "survived"
        progress(f"[{n + 1}/{len(chosen)}] {mutant.module}:{mutant.line} {mutant.operator}: {mutant.status}")
    return chosen


def write_report(mutants: list[Mutant], engine: str, out: Path, *, seed: int, profile: str, confirm: str | None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    covered = [m for m in mutants if m.status in ("killed", "survived")]
    killed = [m for m in covered if m.status == "killed"]
    score = len(killed) / len(covered) if covered else 0.0
    line = (f"mutate: {len(killed)} of {len(covered)} covered mutants killed ({score:.1%}); "
            f"{sum(m.status == 'uncovered' for m in mutants)} uncovered, "
            f"{sum(m.status == 'not installed' for m in mutants)} not installed; sample of {len(mutants)}, seed {seed}")
    md = [f"# Mutation report: engine `{engine}`", "", f"profile `{profile}`, survivors confirmed under "
          f"`{confirm}`: **{line.removeprefix('mutate: ')}**", "", "## Survivors", ""]
    for m in (m for m in mutants if m.status == "survived"):
        md += [f"### `{m.module}:{m.line}` {m.operator}: {m.description}", "",
               f"ran by: {', '.join(m.targets)}; classification: (to do: equivalent and why, or the gap and how "
               "it was closed)", "", "```diff", m.diff().rstrip(), "```", ""]
    (out / f"mutate-{engine}.md").write_text("\n".join(md) + "\n")
    (out / f"mutate-{engine}.json").write_text(json.dumps({
        "engine": engine, "seed": seed, "profile": profile, "confirm": confirm, "score": round(score, 4),
        "mutants": [{**asdict(m), "diff": m.diff()} for m in mutants]}, indent=2))
    return line


def main_mutate(args: Any, engine: Any) -> int:
    start = time.perf_counter()
    only = tuple(p.strip() for p in args.only.split(",") if p.strip()) if args.only else ()
    mutants = run_mutants(engine, sample=args.sample, seed=args.seed, profile=args.profile,
                          confirm=None if args.confirm == "none" else args.confirm, only=only, seconds=args.timeout,
                          progress=lambda text: print(text, file=sys.stderr))
    safe = engine.name.replace(":", "-").replace("/", "-")
    print(write_report(mutants, safe, Path(args.out), seed=args.seed, profile=args.profile, confirm=args.confirm)
          + f" in {time.perf_counter() - start:.0f}s")
    return 0
