"""Hugging Face architectures built from their configs at toy size (no weights): one model.py
for the whole zoo, the architecture chosen by ``model.arch=<name>``.

Each is used the way its model card shows, except that dropout is off (a sharded run draws
different dropout masks, so no equality with one process could be checked) and causal models'
targets are shifted in ``example_batch`` (the contract's advice). ``arch=llama_labels`` keeps
the Hugging Face habit of passing ``labels=`` and letting the model shift them.
"""
from __future__ import annotations

import torch
import transformers as hf
from torch.nn import functional as F

HIDDEN, HEADS, VOCAB = 32, 4, 64
MASK_TOKEN = 0  # masked LMs' [MASK] (tokens are drawn from 3 up)

# Causal language models: (config class, model class, config fields beyond the common ones).
_CAUSAL = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, head_dim=8)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_key_value_heads=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, pad_token_id=0)),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, head_dim=8)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(num_key_value_heads=2, intermediate_size=64, head_dim=8, sliding_window=8)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=HIDDEN, n_head=HEADS, n_positions=64,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(intermediate_size=64)),
    "falcon": ("FalconConfig", "FalconForCausalLM", dict(new_decoder_architecture=False, multi_query=True)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(ffn_dim=64, word_embed_proj_dim=HIDDEN, max_position_embeddings=64)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(intermediate_size=64, resid_pdrop=0.0, embd_pdrop=0.0)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(n_head=HEADS, n_layer=2)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(n_embd=HIDDEN, n_head=HEADS, rotary_dim=4, n_positions=64,
                                                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16,
                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    # Fused query_key_value viewed by global sizes, norms over each head, rotary on part of a head.
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(intermediate_size=64)),
    # A state-space model: no attention; a causal convolution and a scan along the sequence.
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(state_size=8, expand=2, conv_kernel=4)),
    # Experts looped over by `nonzero` of a one-hot padded by a class no token takes.
    "dbrx": ("DbrxConfig", "DbrxForCausalLM", dict(d_model=HIDDEN, n_heads=HEADS, n_layers=2, max_seq_len=64,
                                                   attn_config={"kv_n_heads": 2, "rope_theta": 10000.0,
                                                                "clip_qkv": 8.0},
                                                   ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4,
                                                               "moe_top_k": 2},
                                                   resid_pdrop=0.0, emb_pdrop=0.0)),
    # Held out until the 2026-11-28 run (tests/zoo/TABLE.md): CodeGen's qkv_proj fused in mp_num
    # groups of (q, v, k) parts; GPT-BigCode's multi-query c_attn (one key/value head fused beside
    # the queries); Qwen3-MoE, head norms beside experts whose grouped GEMM wants bf16 on fake tensors.
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(n_embd=HIDDEN, n_head=HEADS, rotary_dim=4, n_positions=64,
                                                           n_ctx=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                    dict(n_embd=HIDDEN, n_head=HEADS, n_positions=64, multi_query=True, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_key_value_heads=2, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                       num_experts_per_tok=2, head_dim=8)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(num_key_value_heads=HEADS, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                         kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)),
    # Held out until the 2026-11-28 probe (tests/zoo/TABLE.md): Starcoder2 (biased projections, plain
    # LayerNorm), Cohere (parallel attention and MLP, logit scale), OLMo-2 (norms over the whole
    # query and key projections), Gemma-3 (head norms, sliding and global layers), Nemotron (squared
    # ReLU, LayerNorm1P), GLM-4 (fused gate_up_proj, sandwich norms), GraniteMoE and OLMoE (experts),
    # SmolLM3, EXAONE-4 and LFM2 (short convolutions beside attention).
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64,
                                                                   residual_dropout=0.0, embedding_dropout=0.0)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, head_dim=8,
                                                            sliding_window=8)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, head_dim=8,
                                                   pad_token_id=0)),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(num_key_value_heads=2, intermediate_size=64,
                                                                   num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_key_value_heads=2, intermediate_size=64, num_experts=4,
                                                     num_experts_per_tok=2)),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64,
                                                           pad_token_id=0)),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64,
                                                   layer_types=["conv", "full_attention"])),
    # Probed 2026-11-28, second round: MPT (ALiBi biases, no positions), GPT-Neo (local and global
    # layers), BioGPT and XGLM (learned or sinusoidal positions offset by the padding index),
    # DiffLlama (differential attention), DeepSeek-V2 (latent attention, experts), JetMoE
    # (mixtures of attention heads and of MLPs), ERNIE-4.5, Cohere2 (sliding and global layers),
    # gpt-oss (attention sinks, experts as 3-d parameters), Apertus (xIELU, head norms), Arcee (ReLU^2).
    "mpt": ("MptConfig", "MptForCausalLM", dict(d_model=HIDDEN, n_heads=HEADS, n_layers=2, max_seq_len=64,
                                                expansion_ratio=2, resid_pdrop=0.0, emb_pdrop=0.0,
                                                attn_config={"attn_pdrop": 0, "alibi": True})),
    "gpt_neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(num_layers=2, num_heads=HEADS, intermediate_size=64,
                                                         attention_types=[[["global", "local"], 1]], window_size=8,
                                                         resid_dropout=0.0, embed_dropout=0.0)),
    "biogpt": ("BioGptConfig", "BioGptForCausalLM", dict(intermediate_size=64, layerdrop=0.0, activation_dropout=0.0)),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(d_model=HIDDEN, attention_heads=HEADS, num_layers=2, ffn_dim=64,
                                                   layerdrop=0.0, activation_dropout=0.0)),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(num_key_value_heads=HEADS, intermediate_size=64, moe_intermediate_size=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                         kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_shared_experts=1)),
    "jetmoe": ("JetMoeConfig", "JetMoeForCausalLM", dict(num_key_value_heads=2, kv_channels=8, intermediate_size=64,
                                                        num_local_experts=4, num_experts_per_tok=2)),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64,
                                                              head_dim=8)),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", dict(num_key_value_heads=2, intermediate_size=64,
                                                           sliding_window=8)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_key_value_heads=2, intermediate_size=16, head_dim=8,
                                                         num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                                         layer_types=["sliding_attention", "full_attention"],
                                                         rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(num_key_value_heads=2, intermediate_size=64)),
}
# Architectures whose Hugging Face code has no SDPA path: they run their eager softmax(QK^T).
_EAGER_ONLY = {"bloom", "gemma2", "gptj", "mamba", "gpt_neo", "xglm", "gpt_oss", "mpt"}
CAUSAL_ARCHS = sorted(_CAUSAL) + ["llama_labels", "llama_eager"]
OTHER_ARCHS = ["bert", "roberta", "bert_mlm", "modernbert", "deberta_v2", "t5", "bart", "vit", "swin", "convnext",
               "whisper", "clip", "wav2vec2_ctc"]
ARCHS = CAUSAL_ARCHS + OTHER_ARCHS


def _common(layers: int, seq_len: int) -> dict:
    """Fields most configs share; each class ignores the ones it does not know."""
    return dict(num_hidden_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=VOCAB,
                max_position_embeddings=max(64, seq_len), use_cache=False, tie_word_embeddings=False,
                hidden_dropout=0.0, attention_dropout=0.0, hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0, dropout=0.0, n_layer=layers, bos_token_id=1, eos_token_id=2)


def build_model(arch: str = "llama", layers: int = 2, seq_len: int = 16) -> torch.nn.Module:
    common = _common(layers, seq_len)
    name = arch.removesuffix("_labels").removesuffix("_eager")
    if name in _CAUSAL:
        config_cls, model_cls, extra = _CAUSAL[name]
        config = getattr(hf, config_cls)(**{**common, **extra})
        config._attn_implementation = "eager" if arch.endswith("_eager") or name in _EAGER_ONLY else "sdpa"
        return getattr(hf, model_cls)(config)
    if arch in ("bert", "roberta", "bert_mlm"):
        config_cls = hf.RobertaConfig if arch == "roberta" else hf.BertConfig
        config = config_cls(**common, intermediate_size=64, pad_token_id=1)
        return (hf.RobertaForMaskedLM if arch == "roberta" else hf.BertForMaskedLM)(config)
    if arch == "modernbert":  # a masked LM whose layers alternate global and sliding-window attention
        config = hf.ModernBertConfig(**common, intermediate_size=64, local_attention=8, global_attn_every_n_layers=2,
                                     pad_token_id=1, embedding_dropout=0.0, mlp_dropout=0.0)
        return hf.ModernBertForMaskedLM(config)
    if arch == "deberta_v2":  # a masked LM with disentangled relative attention (v3's settings), embeddings untied:
        # the head's own bias beside its decoder's is read by nothing (a traced pipeline stage must still carry it)
        config = hf.DebertaV2Config(**common, intermediate_size=64, relative_attention=True, position_buckets=8,
                                    pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm", share_att_key=True,
                                    position_biased_input=False, max_relative_positions=-1, pad_token_id=1)
        return hf.DebertaV2ForMaskedLM(config)
    if arch == "t5":
        config = hf.T5Config(vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=layers, num_heads=HEADS,
                             dropout_rate=0.0, use_cache=False, decoder_start_token_id=0)
        return hf.T5ForConditionalGeneration(config)
    if arch == "bart":  # its logits get a bias buffer added after the head; labels= makes the decoder's inputs
        config = hf.BartConfig(vocab_size=VOCAB, d_model=HIDDEN, encoder_layers=layers, decoder_layers=layers,
                               encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=64,
                               decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                               activation_dropout=0.0, use_cache=False, pad_token_id=1, bos_token_id=0,
                               eos_token_id=2, decoder_start_token_id=2)
        return hf.BartForConditionalGeneration(config)
    if arch == "vit":
        config = hf.ViTConfig(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                              intermediate_size=64, image_size=16, patch_size=4, num_labels=10,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return hf.ViTForImageClassification(config)
    if arch == "swin":  # windowed attention with a relative position bias table of (2 x 4 - 1)^2 = 49 rows
        config = hf.SwinConfig(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                               window_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               drop_path_rate=0.0)
        return hf.SwinForImageClassification(config)
    if arch == "convnext":  # its __init__ reads a drop-path schedule's values (linspace(...).tolist())
        config = hf.ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10,
                                   drop_path_rate=0.0, image_size=16)
        return hf.ConvNextForImageClassification(config)
    if arch == "whisper":
        config = hf.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=layers, decoder_layers=layers,
                                  encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, d_model=HIDDEN,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                                  max_target_positions=max(64, seq_len), use_cache=False, dropout=0.0,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        return hf.WhisperForConditionalGeneration(config)
    if arch == "clip":
        text = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=HIDDEN,
                    intermediate_size=64, num_hidden_layers=layers, num_attention_heads=HEADS,
                    max_position_embeddings=max(64, seq_len))
        vision = dict(hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=HEADS,
                      image_size=16, patch_size=4)
        return hf.CLIPModel(hf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16))
    if arch == "wav2vec2_ctc":  # speech with a CTC head: its loss checks labels.max() and masked_selects them
        config = hf.Wav2Vec2Config(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers,
                                   num_attention_heads=HEADS, intermediate_size=64, conv_dim=(16, 16),
                                   conv_stride=(4, 2), conv_kernel=(8, 4), num_conv_pos_embeddings=8,
                                   num_conv_pos_embedding_groups=4, hidden_dropout=0.0, attention_dropout=0.0,
                                   activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
                                   layerdrop=0.0, mask_time_prob=0.0, pad_token_id=0, ctc_loss_reduction="mean")
        return hf.Wav2Vec2ForCTC(config)
    raise ValueError(f"unknown arch {arch!r}; one of {', '.join(ARCHS)}")


def example_batch(batch_size: int, arch: str = "llama", seq_len: int = 16) -> dict:
    tokens = torch.randint(3, VOCAB, (batch_size, seq_len + 1))
    if arch.endswith("_labels"):
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, :-1]}
    if arch in CAUSAL_ARCHS:
        return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}
    if arch in ("bert", "roberta"):
        return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}
    if arch in ("bert_mlm", "modernbert", "deberta_v2"):  # masked LMs: a quarter of the tokens masked, the rest -100
        inputs, masked = tokens[:, :-1], torch.rand(batch_size, seq_len) < 0.25
        return {"input_ids": inputs.masked_fill(masked, MASK_TOKEN), "labels": inputs.masked_fill(~masked, -100)}
    if arch == "bart":
        return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:].contiguous()}
    if arch == "t5":
        return {"input_ids": tokens[:, :-1], "decoder_input_ids": tokens[:, :-1], "targets": tokens[:, 1:]}
    if arch in ("vit", "swin", "convnext"):
        return {"pixel_values": torch.randn(batch_size, 3, 16, 16), "targets": torch.randint(0, 10, (batch_size,))}
    if arch == "whisper":
        return {"input_features": torch.randn(batch_size, 8, 32), "decoder_input_ids": tokens[:, :-1],
                "targets": tokens[:, 1:]}
    if arch == "clip":
        return {"input_ids": tokens[:, :-1], "pixel_values": torch.randn(batch_size, 3, 16, 16)}
    if arch == "wav2vec2_ctc":  # 2 frames per label at most (8 of audio per frame); -100 pads shorter transcripts
        labels = torch.randint(3, VOCAB, (batch_size, seq_len // 2))
        lengths = torch.randint(seq_len // 4, seq_len // 2 + 1, (batch_size, 1))
        labels = labels.masked_fill(torch.arange(seq_len // 2) >= lengths, -100)
        return {"input_values": torch.randn(batch_size, seq_len * 8), "labels": labels}
    raise ValueError(f"unknown arch {arch!r}")


def loss_fn(output, batch: dict) -> torch.Tensor:
    if "labels" in batch:
        return output.loss
    if "targets" not in batch:  # CLIP: the symmetric contrastive loss over the batch
        logits = output.logits_per_text.float()
        matches = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, matches) + F.cross_entropy(logits.t(), matches)) / 2
    logits = output.logits.float()
    return F.cross_entropy(logits.flatten(0, -2), batch["targets"].flatten())
