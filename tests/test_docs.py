"""The README and docs/ name only what exists: every `comix <command>` is a subcommand, every
recipe, script, example and doc path is in the repository (globs match), every recipe a command
runs loads (the README is a front door, not a list of dead ends)."""
import re
from pathlib import Path

import pytest

from comix.cli import main
from comix.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(r"(?<![\w/.-])((?:configs|bench|examples|docs|scripts)/[\w./*{},-]+)")


def _paths(text: str):
    for m in PATH.finditer(text):
        p = m.group(1).rstrip(".,)")
        if "{" in p:  # bench/{a,b}.py
            head, alts, tail = re.match(r"(.*)\{(.*)\}(.*)", p).groups()
            yield from (head + a + tail for a in alts.split(","))
        else:
            yield p


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_path_a_doc_names_exists(doc):
    missing = [p for p in set(_paths(doc.read_text())) if "..." not in p and not list(ROOT.glob(p))]
    assert not missing, f"{doc.name} names {missing}"


def _commands(text: str):
    """Every `comix ...` command of a doc: lines of fenced code blocks and inline code spans."""
    fenced = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, re.S))
    inline = "\n".join(re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))
    for line in (fenced + "\n" + inline).splitlines():
        line = line.split("#")[0]  # shell comments are prose
        m = re.search(r"(?:^|[\s;&|(])comix ([a-z][a-z-]*)(.*)", line)
        if m:
            yield m.group(1), m.group(2)


def test_every_comix_command_in_the_docs_is_a_subcommand_and_its_recipe_loads(capsys):
    commands = [c for doc in DOCS for c in _commands(doc.read_text())]
    assert len(commands) > 20
    for name in sorted({n for n, _ in commands}):
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, f"`comix {name}` is not a subcommand"
    capsys.readouterr()
    recipes = {m.group(1) for name, rest in commands if name in ("run", "compare")
               for m in re.finditer(r"(configs/[\w./-]+\.yaml)", rest)}
    assert len(recipes) > 5
    for recipe in sorted(recipes):
        load_config(str(ROOT / recipe))


def test_every_bench_reports_its_footprint():
    """Each bench prints its wall time and peak RSS at exit (bench/footprint.py), and the
    footprint line is what it says."""
    import subprocess
    import sys

    # tables.py (and the modules of its tables: methods_table.py, from the code, results_page.py,
    # the verdicts page, pooling.py, the cases it reads, cases.py, case_tables.py, deepfusion_table.py,
    # bench_tables.py) runs
    # nothing: it writes the docs' tables from committed result files; mutants.py (with mutant.py,
    # mutants_cohort.py and mutants_aggregation.py) is the mutation sweep's list of edits (data, run
    # by mutation_sweep.py)
    renderers = ("footprint.py", "tables.py", "methods_table.py", "results_page.py", "pooling.py", "quotes.py", "cases.py",
                 "case_tables.py", "deepfusion_table.py", "bench_tables.py", "mutants.py", "mutant.py",
                 "mutants_cohort.py", "mutants_aggregation.py")
    benches = [p for p in (ROOT / "bench").glob("*.py") if p.name not in renderers]
    assert len(benches) >= 8
    assert all("import footprint" in p.read_text() for p in benches), [p.name for p in benches
                                                                       if "import footprint" not in p.read_text()]
    code = "import footprint; x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096])"
    err = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "bench", capture_output=True, text=True).stderr
    peak = float(re.search(r"peak RSS ([\d,]+) MB", err).group(1).replace(",", ""))
    assert "[footprint] wall" in err and 300 < peak < 1000


def test_every_python_block_of_the_docs_runs_from_an_empty_folder(tmp_path, monkeypatch):
    """A user copies a snippet into a script anywhere: no repository path, no warm cache of ours."""
    blocks = [(doc.name, b) for doc in DOCS for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)]
    assert blocks
    monkeypatch.chdir(tmp_path)
    for name, block in blocks:
        exec(compile(block, f"{name} python block", "exec"), {"__name__": "__snippet__"})


def test_the_front_door_and_the_longest_method_page_stay_short():
    """README is the front door (what comix is, install, the first try, the main job's table, a
    line per paper pointing at docs/results.md); a method page starts with its summary and keeps
    the diary of runs in its case's NOTES.md."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250 and "docs/results.md" in readme
    deepfusion = (ROOT / "docs" / "deepfusion.md").read_text()
    assert len(deepfusion.splitlines()) <= 300 and "**Summary.**" in deepfusion.split("```")[0]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_table_s_rule_line_has_as_many_columns_as_its_header(doc):
    """A Markdown table whose separator row has fewer cells than its header renders as text: a
    generated table that grew a column must grow its rule line too."""
    lines = doc.read_text().splitlines()
    for i in range(1, len(lines)):
        if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i].strip()) and lines[i - 1].startswith("|"):
            header = lines[i - 1].replace("\\|", "")
            assert header.count("|") == lines[i].count("|"), f"{doc.name}:{i}: {header[:80]}"
