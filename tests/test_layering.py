"""Layering: the protocol imports nothing from spec; spec's module-level imports form no cycle; the
function-local imports that remain are listed here, each with its reason.

Imports are read with ``ast`` (no module is executed): module-level statements only, relative
imports resolved against the importing module's package.
"""

from __future__ import annotations

import ast
from pathlib import Path

SPEC = Path(__file__).resolve().parents[1] / "spec"

#: (module, imported module) -> why the import stays inside a function
LOCAL_IMPORTS = {
    ("spec.__main__", "spec.engines"): "the CLI imports the suite per sub-command (list needs no torch run)",
    ("spec.__main__", "spec.profiles"): "per sub-command",
    ("spec.__main__", "spec.report"): "per sub-command",
    ("spec.__main__", "spec.runner"): "per sub-command",
    ("spec.__main__", "spec.invariants"): "per sub-command",
    ("spec.__main__", "torch"): "per sub-command",
    ("spec.__main__", "hypothesis"): "per sub-command",
    ("spec.pytest_plugin", "spec.engines"): "the plugin is loaded by every pytest session of the environment "
                                            "(entry point); it imports the suite only with --ioprep-engine",
    ("spec.pytest_plugin", "spec.profiles"): "same",
    ("spec.pytest_plugin", "spec.report"): "same",
    ("spec.pytest_plugin", "spec.runner"): "same",
    ("spec.verl_engine", "spec.invariants"): "_catalogue_needs: spec.invariants.core imports spec.engines (the "
                                             "registry), which imports this adapter; goes once core/harness/runner "
                                             "import spec.protocol instead",
    ("spec.verl_engine", "torch"): "_with_dense_attention_mask (verl 0.7.1 only); torch could move to the top",
    ("spec.invariants.batch", "spec.materialize"): "a second import of a module already imported at the top",
    ("spec.__main__", "spec.database"): "per sub-command (fuzz)",
    ("spec.__main__", "spec.fuzz"): "per sub-command (fuzz)",
    ("spec.database", "redis"): "optional: only a redis:// database needs the redis package",
    ("spec.database", "hypothesis.extra.redis"): "optional: imports the redis package",
    ("spec.detection", "hypothesis"): "a command-line script: its worker processes import the suite themselves",
    ("spec.detection", "spec.profiles"): "same",
    ("spec.detection", "torch"): "same",
    ("spec.rank_worker", "spec.engines"): "a rank loads its engine from the registry, which sits above the verl "
                                          "adapter that runs its ranks through this module",
    ("spec.rules", "spec.cases"): "an import under TYPE_CHECKING (annotations only)",
}
#: third-party modules an adapter imports only when built: the engine it adapts is optional
OPTIONAL = ("verl", "veomni", "torchtitan", "nemo_automodel", "megatron", "flash_attn")


def module_name(path: Path) -> str:
    parts = path.relative_to(SPEC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolve(module: str, is_package: bool, node: ast.ImportFrom) -> list[str]:
    if node.level == 0:
        return [node.module] if node.module else []
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    target = ".".join(base + ([node.module] if node.module else []))
    if node.module:
        return [target]
    return [f"{target}.{alias.name}" for alias in node.names]  # from . import x: x is a module


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


def graph() -> dict[str, set[str]]:
    mods = spec_modules()
    edges = {}
    for name, (tree, pkg) in mods.items():
        targets = set()
        for target in imports(tree, name, pkg, local=False):
            while target and target not in mods:  # from pkg.mod import name -> pkg.mod
                target = target.rpartition(".")[0]
            if target and target != name:
                targets.add(target)
        edges[name] = targets
    return edges


def test_protocol_imports_nothing_from_spec() -> None:
    tree, _ = spec_modules()["spec.protocol"]
    every = imports(tree, "spec.protocol", False, local=False) | imports(tree, "spec.protocol", False, local=True)
    assert not [m for m in every if m == "spec" or m.startswith("spec.")], every


def test_no_import_cycle_in_spec() -> None:
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)


def test_registry_is_above_the_adapters_and_the_protocol_below_all() -> None:
    edges = graph()
    assert {"spec.adapters.veomni", "spec.adapters.torchtitan", "spec.adapters.automodel", "spec.adapters.megatron",
            "spec.verl_engine", "spec.impl_engine", "spec.protocol"} <= edges["spec.engines"]
    for adapter in ("spec.adapters.veomni", "spec.adapters.torchtitan", "spec.adapters.automodel",
                    "spec.adapters.megatron", "spec.adapters.factory", "spec.impl_engine", "spec.verl_engine"):
        assert "spec.engines" not in edges[adapter], f"{adapter} imports the registry"
        assert "spec.protocol" in edges[adapter] or "spec.verl_engine" in edges[adapter] \
            or "spec.adapters.native" in edges[adapter]


def test_function_local_imports_are_the_listed_ones() -> None:
    unexplained = []
    for name, (tree, pkg) in spec_modules().items():
        for target in imports(tree, name, pkg, local=True):
            if target.split(".")[0] in OPTIONAL or target.split(".")[0] in ("impl", "tensordict", "pytest"):
                continue
            if (name, target) not in LOCAL_IMPORTS:
                unexplained.append(f"{name}: {target}")
    assert not unexplained, ("function-local imports without a reason in tests/test_layering.py's LOCAL_IMPORTS: "
                             + ", ".join(sorted(unexplained)))


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
