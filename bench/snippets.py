"""The docs' Python snippets on the real model: the time each statement takes.

    python bench/snippets.py               # every ```python block of README.md and docs/*.md

tests/test_docs.py runs every block as written (tiny random models) from an empty folder; this
runs each block with ``tiny-llama`` replaced by the offline default, SmolLM2-135M, in a fresh
process in an empty folder (the model's safetensors cache warm, as after a first run), timing each
top-level statement: what a user who copies the snippet and asks for the real model waits.

Writes ``bench/results/snippets.json``; docs/export.md quotes it.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import footprint  # prints wall time and peak RSS at exit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
REAL = "smollm2-135m"

# run in the child: each top-level statement of the block, timed; one JSON line per statement
DRIVER = r"""
import ast, json, sys, time
source = sys.stdin.read()
scope = {"__name__": "__snippet__"}
for node in ast.parse(source).body:
    code = ast.get_source_segment(source, node)
    t = time.perf_counter()
    exec(compile(ast.Module([node], []), "snippet", "exec"), scope)
    print("@@" + json.dumps({"code": code, "seconds": round(time.perf_counter() - t, 2)}), flush=True)
"""


def blocks() -> list[tuple[str, str]]:
    return [(doc.relative_to(ROOT).as_posix(), b) for doc in DOCS
            for b in re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)]


def run_block(source: str) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        t = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", DRIVER], input=source.replace("tiny-llama", REAL), cwd=folder,
                             capture_output=True, text=True)
        wall = time.perf_counter() - t
    if out.returncode:
        raise SystemExit(f"a snippet failed on {REAL}:\n{out.stderr[-3000:]}")
    statements = [json.loads(x[2:]) for x in out.stdout.splitlines() if x.startswith("@@")]
    return {"wall_s": round(wall, 1), "statements": statements}


def main() -> None:
    import torch
    results = []
    for doc, source in blocks():
        r = {"doc": doc, **run_block(source)}
        for s in r["statements"]:
            print(f"{s['seconds']:8.1f} s  {s['code'].splitlines()[0]}")
        results.append(r)
    footprint.write_result(ROOT / "bench" / "results" / "snippets.json", {
        "command": "python bench/snippets.py", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
        "model": REAL, "machine": f"{os.cpu_count()} cores of an {footprint.cpu_name()}, nothing else running",
        "results": results})


if __name__ == "__main__":
    main()
