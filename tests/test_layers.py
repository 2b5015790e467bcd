"""The architecture, checked from the code's own imports (parsed with ast, lazy ones too).

* no import cycle inside ``fp_core``, ``fp_core.tools`` or ``fp_integrations``;
* the runtime (``fp_core`` outside ``fp_core.tools``) never imports Lightning, transformers
  or the tools;
* the integrations use only the core's public modules, never the native engine or the
  core's internals (they know their framework; the core knows torch and files);
* each of the core's subpackages imports only from the layers below it (LAYERS).
"""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("fp_core", "fp_integrations")
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")
# What an integration may import from the core: the package and these modules.
CORE_PUBLIC = {"fp_core", "fp_core.api", "fp_core.pipeline.checkpointer", "fp_core.remote", "fp_core.saving.commit",
               "fp_core.saving.retention", "fp_core.parallel.distributed", "fp_core.paths", "fp_core.errors", "fp_core.stats",
               "fp_core.io.engine", "fp_core.pipeline.optim_hooks", "fp_core.saving.job", "fp_core.parallel.dcp", "fp_core.sharded",
               "fp_core.parallel.sharded_file", "fp_core.loading.checkpoint_dir"}


def _modules() -> dict[str, str]:
    """module name -> file, for every module of the packages."""
    out = {}
    for pkg in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, f), REPO)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(root, f)
    return out


def _imports(name: str, path: str, known: set[str]) -> set[str]:
    """Every module ``name`` imports (at any depth of the file), resolved to known modules
    where it names one (``from . import x`` is module x; ``from .m import f`` is module m)."""
    is_pkg = path.endswith("__init__.py")
    base = name if is_pkg else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base.split(".")
                mod = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
            out |= set(subs) if subs and len(subs) == len(node.names) else {mod} | set(subs)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods) | {"fp_core._native"}  # the compiled engine
    return {m: {i for i in _imports(m, p, known)} for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]], members: set[str]) -> list[list[str]]:
    """Import cycles among ``members`` (a package's own modules, the package itself aside:
    its __init__ importing its modules is how a package exposes them)."""
    edges = {m: {i for i in graph[m] if i in members and i != m} for m in members}
    found, state, stack = [], {}, []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(members):
        if m not in state:
            visit(m)
    return found


def test_no_import_cycle_inside_a_package():
    g = _graph()
    packages = {m for m in g if m.startswith(("fp_core", "fp_integrations")) and
                _modules()[m].endswith("__init__.py")}
    assert {"fp_core", "fp_core.pipeline", "fp_core.tools", "fp_integrations"} <= packages
    for pkg in sorted(packages):
        members = {m for m in g if m.startswith(pkg + ".") and m.count(".") == pkg.count(".") + 1
                   and m not in packages}
        assert _cycles(g, members) == [], f"import cycles in {pkg}"


def test_the_runtime_knows_neither_frameworks_nor_tools():
    g = _graph()
    for m, imports in g.items():
        if m.startswith("fp_core") and not m.startswith("fp_core.tools"):
            bad = {i for i in imports if i.split(".")[0] in FRAMEWORKS or i.startswith("fp_core.tools")}
            assert not bad, f"{m} imports {sorted(bad)}"


def test_integrations_use_only_the_cores_public_modules():
    g = _graph()
    for m, imports in g.items():
        if m.startswith("fp_integrations"):
            core = {i for i in imports if i.split(".")[0] == "fp_core"}
            assert core <= CORE_PUBLIC, f"{m} imports core internals {sorted(core - CORE_PUBLIC)}"


# The core's layers, bottom up (docs/design.md): a module imports from its own layer, the
# layers below it and the base modules, never from a layer above. The base modules import
# only each other.
BASE = {"fp_core._native", "fp_core.errors", "fp_core.stats", "fp_core.paths", "fp_core.gc_pause", "fp_core.sharded"}
LAYERS = ["fp_core.format", "fp_core.io", "fp_core.saving", "fp_core.loading", "fp_core.parallel", "fp_core.remote",
          "fp_core.api", "fp_core.pipeline", "fp_core.tools"]


def _layer(m: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if m == layer or m.startswith(layer + "."):
            return i
    return None


def _layer_violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, imports in sorted(g.items()):
        if not m.startswith("fp_core."):
            continue  # the package itself exposes the public API of every layer
        for i in sorted(imports):
            if not i.startswith("fp_core") or i == m:
                continue
            if m in BASE:
                ok = i in BASE
            else:
                lm, li = _layer(m), _layer(i)
                ok = i in BASE or (lm is not None and li is not None and li <= lm) or (i == "fp_core" and
                                                                                         m.startswith("fp_core.tools"))
            if not ok:
                bad.append(f"{m} -> {i}")
    return bad


def test_every_core_module_is_in_a_layer():
    g = _graph()
    loose = [m for m in g if m.startswith("fp_core.") and m not in BASE and _layer(m) is None]
    assert not loose, f"modules in no layer of LAYERS or BASE: {loose}"


def test_each_layer_imports_only_the_layers_below_it():
    assert _layer_violations(_graph()) == []


def test_the_checker_sees_what_it_checks():
    """The rules above would pass vacuously if the parser found no imports."""
    g = _graph()
    assert "fp_core.saving.local" in g["fp_core.api"] and "fp_core.remote" in g["fp_core.api"]  # a lazy import counts
    assert "fp_core._native" in g["fp_core.io.writer"]
    assert "lightning" in {i.split(".")[0] for i in g["fp_integrations.lightning_io"]}
    assert _cycles({"a": {"b"}, "b": {"a"}}, {"a", "b"}) == [["a", "b", "a"]]
    assert _layer_violations({"fp_core.format.plan": {"fp_core.saving.commit"},
                              "fp_core.errors": {"fp_core.format.plan"}}) == [
        "fp_core.errors -> fp_core.format.plan", "fp_core.format.plan -> fp_core.saving.commit"]


def test_the_package_lists_every_subpackage():
    """A wheel holds only the packages pyproject.toml names: a new subpackage must be there."""
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {m for m, p in _modules().items() if p.endswith("__init__.py")}
    assert listed == found
