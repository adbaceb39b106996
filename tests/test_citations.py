"""Code, tests and docs cite the paper, the authors' file or a doc page, never a work item of the
tracker (the word "issue" and a letter): a later reader has no tracker. And no package file grows past 400 lines: a
file that long holds more than one thing (split by what the parts do)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).parents[1]
WORK_ITEM = re.compile(r"\b[Ii]ssues? [A-Z][0-9]?[a-z]?\b|\b[A-Z][0-9]? part [0-9]\b|\bitems? \d+ of issue")


def _tree():
    for pattern in ("comix/**/*.py", "tests/*.py", "bench/*.py", "scripts/*.py", "examples/*.py", "docs/*.md",
                    "bench/results/*.md", "configs/**/*.yaml", "README.md", "pyproject.toml", ".ci/run"):
        yield from ROOT.glob(pattern)


def test_no_work_item_references():
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}" for p in _tree()
            for i, line in enumerate(p.read_text().splitlines(), 1) if WORK_ITEM.search(line)]
    assert hits == []


def test_the_pattern_finds_work_items():
    item, part = "iss" + "ue", " pa" + "rt 2"  # spelled in pieces, so this file holds no reference itself
    assert WORK_ITEM.search(f"the layer ({item} F1{part})") and WORK_ITEM.search(f"{item} K:")
    assert WORK_ITEM.search(f"K{part}: the specs") and not WORK_ITEM.search("Table III, part of the paper")


def test_no_package_file_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in [*(ROOT / "comix").rglob("*.py"), *(ROOT / "bench").glob("*.py")]
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_no_bench_module_imports_one_that_imports_it_back():
    """bench/ reads like the package: its modules (run as scripts, each other's imports top-level
    names) form no import circle, lazy imports inside functions included."""
    import ast
    mods = {p.stem: p for p in (ROOT / "bench").glob("*.py")}
    graph = {m: {a.name.split(".")[0] for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Import)
                 for a in n.names} | {n.module.split(".")[0] for n in ast.walk(ast.parse(p.read_text()))
                                      if isinstance(n, ast.ImportFrom) and n.module and not n.level}
             for m, p in mods.items()}
    graph = {m: {t for t in ts if t in mods and t != m} for m, ts in graph.items()}
    assert graph["tables"] >= {"cases", "case_tables"}  # the graph sees real imports

    def reaches(start, goal, seen=()):
        return any(t == goal or (t not in seen and reaches(t, goal, (*seen, t))) for t in graph[start])
    assert [m for m in graph if reaches(m, m)] == []
