"""On-device LMs of different architectures and sizes (DeepFusion Sec. III-A: "each edge device
independently tailors the architecture and parameter size of its local LLM"), named by a spec:

  base                        the run's base model itself (a full copy)
  prune:<layers>:<ffn>[:<d>]  the base pruned to <layers> blocks, <ffn> FFN neurons per block and
                              (optionally) <d> residual channels, chosen on a fixed calibration
                              text (models/prune.py; Llama bases)
  random-<arch>:<layers>:<d>  a randomly initialised <arch> (llama | gpt2 | qwen2) LM of <layers>
                              blocks and width <d> (heads of 64 channels) on the base's vocabulary
  gemma3-270m                 an offline model of another family (``models/base.py``), with its
                              own tokenizer
  anything else               a hub id or local folder (``AutoModelForCausalLM.from_pretrained``),
                              e.g. openai-community/gpt2 or TinyLlama/TinyLlama-1.1B-Chat-v1.0 online

Base, pruned and random devices read the base's token ids. A pretrained device whose vocabulary
size differs from the base's reads its own tokenizer (recorded as ``config.comix_tokenizer``): it
trains on its own tokenisation of its text and teaches across tokenizers
(``models/token_align.py``); one of the base's vocabulary size is taken to share the base's
tokenizer. Random initialisation is seeded by the spec, so every engine builds the same model.
"""
from __future__ import annotations

import copy
import functools
import random
import zlib

import torch
from torch import nn

RANDOM_ARCHS = ("llama", "gpt2", "qwen2")


def parse_device_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """(kind, numbers) of a spec; a malformed one fails with one line naming it."""
    if spec == "base":
        return "base", ()
    head, _, rest = spec.partition(":")
    if head == "prune" or head.startswith("random-"):
        parts = rest.split(":")
        sizes = (2, 3) if head == "prune" else (2,)
        if len(parts) not in sizes or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"deepfusion.devices: {spec!r} must be {head}:<layers>:<"
                             f"{'ffn>[:<width>' if head == 'prune' else 'width'}> with positive whole numbers")
        if head.startswith("random-") and head[7:] not in RANDOM_ARCHS:
            raise ValueError(f"deepfusion.devices: {spec!r}: random architectures are {', '.join(RANDOM_ARCHS)}")
        if head.startswith("random-") and int(parts[1]) % 64 and int(parts[1]) > 64:
            raise ValueError(f"deepfusion.devices: {spec!r}: the width must be a multiple of 64 (heads of 64)")
        return head, tuple(int(p) for p in parts)
    return "pretrained", ()


def assign_devices(devices: list[str], n_clients: int, seed: int) -> list[str]:
    """Each client's on-device model spec: "each edge device is randomly assigned to operate one of
    the on-device LLMs" (DeepFusion Sec. V-A), drawn with ``seed`` (the same on every run seed, so
    seeds vary the data and the training, not which model a client runs)."""
    rng = random.Random(seed)
    return [rng.choice(devices) for _ in range(n_clients)]


def device_problems(spec: str, base_config) -> list[str]:
    """What is wrong with device ``spec`` for a base of ``base_config`` (transformers config, no
    weights needed), each a line naming ``deepfusion.devices`` and the model; [] when it builds."""
    try:
        kind, nums = parse_device_spec(spec)
    except ValueError as err:
        return [str(err)]
    if kind == "pretrained":
        from .base import OFFLINE, offline_missing
        missing = offline_missing(spec) if spec in OFFLINE else None
        return [f"deepfusion.devices: {missing}"] if missing else []
    if kind != "prune":
        return []
    c, out = base_config, []
    where = f"deepfusion.devices: {spec!r} on the base ({c.model_type}"
    if c.model_type != "llama":
        return [f"{where}): only Llama-architecture bases are pruned here"]
    for name, value, limit in (("layers", nums[0], c.num_hidden_layers), ("ffn", nums[1], c.intermediate_size),
                               *((("width", nums[2], c.hidden_size),) if len(nums) > 2 else ())):
        if not 1 <= value <= limit:
            out.append(f"{where} with {limit} {name}): {name} = {value} must lie in [1, {limit}]")
    return out


def device_layers(spec: str, base_config) -> int | None:
    """The number of blocks device ``spec`` will have (None for a pretrained model other than an
    offline one: unknown before it loads)."""
    kind, nums = parse_device_spec(spec)
    if kind == "base":
        return base_config.num_hidden_layers
    if kind == "pretrained":
        from .base import OFFLINE, model_config
        return model_config(spec).num_hidden_layers if spec in OFFLINE else None
    return nums[0] if nums else None


def _random_model(arch: str, layers: int, width: int, base: nn.Module, seed: int) -> nn.Module:
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    c = base.config
    heads = max(1, width // 64)
    common = dict(vocab_size=c.vocab_size, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id)
    if arch == "gpt2":
        cfg = GPT2Config(n_embd=width, n_layer=layers, n_head=heads, n_positions=2048, n_inner=4 * width,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **common)
    else:
        cls = LlamaConfig if arch == "llama" else Qwen2Config
        cfg = cls(hidden_size=width, intermediate_size=int(8 / 3 * width) // 8 * 8, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=2048,
                  tie_word_embeddings=True, **common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def _pretrained(spec: str) -> nn.Module:
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(spec, dtype=torch.float32)


@functools.lru_cache(maxsize=4)
def _calibration(tokenizer_dir: str, docs: tuple[str, ...]) -> torch.Tensor:
    """The pruning calibration batch, tokenised once per process (the server rebuilds every
    uploaded device's model)."""
    from transformers import AutoTokenizer

    from .prune import calibration_ids
    return calibration_ids(AutoTokenizer.from_pretrained(tokenizer_dir), docs)


def build_device_model(spec: str, base: nn.Module, calibration: tuple[str, ...] = ()) -> nn.Module:
    """A new fp32 model for ``spec`` (weights independent of ``base``'s: devices train it fully).
    ``calibration``: the documents a ``prune`` spec is calibrated on (``data.calibration_docs()``)."""
    kind, nums = parse_device_spec(spec)
    if kind == "prune" and not calibration:
        raise ValueError(f"{spec!r}: a pruned device needs calibration text (data.calibration_docs())")
    if kind == "base":
        model = copy.deepcopy(base).float()
    elif kind == "prune":
        from .base import tokenizer_source
        from .prune import prune
        model = prune(copy.deepcopy(base).float(), _calibration(tokenizer_source(base), tuple(calibration)),
                      layers=nums[0], intermediate=nums[1], hidden=nums[2] if len(nums) > 2 else None)
    elif kind.startswith("random-"):
        model = _random_model(kind[7:], nums[0], nums[1], base, seed=zlib.crc32(spec.encode()))
    else:
        from .base import OFFLINE, load_base_model, tokenizer_source
        try:
            model = load_base_model(spec)[0].float() if spec in OFFLINE else _pretrained(spec)
        except (OSError, ValueError) as e:
            raise ValueError(f"deepfusion.devices: cannot build {spec!r}: {str(e).splitlines()[0]}") from None
        # its own tokenizer where its vocabulary differs (module docstring), else the base's
        model.config.comix_tokenizer = (tokenizer_source(model) if spec in OFFLINE else spec) \
            if model.config.vocab_size != base.config.vocab_size else tokenizer_source(base)
    for p in model.parameters():
        p.requires_grad_(True)
    return model.train()
