"""``comix run --help`` without importing torch: the text is rendered from ``cli_help.json``,
which ``python -m comix.cli_help`` writes from the live config (tests/test_cli.py checks the two
agree, so a new key or method cannot be left out of the help).

Each key's description is the comment its dataclass field carries in the source (the line's
own comment, else the comment block right above it); method options are listed with their
defaults and described in docs/methods.md.
"""
from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

HELP_FILE = Path(__file__).with_name("cli_help.json")
WIDTH = 100
HIDDEN = {"explicit_train", "seeds"}  # written by comix into a run's config.yaml / compare's --seeds
GENERAL = ("data", "train", "lora", "comigs", "privacy", "server")  # sections every method reads
# the methods by the paper that defines them or runs them as baselines (docs/methods.md)
PAPERS = {
    "CoMiGS (Fan et al., ICML 2025) and its baselines": (
        "pretrained", "local", "fedavg", "centralized", "comigs-1g1s", "comigs-2g", "comigs-2s", "comigs-1gxs",
        "comigs-1g1s-tr", "comigs-tr", "pfedmoe", "local-moe", "fedavg-moe", "local-moe-tr", "fedavg-moe-tr",
        "ffa-lora", "fedsa-lora", "pcl", "fdlora-comigs", "hetlora", "flexlora"),
    "FedAMoLE (Zhang et al., 2025) and its baselines": (
        "fedamole", "fedamole-random", "fedamole-vanilla", "fedamole-vanilla-random", "fedmole", "fedamole-s",
        "fedamole-r", "fedamole-a", "fedamole-h", "fedit", "fedit-ft", "fedprompt", "fedprompt-ft", "fedptuning",
        "fedptuning-ft", "fdlora-fedamole"),
    "DeepFusion (one-shot distillation into a global MoE) and its baselines": (
        "deepfusion", "deepfusion-ce", "fedkmt", "ofa-kd", "central-moe", "fedjets"),
    "Recent federated LoRA mixtures": ("flora", "fedalt", "feddpa-t", "feddpa-f", "fedlease"),
}
EXAMPLES = (
    ("comix run", "the main job: 4 methods on the built-in multilingual corpus (~10 min on 2 CPU cores)"),
    ("comix run model=tiny-llama train.rounds=1 methods=[local,fedavg]", "a quick try on a tiny random model"),
    ("comix run small/table1-multilingual run_dir=runs/t1", "a built-in recipe (comix recipes lists them)"),
)


def _comments(cls) -> dict[str, str]:
    """field name -> its source comment (same line, else the block above)."""
    import inspect
    out, above, last, column = {}, [], None, -1
    for line in inspect.getsource(cls).splitlines():
        s = line.strip()
        if s.startswith("#"):
            if last and line.index("#") == column:  # the previous field's comment, continued
                out[last] += " " + s.lstrip("#").strip()
            else:
                above.append(s.lstrip("#").strip())
            continue
        m = re.match(r"\s+(\w+)\s*:\s*[^=(]+(=.*)?$", line)
        last, column = None, -1
        if m and not s.startswith(("def ", "return", '"""')):
            if "  #" in line:
                last, column = m.group(1), line.index("  #") + 2
                out[last] = line[column:].lstrip("#").strip()
            else:
                out[m.group(1)] = " ".join(above)
        above = []
    return out


def build() -> dict:
    """The help's content from the live code (imports torch: run by ``python -m comix.cli_help``)."""
    import dataclasses

    from .algorithms import METHODS
    from .config import RunConfig
    from .data.sources import corpus_names
    from .models.base import OFFLINE, TINY
    cfg = RunConfig()
    keys, options = [], {}
    top = _comments(RunConfig)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in HIDDEN:
            continue
        if not dataclasses.is_dataclass(value):
            keys.append([f.name, repr(value), top.get(f.name, "")])
        elif f.name in GENERAL:
            notes = _comments(type(value))
            keys += [[f"{f.name}.{g.name}", repr(getattr(value, g.name)), notes.get(g.name, "")]
                     for g in dataclasses.fields(value)]
        else:
            options[f.name] = [[g.name, repr(getattr(value, g.name))] for g in dataclasses.fields(value)]
    return {"models": {"offline": list(OFFLINE), "tiny": list(TINY)}, "corpora": corpus_names(),
            "methods": {paper: sorted(names) for paper, names in PAPERS.items()}, "all_methods": sorted(METHODS),
            "keys": keys, "options": options}


def _fill(text: str, indent: str, first: str = "") -> str:
    return textwrap.fill(text, WIDTH, initial_indent=first or indent, subsequent_indent=indent)


def render(content: dict | None = None) -> str:
    """``comix run --help``'s epilog (reads cli_help.json: no torch)."""
    c = content or json.loads(HELP_FILE.read_text(encoding="utf-8"))
    m = c["models"]
    lines = [_fill(f"models (model=...): {m['offline'][0]} (the default, offline), {', '.join(m['offline'][1:])} "
                   f"(offline); tiny random models for tests and quick tries: {', '.join(m['tiny'])}; any Hugging "
                   "Face hub id or local model folder", "  ", ""),
             _fill(f"corpora (corpus=...): {c['corpora']}", "  ", ""), "",
             "methods (methods=[a,b]; a spec sets a method's options: hetlora:reg=0.05), by paper:"]
    for paper, names in c["methods"].items():
        lines += [f"  {paper}:", _fill(", ".join(names), "    ")]
    lines += ["", "config keys (key=value on the command line, or in a YAML recipe; the defaults are the main job):"]
    width = max(len(f"{k}={v}") for k, v, _ in c["keys"]) + 4
    width = min(width, 44)
    for key, value, note in c["keys"]:
        head = f"  {key}={value}"
        if len(head) + 2 > width:
            lines += [head, _fill(note, " " * width)] if note else [head]
        else:
            lines.append(_fill(note, " " * width, head.ljust(width)) if note else head)
    lines += ["", "method options (section.key=value, or in a spec; docs/methods.md describes each):"]
    for section, items in c["options"].items():
        lines.append(_fill(" ".join(f"{k}={v}" for k, v in items), "      ", f"  {section}: "))
    lines += ["", "examples:"] + [f"  {cmd}\n      {what}" for cmd, what in EXAMPLES]
    return "\n".join(lines)


def config_keys() -> set[str]:
    """Every key ``key=value`` may name, sections included (for refusing a mistyped key at once)."""
    c = json.loads(HELP_FILE.read_text(encoding="utf-8"))
    keys = {k for k, _, _ in c["keys"]} | HIDDEN | set(c["options"])
    keys |= {s for k in keys if "." in k for s in [k.split(".")[0]]}
    keys |= {f"{s}.{k}" for s, items in c["options"].items() for k, _ in items}
    return keys


if __name__ == "__main__":
    HELP_FILE.write_text(json.dumps(build(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {HELP_FILE}")
