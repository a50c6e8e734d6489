"""The package's structure, checked on its source (AST only: nothing is imported, so this runs in a second).

- no module imports another module's underscored (private) names;
- no import cycle between onnxgen's modules, imports inside functions included (those under
  ``if TYPE_CHECKING:`` are left out: they never run);
- no function over 60 lines in ``runtime/``, ``engine/`` and ``generation/``;
- no attribute annotated ``object`` standing in for a real type;
- ``graph/`` (the graph passes and analyses) imports nothing of onnxgen but ``graph/``, ``model/`` and
  ``errors``: the layers above it (runtime, engine, front ends) use it, never the other way.

What breaks a rule today is listed in an allowlist below, each entry with its reason. The lists may only
shrink: an entry that no longer breaks its rule fails the test until it is removed, and a new breach fails
it until it is fixed.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "onnxgen"
MAX_FUNCTION_LINES = 60
SHORT_FUNCTION_DIRS = ("runtime", "engine", "generation")
# what a layer's modules may import of onnxgen: layer -> the packages and modules below it
LAYER_IMPORTS = {"onnxgen.graph": ("onnxgen.graph", "onnxgen.model", "onnxgen.errors")}

# module imports a private name: (importing module, imported module, name) -> reason
PRIVATE_IMPORTS: dict[tuple[str, str, str], str] = {}

# import cycles (the modules of one strongly connected component, sorted) -> reason
CYCLES: dict[tuple[str, ...], str] = {}

# functions over MAX_FUNCTION_LINES: "module:qualified.name" -> reason
LONG_FUNCTIONS: dict[str, str] = {}

# attributes annotated ``object``: "module:Class.attribute" -> reason
OBJECT_ATTRIBUTES: dict[str, str] = {}


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def type_checking_blocks(tree: ast.Module) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return out


def absolute(module: str, node: ast.ImportFrom) -> str:
    """The module an ``ImportFrom`` names, relative imports resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base[: len(base) - node.level + (1 if is_package(module) else 0)]
    return ".".join([*base, *([node.module] if node.module else [])])


@functools.cache
def imports(module: str) -> list[tuple[str, str | None]]:
    """(imported onnxgen module, name imported from it or None) of every import that runs."""
    return list(_imports(module))


def _imports(module: str) -> Iterator[tuple[str, str | None]]:
    tree = TREES[module]
    skip = type_checking_blocks(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("onnxgen"):
                    yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            source = absolute(module, node)
            if not source.startswith("onnxgen"):
                continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield (sub, None) if sub in MODULES else (source, alias.name)


def private_imports() -> dict[tuple[str, str, str], int]:
    found = {}
    for module in MODULES:
        for source, name in imports(module):
            if name and name.startswith("_") and not name.startswith("__") and source != module:
                found[(module, source, name)] = 1
    return found


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module in MODULES:
        for source, _ in imports(module):
            target = source
            while target not in MODULES and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in MODULES and target != module:
                graph[module].add(target)
                # importing a.b.c runs a and a.b first
                parent = target
                while "." in parent:
                    parent = parent.rsplit(".", 1)[0]
                    if parent in MODULES and parent != module and not module.startswith(parent + "."):
                        graph[module].add(parent)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[tuple[str, ...]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(tuple(sorted(component)))
    return out


def functions(
    tree: ast.AST, prefix: str = ""
) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, node
            yield from functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def long_functions() -> dict[str, int]:
    found = {}
    for module, tree in TREES.items():
        if module.split(".")[1:2] and module.split(".")[1] in SHORT_FUNCTION_DIRS:
            for name, node in functions(tree):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = (node.end_lineno or node.lineno) - first + 1
                if length > MAX_FUNCTION_LINES:
                    found[f"{module}:{name}"] = length
    return found


def is_object(annotation: ast.expr) -> bool:
    """Whether ``object`` stands anywhere in the annotation (``object``, ``object | None``,
    ``dict[str, object]``, ...), a string annotation included."""
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(isinstance(n, ast.Name) and n.id == "object" for n in ast.walk(annotation))


def object_attributes() -> dict[str, int]:
    found = {}
    for module, tree in TREES.items():
        for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for node in ast.walk(cls):
                if not isinstance(node, ast.AnnAssign) or not is_object(node.annotation):
                    continue
                target = node.target
                if isinstance(target, ast.Attribute):  # self.x: object = ...
                    found[f"{module}:{cls.name}.{target.attr}"] = node.lineno
                elif isinstance(target, ast.Name) and node in cls.body:  # x: object (a field)
                    found[f"{module}:{cls.name}.{target.id}"] = node.lineno
    return found


def layer_breaches(layer: str, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    """The onnxgen imports of ``layer``'s modules (``TYPE_CHECKING`` ones included) outside ``allowed``."""
    found: dict[str, list[str]] = {}
    for module, tree in TREES.items():
        if module != layer and not module.startswith(layer + "."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [absolute(module, node)]
            else:
                continue
            for name in names:
                inside = any(name == a or name.startswith(a + ".") for a in allowed)
                if name.startswith("onnxgen") and not inside:
                    found.setdefault(module, []).append(name)
    return found


def check(kind: str, found: dict, allowed: dict) -> None:  # type: ignore[type-arg]
    new = sorted(set(found) - set(allowed))
    fixed = sorted(set(allowed) - set(found))
    assert not new, f"new {kind} (fix them; the allowlist only shrinks): {new}"
    assert not fixed, f"{kind} no longer found: remove them from the allowlist: {fixed}"


def test_the_checks_see_the_package() -> None:
    assert "onnxgen.engine.scheduler" in MODULES and "onnxgen" in MODULES
    graph = import_graph()
    assert "onnxgen.engine.sequence" in graph["onnxgen.engine.scheduler"]
    assert ("a", "b") in [tuple(sorted(c)) for c in cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}})]


def test_no_module_imports_another_modules_private_names() -> None:
    check("private imports", private_imports(), PRIVATE_IMPORTS)


def test_no_import_cycles_between_modules() -> None:
    found = {component: 1 for component in cycles(import_graph())}
    check("import cycles", found, CYCLES)


def test_no_long_functions_in_the_runtime_engine_and_generation() -> None:
    check(f"functions over {MAX_FUNCTION_LINES} lines", long_functions(), LONG_FUNCTIONS)


def test_no_attribute_is_typed_object() -> None:
    check("object-typed attributes", object_attributes(), OBJECT_ATTRIBUTES)


def test_the_graph_layer_imports_nothing_above_it() -> None:
    for layer, allowed in LAYER_IMPORTS.items():
        assert layer_breaches(layer, allowed) == {}, f"{layer} imports a layer above it"
    # the check sees the imports it rules on: without model/, the passes that read weights break it
    assert "onnxgen.graph.decode_fusions" in layer_breaches("onnxgen.graph", ("onnxgen.graph",))
