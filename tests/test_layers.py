"""Data flows one way (DESIGN.md): no comix module imports, directly or through others, a module
that imports it back (lazy imports inside functions count too)."""
import ast
import pathlib

ROOT = pathlib.Path(__file__).parents[1] / "comix"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        name = ".".join(("comix", *f.relative_to(ROOT).with_suffix("").parts))
        out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = f
    return out


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    graph = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + [node.module or ""]).strip(".") \
                    if node.level else (node.module or "")
                targets = [f"{base}.{a.name}" for a in node.names] + [base]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != m:  # a submodule importing its own package counts too: the package's
                    graph[m].add(t)  # __init__ runs, and with it everything that __init__ imports
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back():
    graph = _imports(_modules())
    assert graph["comix.engines.flower.client_app"] >= {"comix.specs"}  # the graph sees real imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = _imports(_modules())
    graph["comix.specs"].add("comix.engines.flower.client_app")  # as if specs imported the Flower app
    assert ["comix.engines.flower.client_app", "comix.specs"] in _cycles(graph)
