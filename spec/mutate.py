"""``python -m spec mutate --engine X``: mutation analysis of the engine's own preparation code (a first
skeleton, by hand or nightly, never in ``.ci/run``).

1. **The coverage map.** Every invariant x mode target runs once in this process under the cheap profile
   (``--profile``, default ``dev``) with coverage.py's dynamic context switched per target: which targets'
   examples ran each line of the engine's surface (:mod:`spec.run.engine_coverage`). Targets on real ranks run
   in other processes and are left out of the map (their lines count as uncovered here).
2. **Mutants** of every function of the surface but what the profile declares off the path (its functions, and the
   blocks its branches off the path enter; ``ast``; operators :data:`OPERATORS`: comparisons, ``+``/``-``, slice
   bounds and signs, ``dim=`` arguments, dtype casts, clamps, cat/stack order, dropped dict keys and subscript
   stores, in-place against out-of-place, branches negated, accumulators reset), a seeded random sample of
   ``--sample`` of them.
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
import hashlib
import json
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from hypothesis import Verbosity, settings

from .execute import probe, ranks
from .protocol.errors import MutantTimeout
from .run.engine_coverage import Measurement, entered_blocks, off_path_nodes, regions
from .run.profiles import load_profile
from .run.runner import instances, run_invariant

__all__ = ["Mutant", "mutants_of", "coverage_map", "classify", "run_mutants", "write_report", "main_mutate"]

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
    #: killed, survived, equivalent (a survivor the profile declares equivalent), unreachable (its line lies in a
    #: branch the profile declares unreachable), uncovered (no target ran its line), not installed
    status: str = ""
    killed_by: str = ""
    #: the profile's reason for an equivalent or unreachable mutant
    reason: str = ""
    #: the n-th mutant of the same function, line, operator and description (0: the first); part of :attr:`id`
    ordinal: int = 0
    #: killed in an earlier run (``--resume``): not run again
    carried: bool = False

    @property
    def id(self) -> str:
        """A stable name (the key of ``EngineProfile.equivalent_mutants``): module, function, line, operator and
        description, with ``#n`` for the n-th mutant of the same name."""
        name = f"{self.module}:{self.function}:{self.line} {self.operator}: {self.description}"
        return name if not self.ordinal else f"{name} #{self.ordinal + 1}"

    @property
    def mutation(self) -> probe.Mutation:
        return (self.module, self.function, self.mutated)

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


def mutants_of(surface: tuple[str, ...], off_path: Mapping[str, str] = {}) -> list[Mutant]:
    """Every mutant of every top-level function and method of the surface (nested functions inside them), less
    those of the functions ``off_path`` declares off the preparation's path and of the blocks its branches off the
    path enter (the profile's: not counted by the engine-code coverage, never run by a target, so never killed)."""
    out: list[Mutant] = []
    found, _ = regions(surface, off_path)
    for region in found:
        tree = ast.parse(Path(region.file).read_text())
        names = sorted({q.split(".<locals>.")[0] for q in region.lines.values()})
        for qualname in names:
            node = _function_nodes(tree, qualname)
            if node is None or any(not (isinstance(d, ast.Name) and d.id in ("staticmethod", "classmethod"))
                                   for d in node.decorator_list):
                continue
            original = ast.unparse(node)
            off = off_path_nodes(region.module, qualname, node, off_path)
            for index, sub in enumerate(ast.walk(node)):
                if sub is node or id(sub) in off:
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
    seen: dict[str, int] = {}
    for mutant in out:
        mutant.ordinal = seen.get(mutant.id, 0)
        seen[mutant.id.split(" #")[0]] = mutant.ordinal + 1
    return out


def coverage_map(engine: Any, pairs: list, device: str, overrides: dict, seconds: dict[str, float] | None = None,
                 statuses: dict[str, str] | None = None) -> dict[str, dict[int, set[str]]]:
    """file -> line -> the targets (``invariant/mode``) whose examples ran it: every target once under the loaded
    profile, the engine-code coverage's dynamic context switched per target here and on the real ranks. Each
    target's run time goes to ``seconds`` (a mutant runs its cheapest targets first), its outcome on the engine's own
    code to ``statuses`` (a target that fails unmutated kills nothing)."""
    profile = engine.profile
    ranks.shutdown()  # the ranks (and their fork server) start after the measurement, so that they measure too
    measurement = Measurement(profile.surface, profile.unreachable, getattr(profile, "off_path", {})).start()
    try:
        for info, mode in pairs:
            key = f"{info.id}/{mode}"
            probe.set_context(key)
            took = time.perf_counter()
            outcome = run_invariant(info, engine, mode, device, **overrides)
            if seconds is not None:
                seconds[key] = time.perf_counter() - took
            if statuses is not None:
                statuses[key] = outcome.status
    finally:
        probe.set_context(None)
        measurement.finish()
    return measurement.line_contexts


def _alarm(signum, frame):  # noqa: ARG001
    raise MutantTimeout()


def _kills(mutant: Mutant, engine: Any, by_key: dict, device: str, overrides: dict, seconds: int) -> str:
    """The first target that fails with the mutant installed (here and on the real ranks), or ''."""
    probe.set_mutant(mutant.mutation)
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        for key in mutant.targets:
            info, mode = by_key[key]
            signal.alarm(seconds)
            try:
                outcome = run_invariant(info, engine, mode, device, shrink=False, **overrides)
            except MutantTimeout:
                ranks.shutdown()  # a rank may still be inside the mutant's call
                return f"{key} (timeout)"
            finally:
                signal.alarm(0)
            if outcome.status in ("fail", "error"):
                return key
        return ""
    finally:
        signal.signal(signal.SIGALRM, previous)
        probe.set_mutant(None)


def unreachable_reason(mutant: Mutant, unreachable: dict[str, str], tree: ast.AST) -> str | None:
    """The profile's reason why ``mutant``'s line cannot run here, where a declaration covers it: its function
    (``module:qualname``), a ``raise`` (``*:raise``), or the block a declared branch enters (``module:LINE->DEST``;
    ``module:LINE``: either block of that line's statement)."""
    for key, reason in unreachable.items():
        if reason.startswith("gap:"):  # an open gap of the case space: reachable, just not drawn yet
            continue
        module, _, where = key.partition(":")
        if module == "*" and where == "raise":
            if any(isinstance(n, ast.Raise) and n.lineno <= mutant.line <= (n.end_lineno or n.lineno)
                   for n in ast.walk(tree)):
                return reason
            continue
        if module != mutant.module:
            continue
        source, _, dest = where.partition("->")
        if not source.isdigit():  # a function
            if mutant.function == where or mutant.function.startswith(where + "."):
                return reason
            continue
        # the block the branch enters (``LINE``: either block of that line's statement)
        if any(block[0].lineno <= mutant.line <= max(s.end_lineno or s.lineno for s in block)
               for block in entered_blocks(tree, int(source), dest or None)):
            return reason
    return None


def classify(mutant: Mutant, profile: Any, trees: dict[str, ast.AST]) -> None:
    """A survivor the profile declares equivalent (``equivalent_mutants``, by :attr:`Mutant.id`) is ``equivalent``
    with its reason (it is not confirmed under ``--confirm``: only a survivor that counts needs that; a declared one
    that is killed is reported killed, its declaration wrong); an uncovered mutant whose line a declared-unreachable
    branch covers is ``unreachable``."""
    equivalent = getattr(profile, "equivalent_mutants", {}) or {}
    if mutant.status == "survived" and mutant.id in equivalent:
        mutant.status, mutant.reason = "equivalent", equivalent[mutant.id]
    elif mutant.status == "uncovered":
        reason = unreachable_reason(mutant, dict(profile.unreachable), trees[mutant.file])
        if reason is not None:
            mutant.status, mutant.reason = "unreachable", reason


def sample_of(mutants: list[Mutant], size: int, seed: int) -> list[Mutant]:
    """A seeded sample of ``size``: the mutants whose ``sha256(seed, id)`` are the smallest (bottom-k), in that order.
    A mutant's membership depends on its own id alone, so a surface that grows or shrinks elsewhere keeps the rest of
    the sample (and an earlier run's results for it: ``--resume``)."""
    rank = lambda m: hashlib.sha256(f"{seed}\0{m.id}".encode()).hexdigest()  # noqa: E731
    return sorted(mutants, key=rank)[:size]


def _carried(previous: Path | None, sound: set[str]) -> dict[tuple[str, str], str]:
    """(id, mutated source) -> the target that killed it, from an earlier report (``--resume``), where that target is
    one of ``sound`` (it passes on the engine's own code in this run)."""
    if previous is None:
        return {}
    data = json.loads(Path(previous).read_text())
    return {(m["id"], m["mutated"]): m["killed_by"] for m in data["mutants"]
            if m["status"] == "killed" and m["killed_by"].split(" ")[0] in sound}


def seeded(seed: int) -> dict[str, Any]:
    """The run_invariant argument that makes a target draw the same examples in every run of it (the map's baseline
    and each mutant's run see the same cases, so a kill is the mutant's), unless the loaded profile is derandomized
    already (``ci``: its own streams)."""
    return {} if settings.default.derandomize else {"seed": seed}


def run_mutants(engine: Any, *, sample: int, seed: int, profile: str, confirm: str | None, device: str = "cpu",
                only: tuple[str, ...] = (), seconds: int = 300, progress: Callable[[str], None] = print,
                after_each: Callable[[list[Mutant]], None] | None = None, resume: Path | None = None
                ) -> list[Mutant]:
    """The mutants of a seeded sample of ``sample`` (:func:`sample_of`), each run by the targets that ran its line
    (here and on the real ranks; the cheapest first) under ``profile``, a survivor again under ``confirm``, then
    classified (:func:`classify`). ``resume``: an earlier report of the same sample; a mutant it killed (same id,
    same mutated source) is carried over, not run again (the suite between the runs only added checks)."""
    load_profile(profile)
    quiet = {"verbosity": Verbosity.quiet}
    pairs = [(i, m) for i, m in instances() if not only or i.id.startswith(only)]
    by_key = {f"{i.id}/{m}": (i, m) for i, m in pairs}
    progress(f"mutate: coverage map of {len(pairs)} targets under {profile}")
    cost: dict[str, float] = {}
    baseline: dict[str, str] = {}
    lines = coverage_map(engine, pairs, device, {**quiet, **seeded(seed)}, cost, baseline)
    broken = sorted(k for k, status in baseline.items() if status in ("fail", "error"))
    if broken:
        progress(f"mutate: {len(broken)} targets fail on the engine's own code and kill nothing: {', '.join(broken)}")
    mutants = mutants_of(engine.profile.surface, engine.profile.off_path)
    chosen = sample_of(mutants, sample, seed)
    carried = _carried(resume, set(baseline) - set(broken))
    progress(f"mutate: {len(mutants)} mutants, {len(chosen)} sampled (seed {seed})")
    trees = {m.file: ast.parse(Path(m.file).read_text()) for m in chosen}
    for n, mutant in enumerate(chosen):
        mutant.targets = sorted(lines.get(mutant.file, {}).get(mutant.line, set()) - set(broken),
                                key=lambda k: (cost.get(k, 0), k))
        if (mutant.id, mutant.mutated) in carried:
            mutant.status, mutant.killed_by, mutant.carried = "killed", carried[(mutant.id, mutant.mutated)], True
        elif not mutant.targets:
            mutant.status = "uncovered"
        else:
            try:
                mutant.killed_by = _kills(mutant, engine, by_key, device, {**quiet, **seeded(seed)}, seconds)
                if not mutant.killed_by and confirm and mutant.id not in engine.profile.equivalent_mutants:
                    load_profile(confirm)
                    try:
                        mutant.killed_by = _kills(mutant, engine, by_key, device, {**quiet, **seeded(seed)}, seconds)
                    finally:
                        load_profile(profile)
                mutant.status = "killed" if mutant.killed_by else "survived"
            except Exception as exc:  # noqa: BLE001 - a mutant that cannot be installed
                mutant.status, mutant.killed_by = "not installed", f"{type(exc).__name__}: {exc}"
        classify(mutant, engine.profile, trees)
        progress(f"[{n + 1}/{len(chosen)}] {mutant.id}: {mutant.status}")
        if after_each is not None:  # the report so far (a long run can be read, or stopped, at any point)
            after_each(chosen[:n + 1])
    ranks.shutdown()
    return chosen


def score(mutants: list[Mutant]) -> tuple[int, int, float]:
    """(killed, scored, killed / scored): scored are the mutants that could be killed here and are not equivalent:
    killed, survived (a gap) and uncovered (no target ran a reachable line: a gap too)."""
    scored = [m for m in mutants if m.status in ("killed", "survived", "uncovered")]
    killed = sum(m.status == "killed" for m in scored)
    return killed, len(scored), killed / len(scored) if scored else 0.0


def summary(mutants: list[Mutant], seed: int, population: int | None = None) -> str:
    """The run's figure; ``population``: how many mutants the surface has (where the sample is all of them, the line
    says so: a surface of fewer mutants than the sample asked is scored whole)."""
    killed, scored, share = score(mutants)
    count = lambda status: sum(m.status == status for m in mutants)  # noqa: E731
    whole = population is not None and len(mutants) == population
    return (f"mutation score {share:.1%}: {killed} of {scored} non-equivalent mutants killed "
            f"({count('survived')} survived, {count('uncovered')} uncovered); {count('equivalent')} equivalent, "
            f"{count('unreachable')} on declared-unreachable lines, {count('not installed')} not installed; "
            + (f"every one of the surface's {population} mutants (no sample drawn)" if whole else
               f"a sample of {len(mutants)}" + (f" of the surface's {population}" if population else "")
               + f", seed {seed}")
            + (f"; {sum(m.carried for m in mutants)} kills carried over from an earlier run" if any(
                m.carried for m in mutants) else ""))


def write_report(mutants: list[Mutant], engine: str, out: Path, *, seed: int, profile: str, confirm: str | None,
                 population: int | None = None) -> str:
    """``<out>/mutate-<engine>.md`` and ``.json``; returns the summary line (``population``: the surface's mutants)."""
    out.mkdir(parents=True, exist_ok=True)
    line = summary(mutants, seed, population)
    md = [f"# Mutation report: engine `{engine}`", "", f"Each mutant ran under `{profile}`, a survivor again under "
          f"`{confirm}`: **{line}**", ""]
    sections = (("survived", "Survivors (gaps: no check reads what the mutant changes)"),
                ("uncovered", "Uncovered (no target ran the line)"),
                ("equivalent", "Equivalent survivors, with the profile's reason"),
                ("unreachable", "On lines a declared-unreachable branch covers"),
                ("not installed", "Not installed"))
    for status, title in sections:
        chosen = [m for m in mutants if m.status == status]
        if not chosen:
            continue
        md += [f"## {title}: {len(chosen)}", ""]
        for m in chosen:
            md += [f"### `{m.id}`", ""]
            if m.targets:
                md += [f"ran by: {', '.join(m.targets)}", ""]
            if m.reason or (m.killed_by and m.status != "killed"):
                md += [f"why: {m.reason or m.killed_by}", ""]
            md += ["```diff", m.diff().rstrip(), "```", ""]
    (out / f"mutate-{engine}.md").write_text("\n".join(md) + "\n")
    killed, scored, share = score(mutants)
    (out / f"mutate-{engine}.json").write_text(json.dumps({
        "engine": engine, "seed": seed, "profile": profile, "confirm": confirm, "score": round(share, 4),
        "killed": killed, "scored": scored, "population": population, "summary": line,
        "mutants": [{**asdict(m), "id": m.id, "diff": m.diff()} for m in mutants]}, indent=2))
    return line


def main_mutate(args: Any, engine: Any) -> int:
    start = time.perf_counter()
    only = tuple(p.strip() for p in args.only.split(",") if p.strip()) if args.only else ()
    safe = engine.name.replace(":", "-").replace("/", "-")
    confirm = None if args.confirm == "none" else args.confirm
    population = len(mutants_of(engine.profile.surface, engine.profile.off_path))
    report = lambda done: write_report(done, safe, Path(args.out), seed=args.seed, profile=args.profile,  # noqa: E731
                                       confirm=args.confirm, population=population)
    mutants = run_mutants(engine, sample=args.sample, seed=args.seed, profile=args.profile, confirm=confirm,
                          only=only, seconds=args.timeout, progress=lambda text: print(text, file=sys.stderr),
                          after_each=report, resume=Path(args.resume) if args.resume else None)
    print(report(mutants) + f" in {time.perf_counter() - start:.0f}s")
    share = score(mutants)[2]
    if args.min_score is not None and share < args.min_score:
        print(f"mutation score {share:.1%} is below --min-score {args.min_score:.0%}", file=sys.stderr)
        return 1
    return 0
