"""Build comix's built-in offline corpora from Debian packages.

Run once by a maintainer (needs `apt-get download` and network access to Debian's archive);
the result is committed, compressed, under ``comix/data/builtin/``:

    python scripts/build_corpora.py            # downloads the .deb files into a temp dir
    python scripts/build_corpora.py --debs DIR # reuse already downloaded .deb files

Each corpus is a ``<name>.jsonl.xz`` file of documents ``{"id": ..., "text": ...}``; per-user
splits are made by document so no text is shared between train, validation and test.
Sources and licences are written to ``comix/data/builtin/PROVENANCE.md``.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import html
import json
import lzma
import os
import re
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "comix" / "data" / "builtin"
TARGET_CHARS = 2_000_000  # per corpus (>= 1.5 M characters each: enough text for 3 rounds of every user without repeats)
PACKAGES = {
    "libreoffice-help-de": "MPL-2.0", "libreoffice-help-fr": "MPL-2.0",
    "libreoffice-help-it": "MPL-2.0", "libreoffice-help-nl": "MPL-2.0",
    "python3.11-doc": "PSF-2.0", "sword-text-web": "public domain (World English Bible)", "dict-wn": "WordNet 3.0 licence (permissive, BSD-like)",
}

BLOCK = {"p", "h1", "h2", "h3", "h4", "h5", "h6", "li", "pre", "div", "br", "tr", "dt", "dd",
         "table", "ul", "ol", "dl", "section", "blockquote", "td", "th"}
VOID = {"br", "img", "meta", "input", "link", "hr", "col", "source", "wbr", "area", "base"}
SKIP = {"script", "style", "noscript", "header", "nav", "aside", "head", "title", "button", "label"}


class _TextExtractor(HTMLParser):
    """Visible text of the subtree selected by ``is_root``; block elements become line breaks,
    hidden elements (LibreOffice's per-OS variants) and permalink anchors are dropped."""

    def __init__(self, is_root):
        super().__init__(convert_charrefs=True)
        self.is_root, self.stack, self.parts = is_root, [], []
        self.root_depth = self.skip_depth = None

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in VOID:
            if tag == "br" and self._capturing():
                self.parts.append("\n")
            return
        self.stack.append(tag)
        depth = len(self.stack)
        if self.root_depth is None and self.is_root(tag, a):
            self.root_depth = depth
        # LibreOffice hides every OS/module variant and unhides one with JavaScript: keep the
        # "default..." variant (e.g. "Strg" rather than the macOS "Befehl").
        hidden = "hidden" in a and not (a.get("id") or "").startswith("default")
        if self.skip_depth is None and (tag in SKIP or hidden
                                        or "headerlink" in (a.get("class") or "")):
            self.skip_depth = depth
        if tag in BLOCK and self._capturing():
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in VOID or tag not in self.stack:
            return
        while self.stack:  # tolerate unclosed tags
            depth = len(self.stack)
            top = self.stack.pop()
            if self.skip_depth == depth:
                self.skip_depth = None
            if self.root_depth == depth:
                self.root_depth = -1  # done: one root per page
            if top in BLOCK and self._capturing():
                self.parts.append("\n")
            if top == tag:
                break

    def handle_data(self, data):
        if self._capturing():
            self.parts.append(data if "pre" in self.stack else re.sub(r"\s+", " ", data))

    def _capturing(self):
        return self.root_depth not in (None, -1) and self.skip_depth is None

    def text(self):
        lines = (ln.strip() for ln in "".join(self.parts).split("\n"))
        return re.sub(r"\n{3,}", "\n\n", "\n".join(ln for ln in lines if ln)).strip()


def html_text(path: str, is_root) -> str:
    parser = _TextExtractor(is_root)
    parser.feed(Path(path).read_text(encoding="utf-8", errors="replace"))
    return html.unescape(parser.text())


def _stable_order(keys):
    """Deterministic pseudo-random order (same across languages for parallel corpora)."""
    return sorted(keys, key=lambda k: hashlib.sha1(k.encode()).hexdigest())


def _take(docs, target=TARGET_CHARS):
    out, total = [], 0
    for doc_id, text in docs:
        if len(text) < 200:
            continue
        out.append({"id": doc_id, "text": text})
        total += len(text)
        if total >= target:
            break
    return out


def libreoffice(root: Path, lang: str, target: int):
    base = root / "usr/share/libreoffice/help" / lang / "text"
    rel = [str(Path(p).relative_to(base)) for p in glob.glob(str(base / "**/*.html"), recursive=True)]
    is_root = lambda tag, a: a.get("id") == "DisplayArea"  # noqa: E731
    return _take(((r, html_text(str(base / r), is_root)) for r in _stable_order(rel)), target)


def python_docs(root: Path, target: int):
    base = root / "usr/share/doc/python3.11/html"
    rel = [str(Path(p).relative_to(base)) for d in ("library", "tutorial", "howto", "reference", "faq")
           for p in glob.glob(str(base / d / "*.html"))]
    is_root = lambda tag, a: tag == "div" and a.get("role") == "main"  # noqa: E731
    return _take(((r, html_text(str(base / r), is_root)) for r in _stable_order(rel)), target)


def python_code(target: int):
    base = Path("/usr/lib/python3.11")
    rel = [str(Path(p).relative_to(base)) for p in glob.glob(str(base / "**/*.py"), recursive=True)
           if not re.search(r"(^|/)(test|tests|idle_test|site-packages|dist-packages)/", str(Path(p).relative_to(base)))]
    # Cap a file at 40k characters so no single module dominates the corpus.
    return _take(((r, (base / r).read_text(encoding="utf-8", errors="replace")[:40_000])
                  for r in _stable_order(rel)), target)


def bible(root: Path, target: int):
    from pysword.modules import SwordModules
    mods = SwordModules(str(root / "usr/share/sword/mods.d/../"))
    # pysword reads a SWORD tree (mods.d + modules); the .deb lays it out under usr/share/sword.
    found = mods.parse_modules()
    name = next(m for m in found if "WEB" in m.upper())  # World English Bible: modern, public domain
    bible = mods.get_bible_from_module(name)
    docs = []
    for testament in ("ot", "nt"):
        for book in bible.get_structure().get_books()[testament]:
            for chapter in range(1, book.num_chapters + 1):
                verses = bible.get(books=[book.name], chapters=[chapter], clean=True, join="\n")
                docs.append((f"{book.name} {chapter}", re.sub(r"[ \t]+", " ", verses).strip()))
    return _take(((d, t) for d, t in _stable_order_pairs(docs)), target)


def _stable_order_pairs(pairs):
    index = dict(pairs)
    return [(k, index[k]) for k in _stable_order(index)]


def wordnet(root: Path, target: int, entries_per_doc: int = 40):
    with gzip.open(root / "usr/share/dictd/wn.dict.dz", "rt", encoding="utf-8") as fh:
        raw = fh.read()
    # dictd format: each entry starts with an unindented headword line.
    entries = re.split(r"\n(?=\S)", raw)
    entries = [e.strip() for e in entries if e.strip() and not e.startswith("00-database")]
    entries = [re.sub(r"[ \t]+", " ", e) for e in entries]
    docs = [(f"wn-{i}", "\n".join(entries[i:i + entries_per_doc]))
            for i in range(0, len(entries), entries_per_doc)]
    return _take(_stable_order_pairs(docs), target)


def write(name: str, docs: list[dict]):
    path = OUT / f"{name}.jsonl.xz"
    tmp = path.with_suffix(".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8", preset=9 | lzma.PRESET_EXTREME) as fh:
        for d in docs:
            fh.write(json.dumps(d, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    chars = sum(len(d["text"]) for d in docs)
    print(f"{name:14s} {len(docs):6d} docs {chars:10,d} chars -> {path.stat().st_size / 1e6:.2f} MB")
    return chars


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--debs", help="directory holding the downloaded .deb files")
    ap.add_argument("--chars", type=int, default=TARGET_CHARS)
    args = ap.parse_args()
    debs = Path(args.debs or tempfile.mkdtemp())
    if not args.debs:
        subprocess.run(["apt-get", "download", *PACKAGES], cwd=debs, check=True)
    root = debs / "_x"
    for deb in glob.glob(str(debs / "*.deb")):
        subprocess.run(["dpkg-deb", "-x", deb, str(root)], check=True)
    OUT.mkdir(parents=True, exist_ok=True)
    for lang in ("de", "fr", "it", "nl"):
        write(f"multilingual-{lang}", libreoffice(root, lang, args.chars))
    write("topics-code", python_code(args.chars))
    write("topics-docs", python_docs(root, args.chars))
    write("topics-literature", bible(root, args.chars))
    write("topics-lexicon", wordnet(root, args.chars))


if __name__ == "__main__":
    main()
