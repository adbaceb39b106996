"""Text corpora as ``{category: [document, ...]}``; one category per user in the papers' splits.

* Built-in, offline (shipped inside the package, see ``builtin/PROVENANCE.md``):
  ``multilingual`` (de, fr, it, nl LibreOffice help: a pure language shift) and ``topics``
  (code, docs, literature, lexicon: four English domains).
* Real ``datasets`` loaders for online users (the papers' data): ``ag_news``, ``wiki40b``,
  ``slimpajama``, ``common_corpus``. Each takes ``data_files`` so it can read a local copy with the
  same schema (that is how the tests run them, without network).
* User data: ``user_dirs(root)``: one sub-directory per client holding ``.txt`` / ``.jsonl`` files.
"""
from __future__ import annotations

import functools
import json
import lzma
import re
from pathlib import Path

BUILTIN_DIR = Path(__file__).parent / "builtin"
BUILTIN = {"multilingual": ("de", "fr", "it", "nl"), "topics": ("code", "docs", "literature", "lexicon")}
Corpus = dict[str, list[str]]
# The text that pruned device models are calibrated on (models/prune.py's module docstring): the
# built-in literature, public-domain English books in none of the QA cases' domains.
CALIBRATION = ("topics", "literature")


def builtin(name: str) -> Corpus:
    if name not in BUILTIN:
        raise ValueError(f"unknown corpus {name!r}: built-in corpora are {', '.join(BUILTIN)}")
    out = {}
    for cat in BUILTIN[name]:
        path = BUILTIN_DIR / f"{name}-{cat}.jsonl.xz"
        if not path.exists():
            raise FileNotFoundError(f"missing corpus file {path}: rebuild with scripts/build_corpora.py")
        with lzma.open(path, "rt", encoding="utf-8") as fh:
            out[cat] = [json.loads(line)["text"] for line in fh]
    return out


@functools.lru_cache(maxsize=1)
def calibration_docs() -> tuple[str, ...]:
    """The pruning calibration documents, in the corpus's fixed order (read once per process: the
    server rebuilds every uploaded device's model)."""
    return tuple(builtin(CALIBRATION[0])[CALIBRATION[1]])


# -- online loaders (datasets) ------------------------------------------------------------------
AG_NEWS_LABELS = ("world", "sports", "business", "scitech")
SLIMPAJAMA_SETS = {"stackexchange": "RedPajamaStackExchange", "github": "RedPajamaGithub",
                   "arxiv": "RedPajamaArXiv", "book": "RedPajamaBook"}
WIKI40B_LANGS = ("de", "fr", "it", "nl")
# Common Corpus collections used by CoMiGS (Sec. 4.1.1); each is its own hub dataset.
COMMON_CORPUS = {"youtube": "PleIAs/YouTube-Commons", "books": "PleIAs/Public_Domain_Books",
                 "tenders": "PleIAs/EU-Tenders", "patents": "HUPD/hupd"}


def _load(path, data_files=None, **kw):
    from datasets import load_dataset
    if data_files is not None:  # a local copy shaped like the hub dataset
        fmt = "parquet" if str(data_files).endswith(".parquet") else "json"
        return load_dataset(fmt, data_files=str(data_files), split="train")
    return load_dataset(path, **kw)


def _take(rows, field, limit):
    docs = []
    for row in rows:
        text = row[field]
        if text and text.strip():
            docs.append(text.strip())
        if limit and len(docs) >= limit:
            break
    return docs


def ag_news(data_files=None, max_docs: int | None = 20_000) -> Corpus:
    """AG News: the 4 labels -> 4 users (World, Sports, Business, Sci/Tech)."""
    ds = _load("fancyzhx/ag_news", data_files, split="train")
    out: Corpus = {c: [] for c in AG_NEWS_LABELS}
    for row in ds:
        bucket = out[AG_NEWS_LABELS[int(row["label"])]]
        if not max_docs or len(bucket) < max_docs:
            bucket.append(row["text"].strip())
    return out


def clean_wiki40b(text: str) -> str:
    text = re.sub(r"_START_(ARTICLE|SECTION|PARAGRAPH)_\n", "", text)
    return text.replace("_NEWLINE_", "\n").strip()


def wiki40b(langs=WIKI40B_LANGS, data_files: dict | None = None, max_docs: int | None = 5_000) -> Corpus:
    out = {}
    for lang in langs:
        local = (data_files or {}).get(lang)
        ds = _load("google/wiki40b", local, name=lang, split="train", streaming=local is None)
        out[lang] = [clean_wiki40b(t) for t in _take(ds, "text", max_docs)]
    return out


def slimpajama(categories=tuple(SLIMPAJAMA_SETS), data_files=None, max_docs: int | None = 5_000) -> Corpus:
    ds = _load("cerebras/SlimPajama-627B", data_files, split="train", streaming=data_files is None)
    wanted = {SLIMPAJAMA_SETS[c]: c for c in categories}
    out: Corpus = {c: [] for c in categories}
    for row in ds:
        cat = wanted.get(row["meta"]["redpajama_set_name"])
        if cat and (not max_docs or len(out[cat]) < max_docs):
            out[cat].append(row["text"].strip())
        if max_docs and all(len(v) >= max_docs for v in out.values()):
            break
    return out


def common_corpus(collections=tuple(COMMON_CORPUS), data_files: dict | None = None,
                  max_docs: int | None = 5_000, field: str = "text") -> Corpus:
    out = {}
    for c in collections:
        local = (data_files or {}).get(c)
        ds = _load(COMMON_CORPUS[c], local, split="train", streaming=local is None)
        out[c] = _take(ds, field, max_docs)
    return out


ONLINE = {"ag_news": ag_news, "wiki40b": wiki40b, "slimpajama": slimpajama, "common_corpus": common_corpus}


# -- user data ----------------------------------------------------------------------------------
def user_folder(folder: str | Path) -> list[str]:
    """One user's documents: every ``.txt`` file is one document; a ``.jsonl`` file holds one
    ``{"text": ...}`` document per line."""
    folder = Path(folder)
    docs = []

    def read(f: Path) -> str:
        try:
            return f.read_text(encoding="utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(f"{f} is not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); "
                             "convert it (e.g. iconv -t UTF-8) or remove it") from None
    for f in sorted(folder.rglob("*")):
        if f.suffix == ".txt":
            docs.append(read(f))
        elif f.suffix == ".jsonl":
            for i, line in enumerate(read(f).splitlines()):
                if line.strip():
                    try:
                        docs.append(json.loads(line)["text"])
                    except (json.JSONDecodeError, KeyError, TypeError):
                        raise ValueError(f"{f}:{i + 1}: expected a JSON object with a 'text' field") from None
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"user directory {folder} holds no text (.txt or .jsonl)")
    return docs


def user_dirs(root: str | Path) -> Corpus:
    """``root/<client>/*.txt|*.jsonl`` -> {client: documents} (see ``user_folder``)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"user data directory {root} does not exist")
    out: Corpus = {client.name: user_folder(client) for client in sorted(p for p in root.iterdir() if p.is_dir())}
    if not out:
        raise ValueError(f"user data directory {root} has no client sub-directories")
    return out
