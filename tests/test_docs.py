"""Docs that cannot drift: every generated block equals what the code gives, and the contract is in the repository.

* Every ``<!-- generated:NAME -->`` block in README.md, spec/README.md, docs/ and spec/engines/<engine>/README.md equals ``spec.docs.BLOCKS[NAME]()``
  (``python -m spec.docs`` rewrites them), names a generator that exists, and every generator has a block.
* docs/contract.md is the contract every doc links to: each invariant's ``contract=`` number is a numbered
  clause there; no doc, invariant or module points to a contract outside the repository or to a build
  machine's absolute path.
* No hand-written test-suite pass/skip counts in the docs.
* Every Markdown link, repository path and ``spec.xxx``/``impl.xxx`` name in README.md, spec/README.md, docs/ and the engine pages
  exists (a link's ``#anchor`` is a heading of the linked page); no bare "issue N" pointing at a tracker the
  repository does not hold (an upstream project's "issue #N" is named with its number sign).
* docs/findings/: the README (linked from README.md) has one table row per finding page, each linking a page that
  exists; every page links a reproducer under docs/findings/repro/ that exists and states the affected versions,
  severity and upstream status; every reproducer is named by a page and imports nothing of this suite.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from spec import docs
from spec.invariants import CATALOGUE

CONTRACT = docs.ROOT / "docs" / "contract.md"


def _read(name: str) -> str:
    return (docs.ROOT / name).read_text()


def test_every_generated_block_matches_the_code() -> None:
    stale = docs.stale()
    assert not stale, f"generated blocks differ from the code (run `python -m spec.docs`): {stale}"


def test_every_generator_has_a_block_and_rendering_is_stable() -> None:
    used = {name for f in docs.FILES for name, _, _ in docs.blocks_in(_read(f))}
    assert used == set(docs.BLOCKS), f"generators without a block: {sorted(set(docs.BLOCKS) - used)}"
    for f in docs.FILES:
        once = docs.render(_read(f))
        assert docs.render(once) == once, f


def test_a_changed_count_is_caught() -> None:
    """The check is live: a block whose number is off by one is reported."""
    text = _read("README.md")
    body = docs.BLOCKS["planted-counts"]()
    n = int(body.split()[0])
    wrong = text.replace(body, body.replace(str(n), str(n - 1), 1), 1)
    assert wrong != text and docs.render(wrong) == text


def _clauses() -> set[int]:
    text = CONTRACT.read_text()
    section = text.split("## Invariants the suite must hold", 1)[1].split("\n## ", 1)[0]
    return {int(m.group(1)) for m in re.finditer(r"^(\d+)\. ", section, re.M)}


def test_every_contract_number_is_a_clause_of_docs_contract_md() -> None:
    clauses = _clauses()
    assert clauses == set(range(1, max(clauses) + 1)), f"clauses are not numbered 1..n: {sorted(clauses)}"
    missing = {info.id: info.contract for info in CATALOGUE.values() if info.contract not in clauses}
    assert not missing, f"contract= numbers that are no clause of docs/contract.md: {missing}"


def test_the_contract_has_the_micro_batch_layer() -> None:
    assert "## Micro-batch layer" in CONTRACT.read_text() and "Placeholder" not in CONTRACT.read_text()


def _sources() -> list:
    root = docs.ROOT
    paths = [root / f for f in docs.FILES] + [root / "bench" / "README.md"]
    paths += [p for d in ("spec", "impl", "tests", "bench", "mutation") for p in (root / d).rglob("*.py")]
    return [p for p in paths if p.exists()]


@pytest.mark.parametrize("pattern", [r"shared/CONTRACT\.md", r"(?<![\w.])CONTRACT\.md", r"/work/"])
def test_no_doc_or_module_points_outside_the_repository(pattern: str) -> None:
    this = docs.ROOT / "tests" / "test_docs.py"
    hits = [f"{p.relative_to(docs.ROOT)}:{i}" for p in _sources() if p != this
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(pattern, line)]
    assert not hits, f"{pattern!r} in {hits}: link docs/contract.md (or a path in the repository) instead"


def test_no_hand_written_test_counts() -> None:
    """Pass/skip counts of a test run go stale with every new test: generate them or leave them out."""
    count = re.compile(r"\b\d+ (passed|skipped)\b")
    hits = [f"{f}:{i}: {line.strip()[:80]}" for f in docs.FILES
            for i, line in enumerate(_read(f).splitlines(), 1) if count.search(line) and "pytest" in line.lower()]
    hits += [f"{f}:{i}" for f in ("README.md",) for i, line in enumerate(_read(f).splitlines(), 1)
             if count.search(line)]
    assert not hits, hits


def test_the_planted_table_names_the_invariants_that_claim_each_bug() -> None:
    """spec/README.md's planted-bug table: its counterexamples are measured (``spec verify --engine planted:...``),
    but its "rejected by" column is the registry's ``caught_by`` and must stay so."""
    from spec.planted import PLANTED

    section = _read("spec/README.md").split("## Planted bugs and their shrunk counterexamples", 1)[1].split("\n## ")[0]
    rows = {m.group(1): m.group(2) for line in section.splitlines()
            if (m := re.match(r"^\| `([a-z0-9_]+)` \| .*? \| ((?:INV-[A-Z]+-\d{3}(?:, )?)+) \| ", line))}
    assert rows and set(rows) <= set(PLANTED), sorted(set(rows) - set(PLANTED))
    wrong = {name: (listed, ", ".join(PLANTED[name].caught_by)) for name, listed in rows.items()
             if listed != ", ".join(PLANTED[name].caught_by)}
    assert not wrong, f"rejected-by column differs from caught_by: {wrong}"


FINDINGS = docs.ROOT / "docs" / "findings"


def _finding_pages() -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(FINDINGS.glob("F[0-9][0-9]-*.md"))}


def test_the_findings_table_lists_every_finding_page() -> None:
    table = (FINDINGS / "README.md").read_text()
    linked = re.findall(r"^\| \[(F\d\d)\]\((F\d\d-[\w.-]+\.md)\) \|", table, re.M)
    pages = _finding_pages()
    assert pages and [name for _, name in linked] == sorted(pages), (linked, sorted(pages))
    assert all(name.startswith(fid + "-") for fid, name in linked), linked
    assert "TODO" not in table
    assert "docs/findings/README.md" in _read("README.md")


def test_every_finding_page_names_a_reproducer_that_exists() -> None:
    repro = FINDINGS / "repro"
    named: set[str] = set()
    for name, text in _finding_pages().items():
        files = set(re.findall(r"\]\(repro/([\w.-]+\.py)\)", text))
        assert files, f"{name} links no reproducer under repro/"
        assert all((repro / f).is_file() for f in files), (name, files)
        for field in ("affected versions", "severity (consumer's side)", "upstream"):
            assert f"| {field} |" in text, f"{name} has no '{field}' row"
        named |= files
    on_disk = {p.name for p in repro.glob("*.py")}
    assert on_disk <= named, f"reproducers no page names: {sorted(on_disk - named)}"


def test_the_reproducers_import_nothing_of_this_suite() -> None:
    imports = re.compile(r"^\s*(from|import)\s+(spec|impl)(\.|\s|$)", re.M)
    hits = [p.name for p in (FINDINGS / "repro").rglob("*.py") if imports.search(p.read_text())]
    assert not hits, hits


# -- every path, link and module name in the docs exists ----------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
#: a path inside the repository: one of its top-level folders, then a path (a placeholder such as <engine> is none)
_PATH = re.compile(r"(?<![\w./<>-])((?:spec|impl|tests|docs|bench|mutation|\.ci|\.github)/[\w./*-]*)")
_MODULE = re.compile(r"(?<![\w./-])((?:spec|impl)(?:\.[A-Za-z_]\w*)+)")
_URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@functools.cache
def _anchors(path: Path) -> frozenset[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+?)\s*#*$", text, re.M):
        slug = _slug(heading)
        anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return frozenset(anchors)


@functools.cache
def _top_level_names(source: Path) -> frozenset[str]:
    """Every name a module binds at its top level (definitions, assignments, imports, also under if/try)."""
    names = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.col_offset == 0:
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.col_offset == 0:
            names.add(node.id)
        elif isinstance(node, ast.alias):
            names.add((node.asname or node.name).split(".")[0])
    for node in ast.parse(source.read_text()).body:  # top-level statements indented by nothing but if/try
        for sub in ast.walk(node):
            if isinstance(sub, (ast.Assign, ast.AnnAssign)):
                for target in (sub.targets if isinstance(sub, ast.Assign) else [sub.target]):
                    names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
            elif isinstance(sub, (ast.FunctionDef, ast.ClassDef)):
                names.add(sub.name)
    return frozenset(names)


def _module_missing(dotted: str, root: Path) -> bool:
    """Whether ``spec.a.b[.attr]`` names nothing: its longest module prefix is a file or package of the tree and the
    next part (if any) a submodule or a name bound at the module's top level. A mutant's name (mutmut's
    ``x_name__mutmut_N``, docs/mutation.md) is no attribute."""
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:k])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            break
    else:
        return True
    if k == len(parts) or "__mutmut_" in parts[k]:
        return False
    return parts[k] not in _top_level_names(source)


def dangling(doc: str, text: str, root: Path = docs.ROOT) -> list[str]:
    """``doc:line: what`` for every link, repository path and module name in ``text`` (the Markdown file ``doc``,
    relative to ``root``) that names nothing in the repository."""
    base = (root / doc).parent
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for target in _LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            where = (base / path) if path else root / doc
            if not where.exists():
                found.append(f"{doc}:{n}: link {target} (no such file)")
            elif anchor and where.suffix == ".md" and anchor not in _anchors(where.resolve()):
                found.append(f"{doc}:{n}: link {target} (no such heading)")
        bare = re.sub(r"\]\([^)\s]+\)", "]", _URL.sub("", line))  # link targets checked above
        for path in _PATH.findall(bare):
            path = path.rstrip(".")
            exists = any(root.glob(path)) if "*" in path else (root / path).exists() or (base / path).exists()
            if not exists:
                found.append(f"{doc}:{n}: path {path}")
        found += [f"{doc}:{n}: module {name}" for name in _MODULE.findall(bare) if _module_missing(name, root)]
    return found


def test_every_path_link_and_module_name_in_the_docs_exists() -> None:
    hits = [hit for f in docs.FILES for hit in dangling(f, _read(f))]
    assert not hits, "\n".join(hits)


def test_the_path_check_sees_what_is_missing() -> None:
    text = ("See [the contract](docs/contract.md), [gone](docs/contract-microbatch.md), "
            "[a heading](docs/contract.md#no-such-heading), `spec/microbatch_layer.py`, `spec/run/registry.py`,\n"
            "`spec.run.registry.load_engine`, `spec.run.registry.no_such_name`, spec.nothing_here and "
            "https://github.com/x/spec/nothing.py")
    hits = dangling("README.md", text)
    assert hits == ["README.md:1: link docs/contract-microbatch.md (no such file)",
                    "README.md:1: link docs/contract.md#no-such-heading (no such heading)",
                    "README.md:1: path spec/microbatch_layer.py",
                    "README.md:2: module spec.run.registry.no_such_name",
                    "README.md:2: module spec.nothing_here"], hits


def test_no_bare_issue_numbers() -> None:
    """"issue 23" points to a tracker the repository does not hold: say what it was about instead. An upstream
    project's issue is written with its number sign (verl issue #6278)."""
    bare = re.compile(r"\b[Ii]ssues? \d+")
    hits = [f"{f}:{i}: {line.strip()[:80]}" for f in docs.FILES
            for i, line in enumerate(_read(f).splitlines(), 1) if bare.search(line)]
    assert not hits, hits


def test_every_engine_has_its_page_in_its_folder() -> None:
    """An engine's page lives beside its adapter (spec/engines/<folder>/README.md), names each engine of the folder
    and is one of the files whose links and generated blocks are checked here; no engine page is left in docs/."""
    from spec.run.registry import ENGINES

    root = Path(__file__).resolve().parents[1]
    for name, entry in ENGINES.items():
        if name == "impl":  # this project's own engine: README.md and docs/contract.md are its pages
            continue
        page = Path("spec", "engines", entry[0].__module__.split(".")[2], "README.md")
        assert (root / page).is_file(), f"engine {name} has no page {page}"
        assert str(page) in docs.FILES and name in _read(str(page)), (name, page)
    assert not (root / "docs" / "engines").exists()
