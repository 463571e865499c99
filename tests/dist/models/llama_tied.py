"""A tiny Hugging Face Llama whose LM head is tied to its token embedding (``tie_word_embeddings``),
for the pretrained-weights tests: its file holds the embedding alone, under ``model.embed_tokens``.
An odd vocabulary (65) makes FSDP's shards of the embedding uneven (33 and 32 rows on 2 ranks)."""
from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_model(layers: int = 2, hidden: int = 32, heads: int = 4, kv_heads: int = 2, ffn: int = 64, vocab: int = 65,
                seq_len: int = 16) -> torch.nn.Module:
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab,
                         max_position_embeddings=seq_len, attn_implementation="sdpa", use_cache=False,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config)


def example_batch(batch_size: int, seq_len: int = 16, vocab: int = 65):
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}


def loss_fn(output, batch: dict) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(output.logits.float().flatten(0, 1), batch["targets"].flatten(0, 1))
