"""The docs' counts, tables and lists that the code can state, generated from the code.

    python -m spec.docs            rewrite every generated block in README.md, spec/README.md and docs/
    python -m spec.docs --check    exit 1 (naming the blocks) if any block differs from the code

A generated block is marked in the Markdown source::

    <!-- generated:NAME -->
    ...
    <!-- /generated -->

or inline, within a sentence: ``<!-- generated:NAME -->...<!-- /generated -->`` on one line; its text is
:data:`BLOCKS` ``[NAME]()``. ``tests/test_docs.py`` fails when a block differs from the code,
names a generator that does not exist, or a generator has no block. Measured figures (detection rates,
benchmarks) are not generated here: they carry the command that measured them; the reach figures (engine-code
coverage, mutation scores) are generated from the runs recorded in ``docs/measured/`` (:mod:`spec.measured`).
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import Callable

from . import measured
from .invariants import CATALOGUE
from .planted import PLANTED
from .run.runner import instances

__all__ = ["ROOT", "BLOCKS", "FILES", "blocks_in", "render", "stale", "main"]

ROOT = Path(__file__).resolve().parents[1]
#: the Markdown files that may hold generated blocks: the READMEs, docs/ and each engine folder's page
FILES = ("README.md", "spec/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
         *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "spec" / "engines").glob("*/README.md")))
_BLOCK = re.compile(r"(<!-- generated:([a-z0-9-]+) -->\n?)(.*?)(<!-- /generated -->)", re.S)


def _needs(info) -> str:
    """An invariant's needs as the catalogue table states them: each it needs, and "any of" those it needs one of."""
    parts = [*info.needs, *([f"any of {' / '.join(info.needs_any)}"] if info.needs_any else [])]
    return ", ".join(parts) or "-"


def catalogue() -> str:
    """The invariant catalogue table (as ``python -m spec list --markdown`` prints it)."""
    lines = ["| ID | title | contract | modes | needs | facts |", "|---|---|---:|---|---|---|"]
    for key in sorted(CATALOGUE):
        info = CATALOGUE[key]
        lines.append(f"| {info.id} | {info.title} | {info.contract} | {', '.join(info.modes)} | "
                     f"{_needs(info)} | {', '.join(info.facts) or '-'} |")
    return "\n".join(lines)


def _on_ranks(bug) -> bool:
    return any(inv.startswith("INV-RANK-") for inv in bug.caught_by)


def planted_counts() -> str:
    bugs = list(PLANTED.values())
    quiet = sum(1 for b in bugs if b.quiet)
    ranks = sum(1 for b in bugs if _on_ranks(b))
    packing = sum(1 for b in bugs if b.packer is not None)
    layout = sum(1 for b in bugs if b.layout)
    return (f"{len(bugs)} planted bugs ({quiet} of them quiet, shown only under one condition; {layout} layout "
            f"deviations; {ranks} on real ranks; {packing} in Megatron-style packing)")


def layout_invariants() -> str:
    return ", ".join(key for key in sorted(CATALOGUE) if CATALOGUE[key].layout)


def catalogue_counts() -> str:
    dense = sum(1 for info in CATALOGUE.values() if info.kind == "dense")
    return (f"{len(CATALOGUE)} invariants ({dense} of them on dense batches), "
            f"{len(instances())} invariant x mode instances per engine and device")


def dense_invariants() -> str:
    dense = [key for key in sorted(CATALOGUE) if CATALOGUE[key].kind == "dense"]
    return f"the {len(dense)} dense invariants ({', '.join(dense)})"


def cuda_instances() -> str:
    return f"the {len(instances())} CUDA instances of tests/test_invariants.py without a GPU"


def ci_steps() -> list[tuple[str, str]]:
    """(name, command) of every CI step, as .ci/steps.sh lists them: its core steps (STEPS), then every engine
    folder's step scripts (:func:`engine_ci_steps`), each run as ``bash SCRIPT``."""
    text = (ROOT / ".ci" / "steps.sh").read_text()
    body = text.split("STEPS=(", 1)[1].split("\n)", 1)[0]
    core = [(m.group(1), m.group(2).strip()) for m in re.finditer(r'^"(\S+)\s+(.*)"$', body, re.M)]
    return core + [(name, f"bash {script}") for name, script, _ in engine_ci_steps()]


#: the line of an engine's CI step script that names its step (.ci/steps.sh reads the same line)
_STEP_NAME = re.compile(r"^# CI step: ([A-Za-z0-9_.-]+)$", re.M)


def engine_ci_steps() -> list[tuple[str, str, str]]:
    """(name, script, what) of every engine folder's CI step, spec/engines/<folder>/ci*.sh in the byte order of their
    paths (.ci/steps.sh's order): the step is named by the script's line ``# CI step: NAME``, and what it checks is
    the comment paragraph right after that line."""
    steps = []
    for path in sorted(ROOT.glob("spec/engines/*/ci*.sh"), key=lambda p: p.relative_to(ROOT).as_posix().encode()):
        text = path.read_text()
        found = _STEP_NAME.search(text)
        if found is None:
            raise ValueError(f"{path.relative_to(ROOT)}: no line '# CI step: NAME'")
        what = []
        for line in text[found.end():].lstrip("\n").splitlines():
            if not line.startswith("# "):
                break
            what.append(line[2:].strip())
        steps.append((found.group(1), path.relative_to(ROOT).as_posix(), " ".join(what)))
    return steps


def _tox_pins() -> dict[str, tuple[str, str]]:
    pins: dict[str, dict[str, str]] = {}
    for env, var, value in re.findall(r"^\s+(torch\d+): SPEC_EXPECT_(TORCH|TENSORDICT) = (\S+)$",
                                      (ROOT / "tox.ini").read_text(), re.M):
        pins.setdefault(env, {})[var] = value
    return {env: (v["TORCH"], v["TENSORDICT"]) for env, v in pins.items()}


def workflow_tox_envs() -> list[str]:
    text = (ROOT / ".github" / "workflows" / "ci.yml").read_text()
    tox_job = text.split("\n  tox:", 1)[1]
    return re.search(r"env: \[([^\]]*)\]", tox_job).group(1).replace(" ", "").split(",")


#: what the core steps of .ci/steps.sh check (an engine's step says it in its script: :func:`engine_ci_steps`)
_STEP_WHAT = {
    "tests": "the README's test command (`pytest -n auto`, torch 2.13.0 CPU, a Redis server for the shared "
             "example database test)",
    "torch24": "the floor, torch 2.4.0 (CPU) with tensordict 0.8.3: impl's own tests (micro-batch layer, dense "
               "kernels and their index fallback, worked examples, errors; tests/test_environment.py checks the pins) "
               "and `spec verify --engine impl --profile dev`",
}


def advisory_steps() -> dict[str, str]:
    """name -> why, for the steps .ci/steps.sh marks advisory (run and reported, not failing CI)."""
    text = (ROOT / ".ci" / "steps.sh").read_text()
    body = text.split("ADVISORY=(", 1)[1].split("\n)", 1)[0]
    return {m.group(1): m.group(2).strip() for m in re.finditer(r'^"(\S+)\s+(.*)"$', body, re.M)}


def ci_matrix() -> str:
    """What CI runs: the steps (on the 2-core machine by .ci/run, on GitHub one job each) and the tox matrix."""
    lines = ["| CI step (`.ci/steps.sh NAME`) | where | what |", "|---|---|---|"]
    advisory = advisory_steps()
    engines = {name: f"`{script}`: {what}" for name, script, what in engine_ci_steps()}
    for name, _ in ci_steps():
        what = _STEP_WHAT.get(name) or engines.get(name, "(see .ci/steps.sh)")
        if name in advisory:
            what += f" **(advisory: run and reported, does not fail CI; {advisory[name]})**"
        lines.append(f"| `{name}` | `.ci/run`, GitHub | {what} |")
    pins = _tox_pins()
    for env in workflow_tox_envs():
        torch_v, td = pins[env]
        lines.append(f"| `tox -e {env}` | GitHub | the suite (`pytest -n auto`) on torch {torch_v}, tensordict {td} |")
    return "\n".join(lines)


def tox_envs() -> str:
    pins = _tox_pins()
    return "\n".join(["| tox env | torch | tensordict | run by CI |", "|---|---|---|---|"] + [
        f"| `{env}` | {t} | {d} | {'yes (GitHub)' if env in workflow_tox_envs() else 'no (local)'} |"
        for env, (t, d) in pins.items()])


def tests_list() -> str:
    """Every test module with the first paragraph of its docstring."""
    lines = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        lines.append(f"- `tests/{path.name}`: {first}")
    return "\n".join(lines)


BLOCKS: dict[str, Callable[[], str]] = {
    "tests-list": tests_list,
    "catalogue": catalogue,
    "catalogue-counts": catalogue_counts,
    "planted-counts": planted_counts,
    "layout-invariants": layout_invariants,
    "dense-invariants": dense_invariants,
    "cuda-instances": cuda_instances,
    "ci-matrix": ci_matrix,
    "tox-envs": tox_envs,
    "reach-figures": measured.reach_table,
    "verl-unreached": lambda: measured.unreached_table("verl"),
    **{f"{engine}-mutation-survivors": (lambda engine=engine: measured.survivors_list(engine))
       for engine in ("verl", "trl", "skyrl-train", "openrlhf", "skyrl", "verl-megatron")},
}


def blocks_in(text: str) -> list[tuple[str, str, str]]:
    """(name, opening marker, current text) of every generated block in ``text``."""
    return [(m.group(2), m.group(1), m.group(3)) for m in _BLOCK.finditer(text)]


def _wanted(opening: str, name: str) -> str:
    """A block's text as the code gives it: a block on its own lines ends with a newline, an inline one not."""
    return BLOCKS[name]() + ("\n" if opening.endswith("\n") else "")


def render(text: str) -> str:
    """``text`` with every generated block rewritten from the code (unknown names are left as they are)."""
    def one(m: re.Match) -> str:
        name = m.group(2)
        if name not in BLOCKS:
            return m.group(0)
        return f"{m.group(1)}{_wanted(m.group(1), name)}{m.group(4)}"
    return _BLOCK.sub(one, text)


def stale() -> list[str]:
    """``FILE: NAME`` for every block that differs from the code, or names no generator."""
    out = []
    for name in FILES:
        text = (ROOT / name).read_text()
        for block, opening, body in blocks_in(text):
            if block not in BLOCKS:
                out.append(f"{name}: {block} (no such generator)")
            elif body != _wanted(opening, block):
                out.append(f"{name}: {block}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="report stale blocks and exit 1; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for line in found:
            print(f"stale generated block: {line}  (python -m spec.docs rewrites it)")
        return 1 if found else 0
    for name in FILES:
        path = ROOT / name
        text = path.read_text()
        new = render(text)
        if new != text:
            path.write_text(new)
            print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
