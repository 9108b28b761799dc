"""Layering: spec/'s subpackages form a stack, and each module imports only from its own layer or the
layers below it (the table :data:`LAYERS`), with no import cycle between modules. Every import counts:
module-level, function-local and ``TYPE_CHECKING`` alike; there is no list of exceptions.

Imports are read with ``ast`` (no module is executed); relative imports are resolved against the importing
module's package.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SPEC = Path(__file__).resolve().parents[1] / "spec"

#: spec's layers, bottom to top: (layer, its modules' prefixes, the lower layers it may import). A module may
#: import its own layer and the layers listed; nothing above it.
LAYERS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("protocol", ("spec.protocol",), ()),
    ("truth", ("spec.truth",), ("protocol",)),
    ("cases", ("spec.cases",), ("protocol", "truth")),
    ("engines", ("spec.engines",), ("protocol", "truth", "cases")),
    ("planted", ("spec.planted",), ("protocol", "truth", "cases", "engines")),
    ("execute", ("spec.execute",), ("protocol", "truth", "cases")),
    ("invariants", ("spec.invariants",), ("protocol", "truth", "cases", "execute")),
    ("run", ("spec.run",), ("protocol", "truth", "cases", "engines", "planted", "execute", "invariants")),
    ("faces", ("spec.__main__", "spec.commands", "spec.report", "spec.fuzz", "spec.detection", "spec.docs", "spec.pytest_plugin",
               "spec.mutate", "spec.measured",
               "spec.repro"),
     ("protocol", "truth", "cases", "engines", "planted", "execute", "invariants", "run")),
)


def layer_of(module: str) -> str | None:
    for layer, prefixes, _ in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer
    return None


def module_name(path: Path) -> str:
    parts = path.relative_to(SPEC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        return [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if node.module else []
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    target = ".".join(base + ([node.module] if node.module else []))
    named = [f"{target}.{alias.name}" for alias in node.names]  # from pkg import x: x may be a module
    return [target, *named] if node.module else named


def imports(tree: ast.Module, module: str, is_package: bool, *, local: bool) -> set[str]:
    found = set()
    nodes = ast.walk(tree) if local else iter(tree.body)
    top = set(map(id, tree.body))
    for node in nodes:
        if local and id(node) in top:
            continue
        if isinstance(node, ast.ImportFrom):
            found.update(resolve(module, is_package, node))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def spec_modules() -> dict[str, tuple[ast.Module, bool]]:
    return {module_name(p): (ast.parse(p.read_text()), p.name == "__init__.py") for p in SPEC.rglob("*.py")}


def graph(*, local: bool = True) -> dict[str, set[str]]:
    """module -> the spec modules it imports (every import, function-local ones included, unless ``local``
    is False)."""
    mods = spec_modules()
    edges = {}
    for name, (tree, pkg) in mods.items():
        found = imports(tree, name, pkg, local=False) | (imports(tree, name, pkg, local=True) if local else set())
        # ``from pkg import mod`` imports pkg.mod (pkg itself is the package it sits in, not a dependency)
        found -= {t.rpartition(".")[0] for t in found if t in mods and t.rpartition(".")[0] in found
                  and t.rpartition(".")[0] in mods and name.startswith(t.rpartition(".")[0] + ".")}
        targets = set()
        for target in found:
            while target and target not in mods:  # from pkg.mod import name -> pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def violations(edges: dict[str, set[str]]) -> list[str]:
    """The imports :data:`LAYERS` does not allow, as ``module -> target (layer -> layer)``."""
    allowed = {layer: {layer, *below} for layer, _, below in LAYERS}
    bad = []
    for module, targets in sorted(edges.items()):
        here = layer_of(module)
        for target in sorted(targets):
            there = layer_of(target)
            if target == "spec" or there is None or here is None:
                continue
            if there not in allowed[here]:
                bad.append(f"{module} -> {target} ({here} may not import {there})")
    return bad


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_spec_module_has_a_layer() -> None:
    homeless = [m for m in spec_modules() if m != "spec" and layer_of(m) is None]
    assert not homeless, f"modules outside every layer of LAYERS: {homeless}"


def test_every_subpackage_says_what_it_holds() -> None:
    for init in sorted(SPEC.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc.split()) >= 20, f"{init.relative_to(SPEC.parent)} needs a docstring saying what it holds"


def test_protocol_imports_nothing_from_spec() -> None:
    edges = graph()
    leaks = {m: sorted(t for t in targets if layer_of(t) != "protocol")
             for m, targets in edges.items() if layer_of(m) == "protocol"}
    assert not any(leaks.values()), leaks


def test_imports_follow_the_layers() -> None:
    bad = violations(graph())
    assert not bad, "imports against tests/test_layering.py's LAYERS:\n" + "\n".join(bad)


def test_no_import_cycle_in_spec() -> None:
    found = cycle(graph())
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_layer_check_sees_an_upward_and_a_local_import() -> None:
    tree = ast.parse("def f():\n    from ..run.registry import load_engine\n")
    local = imports(tree, "spec.engines.x", False, local=True)
    assert "spec.run.registry" in local
    assert violations({"spec.engines.x": {"spec.run.registry"}}) == [
        "spec.engines.x -> spec.run.registry (engines may not import run)"]
    assert cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]


def test_the_registry_sits_above_every_adapter() -> None:
    edges = graph()
    adapters = {m for m in edges if layer_of(m) == "engines" and m != "spec.engines"}
    assert {"spec.engines.impl.adapter", "spec.engines.verl.adapter", "spec.engines.veomni.adapter", "spec.engines.torchtitan.adapter",
            "spec.engines.automodel.adapter", "spec.engines.megatron.adapter"} <= adapters
    assert {"spec.engines.impl.adapter", "spec.engines.verl.adapter", "spec.engines.veomni.adapter", "spec.engines.torchtitan.adapter",
            "spec.engines.automodel.adapter", "spec.engines.megatron.adapter", "spec.planted"} <= edges["spec.run.registry"]


#: keys of verl's private hand-off (its ``output_args`` and fused/flash-attention extras): the adapters map them
#: onto ``spec.protocol.InputsView``, and no invariant may read them
PRIVATE_KEYS = {"input_ids_rmpad_rolled", "temperature_rmpad", "pad_size", "shift_labels", "cu_seqlens_cpu",
                "return_dict", "labels"}
#: the checks that compare an engine's raw hand-off as whole objects (unchanged, or equal across runs), key
#: agnostic: they may touch ``run.inputs`` / ``run.output_args``
WHOLE_OBJECT = {"output_args_not_mutated", "same_run"}


def _private_reads(tree: ast.AST) -> list[str]:
    """Reads of a run's raw ``inputs`` / ``output_args`` outside :data:`WHOLE_OBJECT`, and any
    ``x["<private key>"]`` / ``x.get("<private key>")``."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or fn.name in WHOLE_OBJECT:
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and node.attr in ("inputs", "output_args"):
                found.append(f"{fn.name} line {node.lineno}: {ast.unparse(node)}")
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant):
            key = node.args[0].value
        if key in PRIVATE_KEYS and not isinstance(getattr(node, "ctx", None), ast.Store):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return sorted(set(found))


def test_invariants_read_no_engine_private_key() -> None:
    """Invariants read what an engine produced through the normalized ``InputsView`` (``run.views``), never the
    engine's own ``model_inputs`` / ``output_args`` (those only as whole objects, in :data:`WHOLE_OBJECT`)."""
    offenders = {path.name: reads for path in sorted((SPEC / "invariants").glob("*.py"))
                 if (reads := _private_reads(ast.parse(path.read_text())))}
    assert not offenders, offenders


def test_the_private_key_check_sees_a_private_read() -> None:
    bad = ast.parse('def f(ctx):\n    a = ctx.inputs_run.output_args[0]["input_ids_rmpad_rolled"]\n'
                    '    for mi in ctx.run.inputs:\n        b = mi.get("shift_labels")\n'
                    '    c = ctx.inputs_run.micro_batch["input_ids"]\n')
    reads = _private_reads(bad)
    assert len(reads) == 4 and not any("micro_batch" in r for r in reads), reads


def test_spec_readme_names_every_module_of_the_layout() -> None:
    """spec/README.md's layer table names every module of spec/ (a package by its folder) and nothing that is
    not there: the table cannot drift from the tree."""
    readme = (SPEC / "README.md").read_text()
    section = readme[readme.index("## How it fits together"):readme.index("The path of one case through it")]
    named = set(re.findall(r"`([\w/]+(?:\.py|/))`", section)) - {"tests/test_layering.py"}
    on_disk = {p.relative_to(SPEC).as_posix() for p in SPEC.rglob("*.py")
               if p.name != "__init__.py" and p.parent.name not in ("invariants", "planted", "vendored")}
    on_disk |= {"invariants/", "planted/", "repro/vendored/"}
    assert not on_disk - named, f"modules missing from spec/README.md's layer table: {sorted(on_disk - named)}"
    assert not {n for n in named if not (SPEC / n).exists()}, "spec/README.md names modules that do not exist"


#: the engine folders whose adapters build on another engine's folder: verl's other engines on verl's (the records,
#: surface and micro-batch layer they share with its FSDP engine)
BUILDS_ON = {"veomni": {"verl"}, "torchtitan": {"verl"}, "automodel": {"verl"}, "megatron": {"verl"}}


def test_an_engine_folder_imports_only_the_kit_and_itself() -> None:
    """Everything about an engine is in its folder (spec/engines/<engine>/): it imports the adapter kit
    (spec/engines/kit/, the records several engines share included) and its own modules, never another engine's
    (verl's other engines aside: :data:`BUILDS_ON`), and the kit imports no engine. Adding an engine touches its
    folder and the registry."""
    edges = graph()
    bad = []
    for module, targets in sorted(edges.items()):
        if not module.startswith("spec.engines.") or module.count(".") < 2:
            continue
        folder = module.split(".")[2]
        allowed = {folder, "kit"} | BUILDS_ON.get(folder, set()) if folder != "kit" else {"kit"}
        for target in sorted(targets):
            if target.startswith("spec.engines.") and target.split(".")[2] not in allowed:
                bad.append(f"{module} -> {target}")
    assert not bad, "an engine folder imports another engine's:\n" + "\n".join(bad)


def _exception_classes(tree: ast.Module) -> list[str]:
    """The classes ``tree`` defines (at any depth) whose bases name an exception (``...Error``, ``Exception``,
    ``BaseException``, a ``...Fault``/``...Failure`` or a class this check already found)."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
            if any(b.endswith(("Error", "Exception", "Fault", "Failure")) or b in found for b in bases):
                found.append(node.name)
    return found


def test_every_exception_of_the_suite_is_in_its_errors_module() -> None:
    """The suite's exceptions are declared in one module, spec/protocol/errors.py (the reproducers' runtimes in
    spec/repro keep their own: a reproducer runs without the suite)."""
    elsewhere = {str(p.relative_to(SPEC.parent)): names for p in sorted(SPEC.rglob("*.py"))
                 if p.relative_to(SPEC).parts[0] != "repro" and p != SPEC / "protocol" / "errors.py"
                 and (names := _exception_classes(ast.parse(p.read_text())))}
    assert not elsewhere, f"exception classes outside spec/protocol/errors.py: {elsewhere}"
    assert _exception_classes(ast.parse("class A(ValueError): pass\nclass B(A): pass\nclass C: pass\n")) == ["A", "B"]
