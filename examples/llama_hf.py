"""Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig``: no weights are downloaded.

The defaults are a tiny Llama for tests; Llama-3-70B's shape is

    autopar profile examples/llama_hf.py model.layers=80 model.hidden=8192 model.heads=64 \\
        model.kv_heads=8 model.ffn=28672 model.vocab=128256 model.seq_len=4096

``model.family=qwen3`` builds the same shape as Qwen3 (``Qwen3ForCausalLM``: a Llama whose
queries and keys are normalised per head).
"""
from __future__ import annotations

import torch
import transformers

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}


def build_model(layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                ffn: int = 352, vocab: int = 512, seq_len: int = 64, family: str = "llama") -> torch.nn.Module:
    config_class, model_class = FAMILIES[family]
    config = getattr(transformers, config_class)(
        head_dim=hidden // heads,
        num_hidden_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=ffn,
        vocab_size=vocab,
        max_position_embeddings=seq_len,
        attn_implementation="sdpa",
        use_cache=False,
    )
    return getattr(transformers, model_class)(config)


def example_batch(batch_size: int, seq_len: int = 64, vocab: int = 512):
    # Targets shifted here rather than inside the model (as `labels` would be), so each token's
    # target stays with it when context parallelism splits the sequence across ranks.
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss_fn(output, batch: dict) -> torch.Tensor:
    # Logits in fp32 for the loss, as the model's own labels= loss computes it.
    return torch.nn.functional.cross_entropy(output.logits.float().flatten(0, 1), batch["targets"].flatten(0, 1))
