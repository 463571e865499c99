"""Which zoo cases exist, which CI runs, and what each is expected to do.

A case id is ``<model>-<pin>`` (models and pins: tests/zoo/harness.py). Every case must train
exactly like one process unless listed here as refused (with words its reason must contain).
"""
from __future__ import annotations

from tests.zoo.harness import MODELS

TWO_RANK_PINS = ["dp2", "zero3", "tp2", "pp2", "cp2"]
# On 4 ranks, ZeRO-3 over 4 and two axes at once (data x tensor, data x pipeline, tensor x
# pipeline, data x context), so every technique runs on 4 ranks too, for a model of each kind:
# Llama and Mixtral from configs, GPT-2's Conv1D, BERT's encoder, T5's two stacks, nanoGPT's
# ModuleDict, the frozen-parameter GPT and the GPT example.
FOUR_RANK_PINS = ["zero3_dp4", "dp2_tp2", "dp2_pp2", "tp2_pp2", "dp2_cp2"]
FOUR_RANK_MODELS = ["hf_llama", "hf_mixtral", "hf_gpt2", "hf_bert", "hf_t5", "nanogpt", "frozen", "gpt"]
# Tensor parallelism at 2 and 4 on 4 ranks for the layouts written to test it (fused_layouts.py):
# fused qkv cut into unequal parts and a fused gate-up, NeoX's interleaved qkv, global-size views.
TP_LAYOUT_PINS = ["dp2_tp2", "tp4"]
TP_LAYOUT_MODELS = ["fused_qkv", "neox_qkv", "global_views"]
# Grouped-query attention with more TP ranks than key/value heads (2 of them at tp=4: each rank
# computes its group's head, autopar/solver/tp_kv_groups.py).
GQA_TP4_MODELS = ["hf_llama", "hf_stablelm"]
# A masked LM (labels of -100 outside the masked tokens) with the batch split two ways at once:
# each part counts its own tokens, weighed by counts (autopar/trace/loss_tokens.py).
TOKEN_LOSS_PINS = ["dp2_pp2", "dp2_cp2"]
ALL_CASES = ([f"{model}-{pin}" for model in MODELS for pin in TWO_RANK_PINS]
             + [f"{model}-{pin}" for model in FOUR_RANK_MODELS for pin in FOUR_RANK_PINS]
             + [f"{model}-{pin}" for model in TP_LAYOUT_MODELS for pin in TP_LAYOUT_PINS]
             + [f"{model}-tp4" for model in GQA_TP4_MODELS]
             + [f"hf_bert_mlm-{pin}" for pin in TOKEN_LOSS_PINS]
             # What `autopar compile` hands a new user: nothing pinned, on 2 ranks.
             + [f"{model}-first" for model in MODELS])

# CI's subset (about a minute on two cores): the nanoGPT layout split by the batch and by layers in
# one spawn of ranks, the frozen-parameter model under ZeRO-3, and context parallelism refused
# where it would train something else (Hugging Face's Llama shifting its labels inside the model;
# the eager Llama and the encoder-decoder are refused alike in the full zoo).
CI_CASES = {"nanogpt-dp2", "nanogpt-pp2", "frozen-zero3", "hf_llama_labels-cp2"}

# Refused at compile, with words the one-paragraph reason contains. (Splits codegen cannot run are
# no longer refusals: the planner keeps them out of the search, autopar.solver.tp_legality, and
# those modules run replicated.)
REFUSED: dict[str, str] = {
    'hf_gemma2-cp2': 'would train a different model',
    'hf_falcon-cp2': 'would train a different model',
    'hf_opt-cp2': 'would train a different model',
    'hf_bloom-cp2': 'would train a different model',
    'hf_gptj-cp2': 'would train a different model',
    'hf_llama_labels-cp2': 'would train a different model',
    'hf_llama_eager-cp2': 'would train a different model',
    'hf_t5-cp2': 'would train a different model',
    'hf_vit-cp2': 'position_ids/positions/pos argument',
    'hf_whisper-cp2': 'position_ids/positions/pos argument',
    'encdec-cp2': 'would train a different model',
    'frozen-cp2': 'position_ids/positions/pos argument',
    'cnn-cp2': 'position_ids/positions/pos argument',
    'hf_t5-dp2_cp2': 'would train a different model',
    'frozen-dp2_cp2': 'position_ids/positions/pos argument',
    # RoBERTa numbers its positions from the tokens, past its padding index; CP would feed plain
    # 0..S-1 (the proof's check measured a loss 0.00685 off): refused by the sequence analysis,
    # before pricing, also where no numerical check runs (GPU clusters).
    'hf_roberta-cp2': 'positions numbered from the tokens',
    # CLIP's contrastive loss compares every text with every image of the batch: split across
    # ranks (dp, ZeRO), into micro-batches (pp) or along the sequence (cp, pooled at the
    # end-of-text token), each rank would train on other negatives, so the proof's check refuses
    # it (its scalar logit_scale, which FSDP cannot shard, now stays whole with its gradient
    # averaged).
    'hf_clip-dp2': 'loss differs from one process',
    'hf_clip-zero3': 'loss differs from one process',
    'hf_clip-cp2': 'loss differs from one process',
    # Under pp2 its loss reads the image tower's projection, so only the traced split could cut
    # it (the loss of each micro-batch would not be the batch's anyway); with each tower's blocks
    # layers of their own, the planner's pp2 plans recompute some blocks selectively, which the
    # traced split cannot run, so code generation refuses them (measured: gpipe, 1f1b and
    # interleaved v=2, each with none/selective recomputation).
    'hf_clip-pp2': 'the traced split supports neither tensor parallelism nor recomputation',
    # T5's shared embedding sits outside every layer, so its stages can only be cut from an
    # exported graph, which runs no tensor parallelism: every tp2 x pp2 plan is refused at code
    # generation (measured: interleaved v=2, gpipe, 1f1b).
    'hf_t5-tp2_pp2': 'the traced split supports neither tensor parallelism nor recomputation',
    # The ResNet's BatchNorm normalises over the batch (trace/batch.py): refused by the planner
    # before pricing, where the proof's check once measured a loss 0.0783 off. A pipeline needs
    # more than the one micro-batch batch statistics allow.
    'cnn-dp2': 'would train a different model: it splits the batch',
    'cnn-zero3': 'would train a different model: it splits the batch',
    'cnn-pp2': 'the whole batch in one micro-batch',
    # The LSTM takes positions, yet its recurrence reads every earlier one: refused at profile,
    # where the proof's check once let it pass by a hair (relative 1.2e-5 against 1e-5).
    'recurrent-cp2': 'a recurrence along the sequence',
    # One LSTM module holds both its layers: a single block, nothing for a second stage.
    'recurrent-pp2': 'needs more pipeline stages than the model',
    # (its tp2: the LSTM's weights are 89% of the linear parameters; refused below.)
    # Models that number positions inside forward (no positions argument to shard by).
    'value_dependent-cp2': 'position_ids/positions/pos argument',
    'hf_wav2vec2_ctc-cp2': 'position_ids/positions/pos argument',
    'untraceable-cp2': 'position_ids/positions/pos argument',
    'hf_convnext-cp2': 'position_ids/positions/pos argument',
    'hf_swin-cp2': 'position_ids/positions/pos argument',
    # Sequence mixing the analysis finds at profile: Mamba's causal convolution, ModernBERT's
    # sliding-window layers; BART shifts its labels into the decoder's inputs inside forward.
    'hf_mamba-cp2': 'a convolution over the sequence',
    'hf_modernbert-cp2': 'a sliding window or local attention',
    'hf_bart-cp2': 'would train a different model',
    # DeBERTa's disentangled attention computes its own softmax over the sequence.
    'hf_deberta_v2-cp2': 'attention computed outside scaled_dot_product_attention',
    # Gemma-3's sliding-window layers; LFM2's short causal convolution beside its attention.
    'hf_gemma3-cp2': 'a sliding window or local attention',
    'hf_lfm2-cp2': 'a convolution over the sequence',
    # Eager-only attention (no SDPA path in their Hugging Face code): MPT's ALiBi, GPT-Neo, XGLM;
    # gpt-oss's softmax runs over the scores and a sink logit per head (S + 1 columns).
    'hf_mpt-cp2': 'attention computed outside scaled_dot_product_attention',
    'hf_gpt_neo-cp2': 'attention computed outside scaled_dot_product_attention',
    'hf_xglm-cp2': 'attention computed outside scaled_dot_product_attention',
    'hf_gpt_oss-cp2': 'attention computed outside scaled_dot_product_attention',
    'hf_cohere2-cp2': 'a sliding window or local attention',
}

# A pinned tp under which the model's code lets less than half of the blocks' linear parameters
# split is refused
# (autopar/solver/tp_coverage.py; shares from `python -m tests.zoo.coverage`, TABLE.md): the
# encoder-decoder's nn.MultiheadAttention (40%). (OPT's and Whisper's attention, viewing by global
# head counts, split as DTensor regions: 99%; Phi-3's fused qkv_proj and gate_up_proj split as
# their parts: 100%.)
TP_COVERAGE_REFUSED = 'tensor parallelism could split at most'
# Mamba's mixer is no linear map: nothing of its blocks splits (0%).
REFUSED.update({case: TP_COVERAGE_REFUSED for case in ("encdec-tp2", "recurrent-tp2", "hf_mamba-tp2")})

# Known to fail (measured; strict xfail, so a fix shows up as XPASS and must move the case out).
KNOWN_FAILURES: dict[str, str] = {}
