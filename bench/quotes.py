"""Numbers quoted in the prose of README.md and docs/*.md, checked against the files that back them.

A measured number in prose is written as a link to the committed file it comes from, the value's
place in that file as the link's fragment::

    a step adds [874 MB](../bench/results/memory-probe.json#smollm2.rss_rise_mb) of resident memory
    the undisturbed soak took [39.9 min](../bench/results/soak.json#undisturbed_wall_s/60)

or, for a result file of text (``bench/results/*.md``, ``.log``, ``.txt``), a link without a
fragment, whose number must appear in that file as the link shows it::

    [8.83 min](../bench/results/main-job-restructure.md)

The fragment is an expression of key paths and numbers with ``+ - * /`` and brackets. A key path
walks the JSON file: ``a.b`` a key of a key, ``results.0`` a list's first item, ``results.cohort=4``
the first item of a list whose ``cohort`` is 4; a hyphen followed by a letter belongs to the
key (``main-job``), else it is a minus. The file may also be a case's ``results.json``.

``python bench/tables.py --check`` (tests/test_tables.py) evaluates every such link and fails,
naming the doc and the link, unless the first number of the link's text (thousands commas
ignored) equals the value rounded to the decimals the text shows (or, in a text file, appears
there as a number of its own).

    python bench/quotes.py             # each quote, its value, OK or not
    python bench/quotes.py --unbacked  # prose lines with a time, a memory or a rate outside a quote
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BRACKETED = r"(?:[^()\s]|\([^()\s]*\))+"  # one level of brackets in the fragment (CommonMark keeps them)
QUOTE = re.compile(r"\[(?P<text>[^\]]*?\d[^\]]*)\]\((?P<file>[^)\s#]*bench/results/[^)\s#]+\.json)#(?P<expr>"
                   + _BRACKETED + r")\)")
TOKEN = re.compile(r"\s*(?:(?P<path>[A-Za-z_]\w*(?:[.=]\w+|-[A-Za-z]\w*)*)|(?P<num>\d+(?:\.\d+)?)|(?P<op>[-+*/()]))")
TEXT_QUOTE = re.compile(r"\[(?P<text>[^\]]*?\d[^\]]*)\]\((?P<file>[^)\s#]*bench/results/[^)\s#]+\.(?:md|log|txt))\)")
NUMBER = re.compile(r"[-\u2212]?\d[\d,]*(?:\.(\d+))?")
GENERATED = re.compile(r"<!-- table: [\w.-]+ -->\n.*?<!-- end table -->", re.S)
MEASURED = re.compile(r"\b\d[\d,]*(?:\.\d+)?\s?(?:MB|GB|MiB|GiB|ms|s|min|h|tokens/s|TFLOP/s)\b")


def lookup(data, path: str):
    """The value at ``path`` (``a.b.0.c``, ``list.key=value``) in parsed JSON ``data``."""
    for part in path.split("."):
        if isinstance(data, list):
            if "=" in part:
                key, want = part.split("=", 1)
                data = next(x for x in data if str(x.get(key)) == want)
            else:
                data = data[int(part)]
        else:
            data = data[part]
    return data


def evaluate(expr: str, data) -> float:
    """``expr`` (key paths of ``data``, numbers, + - * / and brackets) as a number."""
    out, pos = [], 0
    while pos < len(expr):
        m = TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise ValueError(f"cannot read {expr[pos:]!r}")
        pos = m.end()
        if m.group("path"):
            value = lookup(data, m.group("path"))
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{m.group('path')} is {value!r}, not a number")
            out.append(repr(float(value)))
        else:
            out.append(m.group("num") or m.group("op"))
    return float(eval(" ".join(out), {"__builtins__": {}}))  # digits, dots and operators only


def check_quote(doc: Path, text: str, file: str, expr: str | None) -> str | None:
    """None when the link's number is the file's value (``expr`` None: a number of the text file);
    else one line saying what differs."""
    where = f"{doc.relative_to(ROOT)}: [{text}]({file}{'#' + expr if expr else ''})"
    path = (doc.parent / file).resolve()
    if not path.exists():
        return f"{where}: no file {file}"
    m = NUMBER.search(text)
    if expr is None:  # a text file: the number, as shown, stands in it (not inside a longer number)
        number = m.group(0).replace(",", "").lstrip("-\u2212")
        numbers = {n.replace(",", "") for n in re.findall(r"(?<![\d.,])\d[\d,]*(?:\.\d+)?", path.read_text())}
        return None if number in numbers else f"{where}: {number} is not in the file"
    try:
        value = evaluate(expr, json.loads(path.read_text()))
    except (KeyError, IndexError, StopIteration, ValueError, ZeroDivisionError, SyntaxError) as e:
        return f"{where}: cannot evaluate ({type(e).__name__}: {e})"
    shown = float(m.group(0).replace(",", "").replace("\u2212", "-"))
    decimals = len(m.group(1) or "")
    if round(value, decimals) != shown:
        return f"{where}: the file says {value:,.{decimals + 1}f}"
    return None


def quotes(doc: Path) -> list[tuple[str, str, str | None]]:
    text = doc.read_text()
    return [(m.group("text"), m.group("file"), m.group("expr")) for m in QUOTE.finditer(text)] + \
        [(m.group("text"), m.group("file"), None) for m in TEXT_QUOTE.finditer(text)]


def stale_quotes(docs: list[Path] = DOCS) -> list[str]:
    """One line per quote whose number its file does not back."""
    return [p for doc in docs for q in quotes(doc) if (p := check_quote(doc, *q))]


def unbacked(docs: list[Path] = DOCS) -> list[str]:
    """Prose lines (outside generated tables, code blocks, tables of settings and quotes) holding
    a time, a memory or a rate: numbers a reader cannot trace to a file."""
    found = []
    for doc in docs:
        prose = GENERATED.sub(lambda m: "\n" * m.group(0).count("\n"), doc.read_text())
        fenced = False
        for i, line in enumerate(prose.splitlines(), 1):
            fenced ^= line.startswith("```")
            bare = TEXT_QUOTE.sub("", QUOTE.sub("", line))
            if not fenced and not line.startswith(("```", "|")) and MEASURED.search(bare):
                found.append(f"{doc.relative_to(ROOT)}:{i}: {line.strip()[:140]}")
    return found


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--unbacked" in argv:
        lines = unbacked()
        print("\n".join(lines) + f"\n{len(lines)} prose lines with a number no file backs")
        return 0
    stale = stale_quotes()
    for doc in DOCS:
        for q in quotes(doc):
            print(check_quote(doc, *q) or f"ok {doc.relative_to(ROOT)}: [{q[0]}]({q[1]}{'#' + q[2] if q[2] else ''})")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
