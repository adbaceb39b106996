import os

# Tests never touch the network: a hub lookup must fail at once, not wait on DNS.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def smollm2_block():
    """One transformer block at SmolLM2-135M's widths, seeded (tiny-llama's 32-wide layers are all
    per-layer overhead): what the quantised bases' storage is measured on."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                                        num_attention_heads=9, num_key_value_heads=3))
