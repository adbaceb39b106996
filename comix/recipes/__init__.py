"""The built-in recipes (the repository's ``configs/`` links here): ``comix run small/table1-multilingual``
finds one from any directory, ``comix recipes`` lists them. Nothing heavy is imported here: the
command line answers at once."""
from __future__ import annotations

from pathlib import Path

RECIPES = Path(__file__).parent


class ConfigFileMissing(ValueError):
    pass


def recipe_path(path: str) -> Path:
    """``path`` as given, else the built-in recipe it names from anywhere: ``small/table1-multilingual``,
    with or without ``.yaml``, with or without the repository's ``configs/`` in front."""
    given = Path(path)
    if given.exists():
        return given
    name = path[len("configs/"):] if path.startswith("configs/") else path
    for candidate in (RECIPES / name, RECIPES / f"{name}.yaml"):
        if candidate.is_file() and candidate.suffix == ".yaml":
            return candidate
    raise ConfigFileMissing(f"config file {path} does not exist (nor a built-in recipe of that name: "
                            "comix recipes lists them)")


def builtin_recipes() -> list[tuple[str, str]]:
    """(name, its first comment line) of every built-in recipe."""
    out = []
    for f in sorted(RECIPES.rglob("*.yaml")):
        first = next((ln.lstrip("# ").strip() for ln in f.read_text().splitlines() if ln.startswith("#")), "")
        out.append((str(f.relative_to(RECIPES).with_suffix("")), first))
    return out
