"""Data flows one way (DESIGN.md: config -> data + model -> algorithm x engine -> results -> report):
every comix module imports only modules of a lower layer (or of its own package), and no module
imports, directly or through others, one that imports it back (lazy imports inside functions count
too)."""
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


# Lowest first. ``data``, ``models`` and ``eval`` are peers that never import each other (the pruning
# calibration text reaches models/prune.py as an argument, from the algorithm). ``config`` sits above
# the algorithms although the run's data flow starts at it: it composes the config each layer
# declares (SplitConfig, LoRAConfig, TrainConfig, PrivacyConfig), as PEFT's model composes its
# tuners' configs. ``comix`` is the package's __init__ (the Python face, over ``api``).
LAYERS = [
    {"files", "runtime", "progress", "privacy", "aggregation", "combinations", "tracking", "tokens", "fleet", "recipes"},
    {"data", "models", "eval"},
    {"algorithms"},
    {"config"},
    {"specs"},
    {"engines"},
    {"runner", "comparison", "personal"},
    {"reporting"},
    {"api", "harness", "cli_help"},
    {"comix"},
    {"cli"},
]


def _layer_of(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else "comix"
    ranks = [i for i, layer in enumerate(LAYERS) if top in layer]
    assert ranks, f"{module}: add its package {top!r} to LAYERS"
    return top, ranks[0]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for a, targets in graph.items():
        (pa, ra) = _layer_of(a)
        for b in targets:
            (pb, rb) = _layer_of(b)
            if pa != pb and rb >= ra:
                out.append(f"{a} (layer {ra}) imports {b} (layer {rb})")
    return sorted(out)


def test_no_module_imports_a_module_of_its_own_or_a_higher_layer():
    assert _upward(_imports(_modules())) == []


def test_the_layer_check_finds_a_planted_upward_import():
    graph = _imports(_modules())
    graph["comix.models.prune"].add("comix.data.corpora")  # as pruning once read its text itself
    graph["comix.algorithms.fedavg"].add("comix.engines.device")
    assert _upward(graph) == ["comix.algorithms.fedavg (layer 2) imports comix.engines.device (layer 5)",
                              "comix.models.prune (layer 1) imports comix.data.corpora (layer 1)"]
