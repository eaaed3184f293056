"""The Python modules depend one way (docs/architecture.md, "Who owns what"): no import cycle among
attn_backends' modules, counting the imports inside functions too (a lazy import hides a cycle, it does
not remove it).  The package's __init__ (the public API) sits on top and may import anything."""

import ast
import pathlib

# the source tree beside this tests folder (not the imported package: the sanitizer run of .ci/sanitize
# imports a copy of the top-level modules only)
ROOT = pathlib.Path(__file__).resolve().parents[1] / "attn_backends"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts)


def _imports(path: pathlib.Path, modules: set) -> set:
    """The package's modules that path imports, anywhere in the file."""
    name = _module_name(path)
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".") if name else []
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
            target = ".".join(base + ([node.module] if node.module else []))
            names_from_target = False
            for alias in node.names:  # `from . import x`: x may be a module, else a name of target
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in modules:
                    out.add(sub)
                else:
                    names_from_target = True
            if names_from_target and target in modules:
                out.add(target)
    out.discard(name)
    return out


def test_no_import_cycle_among_the_modules():
    files = [p for p in ROOT.rglob("*.py") if p.name not in ("__main__.py",)]
    modules = {_module_name(p) for p in files}
    modules.discard("")  # the package itself: its __init__ is the top
    graph = {_module_name(p): _imports(p, modules) for p in files if _module_name(p)}
    assert graph["_dispatch"] >= {"_planner", "_providers"}  # the scan sees what it should
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == "open":
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m)
