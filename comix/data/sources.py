"""Every corpus by name, the one entry point above the raw sources: built-in and online text
corpora (``corpora.py``), DeepFusion's QA cases (``qa.py``), instruction sets
(``instructions.py``) and user folders. Raw sources never import this module."""
from __future__ import annotations

from pathlib import Path

from .corpora import BUILTIN, ONLINE, builtin, user_dirs
from .instructions import BUILTIN_SETS, ONLINE_SETS, builtin_set, instruction_file, online_set
from .qa import QA_CORPORA, QA_ONLINE, qa_corpus


def load_corpus(name: str, **kw):
    """``multilingual`` | ``topics`` | ``qa-open`` / ``qa-choice`` (data/qa.py) | an online loader name | a directory of user folders (text
    corpora, ``{category: documents}``), or an instruction set (``InstructionSet``): built-in
    ``instructions`` / ``relations``, online ``snli`` / ``dolly`` / ``natural_instructions``, or
    a ``.jsonl`` file of examples."""
    if name in BUILTIN:
        return builtin(name)
    if name in QA_CORPORA:  # DeepFusion's QA cases, text corpora built from the instruction set
        return qa_corpus(name)
    if name in QA_ONLINE:  # the DeepFusion paper's own data (MMedBench, FinQA)
        return QA_ONLINE[name](**kw)
    if name in BUILTIN_SETS:
        return builtin_set(name)
    if name in ONLINE:
        return ONLINE[name](**kw)
    if name in ONLINE_SETS:
        return online_set(name, **kw)
    if Path(name).is_dir():
        return user_dirs(name)
    if name.endswith(".jsonl") and Path(name).is_file():
        return instruction_file(name)
    raise ValueError(f"unknown corpus {name!r}: use one of {corpus_names()}")


def corpus_names() -> str:
    """Every corpus name ``load_corpus`` takes, in words (errors and ``comix run --help``)."""
    return (f"{', '.join([*BUILTIN, *QA_CORPORA, *BUILTIN_SETS])} (built in, offline), "
            f"{', '.join([*ONLINE, *QA_ONLINE, *ONLINE_SETS])} (online), a directory with one folder per client "
            "or a .jsonl file of instruction examples")
