"""Writes a standalone reproducer for each failed outcome, and runs it once to say whether it reproduces.

``reports/<engine>/repro/<INV-ID>-<mode>.py``: the shrunk case's micro-batch (inline, or a ``.pt`` beside the
file when large), the engine built and called as its adapter does (:meth:`EngineUnderTest.repro_snippet`), the
suite's stand-in model and hand-off written out, a float64 reference, and the invariant's checks
(:mod:`.plans`). It exits 1 printing got vs expected at the first wrong position, 0 when correct. An invariant
without a plan, or an engine without a snippet for the case's settings, gets a file that says what it
cannot reproduce standalone and exits 2.
"""

from __future__ import annotations

import contextlib
import io
import pprint
import re
import runpy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cases.microbatch import MiniBatchCase
from ..cases.dropin import DropinCase
from ..cases.structure import DenseCase, EngineCase
from ..engines.impl.adapter import ImplEngine
from ..execute.handoff import _settings
from ..execute.pickling import save
from ..invariants import CATALOGUE
from ..protocol.engine import EngineUnderTest, ReproSnippet
from .micro_batch import INLINE_LIMIT, batch_data, case_data, declarations, declared_precision
from .dense import write_dense_reproducer
from .dp_layer import DP_CHECKS, write_dp_reproducer
from .end_to_end import END_TO_END, layer_bug_only, write_end_to_end_reproducer
from .engine_source import planted_engine_snippet
from .minibatch import write_minibatch_reproducer
from .packing import packer_requires, write_packing_reproducer
from .carry import carried
from .plans import Plan, plan_for, rank_plan_for
from .ranks import on_real_ranks
from ..protocol.vendor import assignments, source
from .vendored import engine_case_main, not_standalone
from .templates import DISTRIBUTION, LOADER, PREAMBLE, SHARE, engine_block, write_beside

__all__ = ["Reproducer", "write_reproducer", "write_reproducers", "run_reproducer", "safe_name"]


#: why a family has no standalone reproducer, by invariant ID prefix (none today: every family has one)
WHY_NOT: dict[str, str] = {}


@dataclass
class Reproducer:
    invariant: str
    mode: str
    path: Path
    #: "reproduces" (exit 1), "passes" (exit 0: the failure does not show standalone), "not standalone" (no
    #: plan or no snippet: exit 2), "error" (the file itself failed)
    status: str
    detail: str = ""
    standalone: bool = True  # imports nothing of the suite
    known: bool = False  # written for a known failure (the verdict excused it)

    def as_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "mode": self.mode, "path": str(self.path), "status": self.status,
                "detail": self.detail, "standalone": self.standalone, "known": self.known}


def safe_name(engine: str) -> str:
    return engine.replace(":", "-").replace("/", "-")


def _settings_of(case: EngineCase) -> dict[str, Any]:
    """The engine settings of ``case`` (rank 0's, without the all-gather seam), as the harness passes them."""
    settings = {k: v for k, v in _settings(case.with_(sp_size=1), 0, None).items()}
    settings["sp_size"] = case.sp_size
    return settings


def needs(snippet: ReproSnippet | None) -> list[str]:
    """What to ``pip install`` for a file whose engine block is ``snippet``: installable names (the suite's and
    impl's packages named by their distribution, ``rl-ioprep``; a remark in parentheses dropped), then torch and
    tensordict."""
    requires = re.sub(r"\([^)]*\)", " ", snippet.requires if snippet else "").split()
    names = [DISTRIBUTION if name in ("spec", "impl") else name for name in requires]
    if snippet is not None and not snippet.standalone:
        names.append(DISTRIBUTION)
    return list(dict.fromkeys(names + ["torch", "tensordict"]))


def _header(invariant: str, mode: str, engine: str, title: str, case: Any, error: str | None,
            snippet: ReproSnippet | None) -> str:
    lines = [f"Reproducer: {invariant} ({mode}) on engine {engine}.", "", title, "",
             f"Shrunk case: {case!r}", f"What the suite saw: {error or '?'}", "",
             f"Needs: pip install {' '.join(needs(snippet))}" + ("" if snippet is None or snippet.standalone else
                                  "  (and this suite: the engine has no standalone snippet, its adapter is imported)"),
             "Exit 1: the engine is wrong on this case (got vs expected printed); 0: it is right; 2: not reproducible "
             "standalone.", "Written by `python -m spec verify` (spec/repro/); edit freely."]
    return '"""' + "\n".join(line.replace('"""', "'''").replace("\\", "\\\\") for line in lines) + '\n"""\n'


def _unsupported(header: str, why: str) -> str:
    return "\n".join([header, assignments({"WHY": why}), source(not_standalone)])


def write_reproducer(path: Path, *, invariant: str, mode: str, engine: EngineUnderTest, case: Any,
                     title: str = "", error: str | None = None) -> tuple[Path, str | None]:
    """Write the reproducer of ``invariant``'s failure on ``case``; returns ``(path, why not standalone)``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    plan = plan_for(invariant)
    # a planted engine whose bug is its engine class or a helper is written out with impl (neither imported);
    # else the engine's snippet, a real engine's adapter carried as source
    snippet = ((planted_engine_snippet(engine) or _snippet(engine, _settings_of(case)))
               if isinstance(case, EngineCase) else None)
    header = _header(invariant, mode, engine.name, title, case, error, snippet)
    why = None
    if isinstance(case, MiniBatchCase):  # the micro-batch layer's own functions, on the saved mini-batch
        layer = engine.microbatch_layer()
        write = write_dp_reproducer if invariant in DP_CHECKS else write_minibatch_reproducer
        maker = getattr(getattr(engine, "bug", None), "microbatch", None)  # a planted bug over impl's layer
        factory = (maker, ImplEngine.microbatch_layer(engine)) if maker and isinstance(engine, ImplEngine) else None
        functions = dict(layer.functions) if layer else {}
        if invariant == END_TO_END:  # and the engine on every micro-batch
            # a bug planted in the layer alone runs impl's own engine (written out as impl's snippet)
            built = ImplEngine() if layer_bug_only(engine) else engine
            snippet = planted_engine_snippet(built) or _snippet(built, _settings_of(case.engine_case()))
            header = _header(invariant, mode, engine.name, title, case, error, snippet)
            why = write_end_to_end_reproducer(path, header, engine, snippet, functions, case, factory)
        else:
            why = write(path, header, invariant, functions, case, factory)
        if why:
            path.write_text(_unsupported(header, why))
        return path, why
    if invariant.startswith("INV-MEG-"):  # the engine's packer, over every TP x CP x layout
        requires = packer_requires(engine)
        header = _header(invariant, mode, engine.name, title, case, error, ReproSnippet("", requires) if requires
                         else None)
        why = write_packing_reproducer(path, header, invariant, CATALOGUE[invariant].check, engine, case)
        if why:
            path.write_text(_unsupported(header, why))
        return path, why
    if isinstance(case, (DenseCase, DropinCase)):  # the engine's padding helpers on a dense batch
        why = write_dense_reproducer(path, header, invariant, CATALOGUE[invariant].check, engine, case)
        if why:
            path.write_text(_unsupported(header, why))
        return path, why
    if not isinstance(case, EngineCase):
        why = f"{invariant} checks {type(case).__name__ if case is not None else 'no case'}; only engine cases are written out"
    elif rank_plan_for(invariant) is not None or (plan is not None and snippet is None and case.sp_size > 1):
        # real ranks: the engine-case file, its main on gloo ranks it starts (an engine whose sequence parallelism
        # needs a process group, verl's, has a snippet for them; a planted engine is written out over impl)
        ranked = planted_engine_snippet(engine) or _snippet(engine, {**_settings_of(case), "real_ranks": True})
        if ranked is None:
            why = f"engine {engine.name} cannot be built standalone for settings {_settings_of(case)}"
        else:
            checks = rank_plan_for(invariant) or plan
            header = _header(invariant, mode, engine.name, title, case, error, ranked)
            path.write_text(on_real_ranks(_source(header, invariant, checks, ranked, case, path, engine, last=False), case))
            return path, None
    elif plan is None:
        why = (f"{invariant} has no standalone check (no `repro=` record where it is registered)"
               + next((f" ({text})" for prefix, text in WHY_NOT.items() if invariant.startswith(prefix)), "")
               + f"; rerun it with `python -m spec verify --engine {engine.name} --only {invariant}`")
    elif snippet is None:
        why = f"engine {engine.name} cannot be built standalone for settings {_settings_of(case)}"
    if why:
        path.write_text(_unsupported(header, why))
        return path, why
    path.write_text(_source(header, invariant, plan, snippet, case, path, engine))
    return path, None


def _snippet(engine: EngineUnderTest, settings: dict[str, Any]) -> ReproSnippet | None:
    """The engine's snippet; a real engine's adapter imported by the default snippet is carried as source instead
    (:mod:`.carry`), so that the file needs only the engine's package."""
    snippet = engine.repro_snippet(settings)
    return (carried(snippet) or snippet) if snippet is not None else None


def _source(header: str, invariant: str, plan: Plan, snippet: ReproSnippet, case: EngineCase, path: Path,
            engine: EngineUnderTest, last: bool = True) -> str:
    """The engine-case file: header, preamble, loader, engine block, the case's runs, the share; and (``last``) its
    main's call (else what the real-rank reproducer adds ends it: :func:`.ranks.on_real_ranks`)."""
    runs, heavy = [], {}
    for label, variant in plan.runs(case):
        data, tensors, elements = batch_data(variant)
        inline = elements <= INLINE_LIMIT
        values = {k: v.tolist() for k, v in tensors.items()} if inline else None
        if not inline:
            heavy[label] = tensors
        runs.append({"label": label, "case": {**case_data(variant), "precision": declared_precision(engine, variant)},
                     "data": data, "values": values})
    pt = path.with_suffix(".pt")
    if heavy:
        save(heavy, pt)
    elif pt.exists():
        pt.unlink()
    write_beside(path.parent)
    return "\n".join([
        header, PREAMBLE, LOADER, engine_block(snippet),
        f"INVARIANT = {invariant!r}", f"CHECK_NAMES = {list(plan.checks)!r}", f"POISON = {plan.poison!r}",
        f"KEYS = {list(plan.keys)!r}  # the outputs the invariant asserts, the only ones compared (none: every one)",
        declarations(engine, case),
        "DATA = Path(__file__).with_suffix('.pt')  # the runs' tensors above 4,096 elements",
        "RUNS = " + pprint.pformat(runs, width=120, sort_dicts=False), "",
        SHARE, "", "", *([source(engine_case_main)] if last else [])])


def run_reproducer(path: Path) -> tuple[int, str]:
    """Run a written reproducer in this process (torch and the engine are imported already): its exit code and
    what it printed."""
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except Exception as exc:  # noqa: BLE001 - a broken reproducer is reported, not raised
            print(f"reproducer error: {type(exc).__name__}: {exc}")
            code = 3
    return code, out.getvalue().strip()


def _targets(outcomes: list[Any], known: bool) -> list[tuple[Any, str, Any, str | None, str]]:
    """(outcome, file stem, case, what the suite saw, label) for every failed outcome, and with ``known`` for the
    first case each known-failure record excused (a known failure is a failure too: it gets its reproducer)."""
    out = []
    for o in outcomes:
        if o.status == "fail":
            out.append((o, f"{o.invariant}-{o.mode}", getattr(o, "case", None), o.error, ""))
        if known:
            for n, (key, (case, message)) in enumerate(sorted(getattr(o, "known_cases", {}).items(),
                                                              key=lambda kv: kv[0])):
                out.append((o, f"{o.invariant}-{o.mode}-known{n + 1 if n else ''}", case, message,
                            f"known failure {key}"))
    return out


def write_reproducers(outcomes: list[Any], engine: EngineUnderTest, folder: Path, *,
                      titles: dict[str, str] | None = None, check: bool = True,
                      known: bool = False) -> list[Reproducer]:
    """A reproducer for every failed outcome (status ``fail``) with its shrunk case, and with ``known`` one per
    known-failure record that fired (its first excused case, not shrunk); each run once when ``check`` to record
    whether it reproduces standalone."""
    made = []
    for o, stem, case, error, label in _targets(outcomes, known):
        path = folder / f"{stem}.py"
        title = (titles or {}).get(o.invariant, "") + (f" [{label}]" if label else "")
        path, why = write_reproducer(path, invariant=o.invariant, mode=o.mode, engine=engine, case=case,
                                     title=title, error=error)
        snippet_standalone = "(and this suite" not in path.read_text()
        if why:
            made.append(Reproducer(o.invariant, o.mode, path, "not standalone", why, snippet_standalone, bool(label)))
            continue
        if not check:
            made.append(Reproducer(o.invariant, o.mode, path, "written", "", snippet_standalone, bool(label)))
            continue
        code, printed = run_reproducer(path)
        status = {1: "reproduces", 0: "passes"}.get(code, "error")
        last = printed.splitlines()[-1] if printed else ""
        made.append(Reproducer(o.invariant, o.mode, path, status, last, snippet_standalone, bool(label)))
    return made
