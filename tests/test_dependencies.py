"""Every third-party module the code imports is declared in pyproject.toml (a dependency or an
extra), so an install from scratch never meets an import that only a transitive dependency
happened to bring."""
import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE = ("comix/**/*.py", "bench/*.py", "bench/*_app/*.py", "scripts/*.py", "examples/*.py", "tests/**/*.py")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def imported_modules() -> dict[str, str]:
    """Top-level module -> the first file importing it, over the repo's code (absolute imports)."""
    found: dict[str, str] = {}
    for pattern in CODE:
        for path in sorted(ROOT.glob(pattern)):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = [*project["dependencies"], *(s for extra in project["optional-dependencies"].values() for s in extra)]
    return {_norm(re.match(r"[A-Za-z0-9_.-]+", s).group()) for s in specs}


# import name -> distribution for optional modules whose names differ and which a clean install may
# lack (packages_distributions() only knows what is installed): CI has no llama.cpp build
NOT_INSTALLED_EVERYWHERE = {"llama_cpp": "llama-cpp-python"}


def undeclared(modules: dict[str, str], declared: set[str]) -> dict[str, str]:
    # the repo's own modules: the package and the scripts' siblings (bench/tables.py imports footprint)
    local = {"comix"} | {p.stem for pattern in CODE for p in ROOT.glob(pattern)} | \
        {p.name for p in (ROOT / "tests").iterdir() if p.is_dir()}
    dists = packages_distributions()  # import name -> the installed distributions that provide it
    return {m: f for m, f in modules.items() if m not in sys.stdlib_module_names and m not in local
            and not any(_norm(d) in declared for d in dists.get(m, [NOT_INSTALLED_EVERYWHERE.get(m, m)]))}


def test_every_third_party_import_is_declared():
    assert undeclared(imported_modules(), declared_distributions()) == {}


def test_an_import_missing_from_pyproject_is_named_with_its_file():
    declared = declared_distributions() - {"scikit-learn"}
    assert undeclared({"sklearn": "comix/x.py", "json": "a.py", "comix": "b.py"}, declared) == {"sklearn": "comix/x.py"}
