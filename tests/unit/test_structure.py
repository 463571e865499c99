"""Model structure the way authors write it: which container holds the blocks, and what the
traced step says about splitting the sequence (context parallelism)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.trace.layers import find_block_containers

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"


def test_nanogpt_blocks_are_found_inside_its_module_dict():
    """nanoGPT keeps its blocks in ``transformer.h`` beside the embeddings in a ModuleDict that
    holds more parameters than the blocks alone; the blocks, not the ModuleDict's members, are
    the layers."""
    profile = profile_model(load_model_file(ZOO / "nanogpt.py"), {"layers": 3}, micro_batch_size=1, precision="fp32")
    assert profile.block_containers == ["transformer.h"]
    assert [layer.name for layer in profile.layers] == [
        "transformer.wte", "transformer.wpe", "transformer.h.0", "transformer.h.1", "transformer.h.2",
        "transformer.ln_f", "lm_head"]
    assert [layer.name for layer in profile.blocks] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]


def test_a_mixed_container_serves_only_when_no_stack_exists():
    """A Sequential of different layers (an MLP) is the container when nothing repeats."""
    mlp = nn.Module()
    mlp.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    assert find_block_containers(mlp) == ["net"]
    mlp.stack = nn.ModuleList(nn.Linear(2, 2) for _ in range(2))  # fewer parameters, but uniform
    assert find_block_containers(mlp) == ["stack"]


def test_frozen_parameters_are_traced_without_gradients():
    """A fine-tuning set-up (frozen embedding and first block, a frozen positional table) is
    profiled; the frozen embedding gets no backward op, the trainable blocks do."""
    profile = profile_model(load_model_file(ZOO / "frozen.py"), {}, micro_batch_size=1, precision="fp32")
    real = load_model_file(ZOO / "frozen.py").build_model()
    assert profile.param_count == sum(p.numel() for p in real.parameters())
    backward = [op for op in profile.ops if op.phase == "backward"]
    assert not [op for op in backward if "embedding" in op.target]
    assert any(op.layer == "blocks.1" and "mm" in op.target for op in backward)


HF_ZOO = ZOO / "hf_zoo.py"


@pytest.mark.parametrize("arch,expected", [
    ("llama", None),
    ("llama_labels", "a shift along the sequence (e.g. labels shifted inside the model) (constant_pad_nd in "
                     "the root module's own forward)"),
    ("llama_eager", "attention computed outside scaled_dot_product_attention (a softmax over the sequence) "
                    "(_softmax in module 'model.layers.0.self_attn')"),
    ("t5", "attention computed outside scaled_dot_product_attention (a softmax over the sequence) "
           "(_safe_softmax in module 'encoder.block.0.layer.0.SelfAttention')"),
    # RoBERTa counts positions past its padding index from the tokens (an integer cumsum into the
    # position table); Llama's integer cumsum (mask bookkeeping) indexes no embedding.
    ("roberta", "positions numbered from the tokens (an integer cumulative op along the sequence that indexes an "
                "embedding, where context parallelism would feed plain positions 0..S-1) (cumsum in module "
                "'roberta.embeddings')"),
    ("bert", None),
    # gpt-oss's attention sinks: a learned logit per head beside the S x S scores (softmax over S + 1).
    ("gpt_oss", "attention computed outside scaled_dot_product_attention (a softmax over the sequence) "
                "(_softmax in module 'model.layers.0.self_attn')"),
])
def test_ops_mixing_sequence_positions_are_found(arch, expected):
    """Hugging Face's in-model label shift and eager attention (also with sink logits concatenated
    beside the scores) read other positions, and RoBERTa's positions numbered from its tokens would
    not be the plain ones CP feeds; SDPA attention (which CP replaces) and position bookkeeping on
    integer ids do not count."""
    profile = profile_model(load_model_file(HF_ZOO), {"arch": arch}, micro_batch_size=1, precision="fp32")
    assert next(iter(profile.sequence_mixers), None) == expected


def test_a_vocabulary_as_long_as_the_sequence_is_not_attention():
    """The loss's log-softmax over a vocabulary of exactly S entries has S x S-shaped logits at one
    sample per micro-batch; it runs outside the model, where no attention is, so CP stays open."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    profile = profile_model(load_model_file(examples / "llama_hf.py"),
                            {"layers": 1, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256,
                             "seq_len": 256}, micro_batch_size=1, precision="fp32")
    assert profile.sequence_mixers == []


def test_a_model_without_a_token_sequence_is_refused_cp_before_planning():
    """An image classifier's batch holds no sequence of tokens: the profile says so, and a pinned
    cp is refused by the pins' check, before any search or code generation (it once reached
    codegen inside compile's proof), naming the missing position argument too."""
    from autopar.config import PlanPins, SolverConfig
    from autopar.errors import UserError
    from autopar.solver.planner import Planner
    from cost_models.step import TrainSpec
    from cost_models.topology import ClusterConfig, ClusterSpec

    examples = Path(__file__).resolve().parents[2] / "examples"
    profile = profile_model(load_model_file(examples / "cnn.py"), {"width": 8, "blocks": 2, "image": 16},
                            micro_batch_size=2, precision="fp32")
    assert profile.tokens_per_sample is None
    assert profile.sequence_mixers == ["no sequence of tokens in the batch to shard, and no "
                                       "position_ids/positions/pos argument in forward"]
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=2))
    planner = Planner(profile, cluster, TrainSpec(global_batch_size=8, precision="fp32", optimizer="adam"),
                      SolverConfig(), PlanPins(cp=2))
    with pytest.raises(UserError, match="plan.cp=2 has no sequence to split") as refusal:
        planner._check_pins()
    assert "position_ids/positions/pos argument" in str(refusal.value) and "plan.cp=1" in refusal.value.fix


def test_a_model_that_numbers_positions_itself_blocks_cp():
    """Without a position_ids/positions/pos argument the generated code cannot feed each sequence
    shard its global positions: the frozen GPT slices its table from 0, and an arange would
    number every shard from 0 (the MoE test model's, named). The profile says so, so the planner
    never offers CP for them (codegen would refuse it); models taking positions (the GPT
    example's `positions`, nanoGPT's `pos`) are not blocked."""
    frozen = profile_model(load_model_file(ZOO / "frozen.py"), {}, micro_batch_size=1, precision="fp32")
    assert frozen.sequence_mixers == ["no position_ids/positions/pos argument in forward to give each sequence shard "
                                      "its global positions"]
    moe = profile_model(load_model_file(Path(__file__).resolve().parents[1] / "moe_model.py"),
                        dict(layers=1, hidden=32, heads=2, seq_len=16, vocab=64), micro_batch_size=2, precision="fp32")
    assert moe.sequence_mixers[-1] == ("no position_ids/positions/pos argument in forward to give each sequence shard "
                                       "its global positions, and an arange over the sequence numbers every shard "
                                       "from 0 (arange in the root module's own forward)")
    nanogpt = profile_model(load_model_file(ZOO / "nanogpt.py"), {}, micro_batch_size=1, precision="fp32")
    gpt = profile_model(load_model_file(Path(__file__).resolve().parents[2] / "examples" / "gpt.py"),
                        {"layers": 1, "hidden": 32, "heads": 2, "seq_len": 16, "vocab": 64}, micro_batch_size=1,
                        precision="fp32")
    assert nanogpt.sequence_mixers == [] and gpt.sequence_mixers == []


def test_a_per_sequence_statistic_blocks_cp():
    """A sequence-wise MoE auxiliary loss takes each sequence's mean router probability
    (probs.mean(1) over [batch, seq, experts]): on a shard it would be the shard's mean, so the
    loss would differ. A norm's mean over the hidden dim (Llama's RMSNorm) reads one position and
    is not flagged (test_ops_mixing_sequence_positions_are_found)."""
    moe = profile_model(load_model_file(Path(__file__).resolve().parents[1] / "moe_model.py"),
                        dict(layers=1, hidden=32, heads=2, seq_len=16, vocab=64), micro_batch_size=2, precision="fp32")
    assert moe.sequence_mixers[0] == "a reduction over the sequence (a per-sequence statistic) (mean in module " \
                                     "'blocks.0.moe')"


_SEQUENCE_MODEL = """
import torch
from torch import nn
from torch.nn import functional as F

class Model(nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.embed = nn.Embedding(64, 24)
        self.mixer_kind = mixer
        self.rnn = {"lstm": nn.LSTM(24, 24, batch_first=True), "gru": nn.GRU(24, 24, batch_first=True)}.get(mixer)
        self.qkv = nn.Linear(24, 72)
        self.head = nn.Linear(24, 64)

    def forward(self, tokens, positions=None):
        x = self.embed(tokens)
        if self.rnn is not None:
            x, _ = self.rnn(x)
        elif self.mixer_kind == "scan":  # a recurrence written step by step
            state, steps = torch.zeros_like(x[:, 0]), []
            for step in x.unbind(1):
                state = 0.5 * state + step
                steps.append(state)
            x = torch.stack(steps, 1)
        elif self.mixer_kind == "first_token":  # pooled at the first position
            x = x[:, 0:1] * x  # (a slice, not a select: the same position for every rank's tokens)
            x = x + x.select(1, 0).unsqueeze(1)
        q, k, v = self.qkv(x).split(24, dim=-1)  # a fused projection cut along its features: no mixing
        return self.head(q + k + v)

def build_model(mixer="lstm"):
    return Model(mixer)

def example_batch(batch_size, mixer="lstm"):
    tokens = torch.randint(0, 64, (batch_size, 17))
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "positions": torch.arange(16).expand(batch_size, 16)}

def loss_fn(output, batch):
    return F.cross_entropy(output.flatten(0, 1), batch["targets"].flatten())
"""


@pytest.mark.parametrize("mixer,expected", [
    ("lstm", "a recurrence along the sequence (an RNN, LSTM or GRU)"),
    ("gru", "a recurrence along the sequence (an RNN, LSTM or GRU)"),
    ("scan", "the sequence cut into positions (a loop over them, or one position read for the whole sequence)"),
    ("first_token", "the sequence cut into positions (a loop over them, or one position read for the whole "
                    "sequence)"),
    ("none", None),
])
def test_recurrences_and_positions_cut_out_block_cp(tmp_path, mixer, expected):
    """An LSTM or GRU (one fused ATen op on the CPU, or a cell per step), a scan written step by
    step and a token pooled at one position read other positions than their own; a fused
    projection split along its features (a dim that is not the sequence) does not."""
    path = tmp_path / "model.py"
    path.write_text(_SEQUENCE_MODEL)
    profile = profile_model(load_model_file(path), {"mixer": mixer}, micro_batch_size=2, precision="fp32")
    if expected is None:
        assert profile.sequence_mixers == []
    else:
        assert any(found.startswith(expected + " (") for found in profile.sequence_mixers), profile.sequence_mixers


@pytest.mark.parametrize("mixer", ["lstm", "gru"])
def test_a_recurrent_layer_is_priced_by_its_weights(tmp_path, mixer):
    """An LSTM (4 gates) and a GRU (3), 24 features in and out, over 2 x 16 tokens: 2 FLOPs per
    weight per token forward, whether the CPU runs the layer as one fused op (fp32: mkldnn's, which
    has no formula in torch) or as a cell per step."""
    path = tmp_path / "model.py"
    path.write_text(_SEQUENCE_MODEL)
    profile = profile_model(load_model_file(path), {"mixer": mixer}, micro_batch_size=2, precision="fp32")
    gates = {"lstm": 4, "gru": 3}[mixer]
    assert profile.layer("rnn").flops_forward == 2 * (2 * 16) * gates * 24 * (24 + 24)
    assert profile.layer("rnn").flops_backward >= profile.layer("rnn").flops_forward


_WINDOWED = """
import torch
import transformers as hf
from torch.nn import functional as F

def build_model(window=4):
    config = hf.MistralConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=64, vocab_size=64, max_position_embeddings=64, use_cache=False,
                              sliding_window=window)
    config._attn_implementation = "sdpa"
    return hf.MistralForCausalLM(config)

def example_batch(batch_size, window=4):
    tokens = torch.randint(3, 64, (batch_size, 17))
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:],
            "position_ids": torch.arange(16).expand(batch_size, 16)}

def loss_fn(output, batch):
    return F.cross_entropy(output.logits.flatten(0, -2), batch["targets"].flatten())
"""


@pytest.mark.parametrize("window,blocked", [(4, True), (64, False)])
def test_a_sliding_window_mask_blocks_cp_at_profile(tmp_path, window, blocked):
    """Hugging Face passes SDPA a mask built from the positions: evaluated on the positions CP
    feeds (0..S-1), a window of 4 over 16 tokens is no causal mask, so CP is refused at profile
    (the generated attention would refuse it only when run); a window longer than the sequence
    is the causal mask."""
    path = tmp_path / "model.py"
    path.write_text(_WINDOWED)
    profile = profile_model(load_model_file(path), {"window": window}, micro_batch_size=1, precision="fp32")
    expected = ["attention with a mask other than the causal one (a sliding window or local attention) "
                "(_scaled_dot_product_flash_attention_for_cpu in module 'model.layers.0.self_attn')"]
    assert profile.sequence_mixers == (expected if blocked else [])


def test_torch_multihead_attention_counts_as_mixing():
    """nn.TransformerEncoderLayer calls the attention kernel from C++, past the replaced function."""
    profile = profile_model(load_model_file(ZOO / "encdec.py"), {}, micro_batch_size=1, precision="fp32")
    assert profile.sequence_mixers[0].startswith("attention inside nn.MultiheadAttention")
    assert "module 'encoder.0.self_attn'" in profile.sequence_mixers[0]


def test_planner_never_picks_cp_and_refuses_a_cp_pin_naming_the_op():
    """For a model with eager attention: unpinned, no candidate has cp > 1 (on a cluster and
    sequence where the same model with SDPA attention gets cp options); pinned, one paragraph
    names the op and module."""
    from autopar.config import PlanPins, SolverConfig
    from autopar.errors import UserError
    from autopar.solver.planner import Planner
    from autopar.solver.space import ModelShape, enumerate_candidates
    from cost_models.step import TrainSpec
    from cost_models.topology import ClusterConfig, ClusterSpec

    def cp_degrees(arch: str) -> set[int]:
        profile = profile_model(load_model_file(HF_ZOO), {"arch": arch}, micro_batch_size=1, precision="fp32")
        shape = ModelShape.from_profile(profile)
        return {c.cp for c in enumerate_candidates(shape, 4, 4, 8, SolverConfig(), PlanPins())}, profile

    sdpa, _ = cp_degrees("llama")
    eager, profile = cp_degrees("llama_eager")
    assert sdpa >= {1, 2} and eager == {1}
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=2))
    with pytest.raises(UserError) as refusal:
        Planner(profile, cluster, TrainSpec(global_batch_size=8, precision="fp32", optimizer="adam"),
                SolverConfig(), PlanPins(cp=2)).run()
    assert "plan.cp=2 would train a different model" in str(refusal.value)
    assert "(_softmax in module 'model.layers.0.self_attn')" in str(refusal.value)
    assert "pin plan.cp=1" in refusal.value.fix
    assert "softmax(QK^T)" in refusal.value.fix and "labels=" not in refusal.value.fix  # the one remedy that applies
    from autopar.report.document import sequence_notes
    assert "(_softmax in module 'model.layers.0.self_attn')" in sequence_notes(profile)[0]


TRUNC_NORMAL_MODEL = '''
import torch
import torch
from torch import nn

def build_model():
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    for layer in model:
        nn.init.trunc_normal_(layer.weight, std=0.02)
    return model

def example_batch(batch_size):
    return torch.randn(batch_size, 8)
'''


def test_trunc_normal_init_builds_on_fake_tensors(tmp_path):
    """nn.init.trunc_normal_ (ViT, most vision models) branches on sampled values; planning
    builds the model on fake tensors all the same, and a real build still truncates."""
    from tests.conftest import write_model_file

    model_file = load_model_file(write_model_file(tmp_path, TRUNC_NORMAL_MODEL))
    profile = profile_model(model_file, {}, micro_batch_size=2, precision="fp32")
    assert profile.param_count == 8 * 8 + 8 + 8 * 2 + 2
    weight = torch.empty(1000)
    nn.init.trunc_normal_(weight, std=1.0, a=-0.5, b=0.5)
    assert weight.abs().max() <= 0.5 and weight.std() > 0.2


def test_tp_input_layouts_cover_every_positional_argument():
    """A Hugging Face BERT layer is called with (hidden_states, attention_mask, ...): torch's
    PrepareModuleInput wants one layout per positional input, the extra ones left alone."""
    from autopar.codegen.model_facts import inspect_model
    from autopar.codegen.tp_plan import _input_layout_args

    facts = inspect_model(HF_ZOO, {"arch": "bert"})
    layer = "bert.encoder.layer.0"
    assert facts.modules[layer].positional_inputs == 3
    assert _input_layout_args(facts, layer, "Replicate()", "Shard(1)") == (
        ("input_layouts", "(Replicate(), None, None,)"), ("desired_input_layouts", "(Shard(1), None, None,)"))
    assert _input_layout_args(facts, "cls", "Shard(1)", "Replicate()")[0] == ("input_layouts", "(Shard(1),)")


ENCDEC = ZOO / "encdec.py"


@pytest.mark.parametrize("path,kwargs,stacks", [
    (HF_ZOO, {"arch": "t5"}, ["encoder.block", "decoder.block"]),
    (HF_ZOO, {"arch": "whisper"}, ["model.encoder.layers", "model.decoder.layers"]),
    (HF_ZOO, {"arch": "clip"}, ["vision_model.encoder.layers", "text_model.encoder.layers"]),
    (ENCDEC, {}, ["encoder", "decoder"]),
], ids=["t5", "whisper", "clip", "encdec"])
def test_every_stack_is_split_into_its_blocks(path, kwargs, stacks):
    """An encoder-decoder (T5, Whisper, torch.nn's layers) or a two-tower model (CLIP) has two
    stacks; both are found, in the order their blocks run, and every child of each is a layer
    of its own (so a pipeline can cut between them and FSDP, TP and recomputation act on each),
    where the smaller stack used to stay whole inside one layer."""
    model_file = load_model_file(path)
    with torch.device("meta"):
        model = model_file.build_model(**kwargs)
    assert sorted(find_block_containers(model)) == sorted(stacks)
    profile = profile_model(model_file, kwargs, micro_batch_size=1, precision="fp32")
    assert profile.block_containers == stacks
    children = [f"{stack}.{name}" for stack in stacks for name, _ in model.get_submodule(stack).named_children()]
    assert len(children) == 4
    assert [layer.name for layer in profile.blocks] == children
    layer_names = [layer.name for layer in profile.layers]
    # No layer holds a stack whole, and every block's parameters are its own layer's.
    assert not [name for name in layer_names for stack in stacks if stack == name or stack.startswith(name + ".")]
    for block in children:
        own = {name for name in profile.param_shapes if name.startswith(block + ".")}
        assert own and own <= set(profile.layer(block).param_names)
    # Sequence parallelism enters and leaves the sequence slices once: not searched for two stacks.
    from autopar.solver.space import sp_blocker
    assert sp_blocker(profile) == (f"the model has 2 stacks of blocks ({', '.join(stacks)}); sequence parallelism "
                                   "is written for one")


def test_a_small_stack_or_one_inside_a_block_stays_whole():
    """Only stacks holding a tenth of the parameters are split (the largest always is), and a
    container inside a block of a stack (experts held in a ModuleList) is no stack of its own."""
    class Block(nn.Module):
        def __init__(self, width: int, experts: int):
            super().__init__()
            self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    model = nn.Module()
    model.blocks = nn.ModuleList(Block(16, 4) for _ in range(4))  # 4 x 1,088 parameters
    model.heads = nn.ModuleList(nn.Linear(16, 2) for _ in range(3))  # 102 parameters: 2% of 4,454
    # Each block's experts hold 24% of the parameters, but lie inside the blocks.
    assert find_block_containers(model) == ["blocks"]
    model.adapters = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))  # 544 parameters: 11% of 4,998
    assert find_block_containers(model) == ["blocks", "adapters"]


def test_plan_blocks_pin_names_the_stacks():
    """plan.blocks=[encoder.block,decoder.block] gives what detection gives, in either order
    (through the driver, as the CLI passes it); plan.blocks=[encoder.block] alone leaves the
    decoder one layer."""
    from omegaconf import OmegaConf

    from autopar.driver import run_profile

    detected = profile_model(load_model_file(HF_ZOO), {"arch": "t5"}, micro_batch_size=1, precision="fp32")

    def pinned(blocks: list[str]):
        cfg = OmegaConf.create({"model": {"arch": "t5"}, "train": {"micro_batch_size": 1, "precision": "fp32"},
                                "plan": {"blocks": blocks}})
        return run_profile(HF_ZOO, cfg)

    both = pinned(["decoder.block", "encoder.block"])
    assert both.block_containers == detected.block_containers == ["encoder.block", "decoder.block"]
    assert [layer.name for layer in both.layers] == [layer.name for layer in detected.layers]
    encoder_only = pinned(["encoder.block"])
    assert encoder_only.block_containers == ["encoder.block"]
    assert [layer.name for layer in encoder_only.blocks] == ["encoder.block.0", "encoder.block.1"]
    assert "decoder" in [layer.name for layer in encoder_only.layers]


@pytest.mark.parametrize("blocks,words", [
    (["encoder.block", "decoder.blocks"], "plan.blocks: decoder.blocks is not a module of the model; the model's "
                                          "containers are: encoder.block"),
    (["shared"], "shared is not a ModuleList/ModuleDict/Sequential of 2+ blocks"),
    (["encoder.block", "encoder.block.0.layer"], "encoder.block.0.layer is inside encoder.block"),
    (["encoder.block", "encoder.block"], "encoder.block is named twice"),
])
def test_plan_blocks_pin_refuses_what_is_not_a_stack(blocks, words):
    """A wrong name is refused before tracing, naming the name, the model's containers and the fix."""
    from autopar.errors import ConfigError

    with pytest.raises(ConfigError) as refusal:
        profile_model(load_model_file(HF_ZOO), {"arch": "t5"}, micro_batch_size=1, precision="fp32", blocks=blocks)
    assert words in str(refusal.value)
    assert "plan.blocks=[encoder.block,decoder.block]" in refusal.value.fix


def test_batch_statistics_keep_the_whole_batch_in_every_forward():
    """A ResNet's BatchNorm in training mode normalises over the batch: the profile names it, the
    search keeps dp = cp = 1 and one micro-batch of the whole batch (tensor parallelism, which
    splits the model, stays open), and a pin splitting the batch is refused in words. A model
    whose samples never meet (the GPT example) has no such reason."""
    from autopar.config import PlanPins, SolverConfig
    from autopar.errors import UserError
    from autopar.solver.planner import Planner
    from autopar.solver.space import ModelShape, enumerate_candidates
    from cost_models.step import TrainSpec
    from cost_models.topology import ClusterConfig, ClusterSpec

    examples = Path(__file__).resolve().parents[2] / "examples"
    profile = profile_model(load_model_file(examples / "cnn.py"), {"width": 8, "blocks": 4, "image": 8},
                            micro_batch_size=2, precision="fp32")
    assert "batch normalisation in training mode (native_batch_norm in module 'stem.1')" in profile.batch_mixer
    candidates = list(enumerate_candidates(ModelShape.from_profile(profile), 4, 4, 8, SolverConfig(), PlanPins()))
    assert candidates and {(c.dp, c.cp, c.micro_batch_size, c.num_micro_batches) for c in candidates} == {(1, 1, 8, 1)}
    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="cpu", nodes=1, gpus_per_node=2))
    with pytest.raises(UserError, match="plan.dp=2 would train a different model: it splits the batch"):
        Planner(profile, cluster, TrainSpec(8, precision="fp32"), SolverConfig(), PlanPins(dp=2)).run()
    gpt = profile_model(load_model_file(examples / "gpt.py"), {"layers": 2, "hidden": 32, "heads": 4, "seq_len": 16,
                                                               "vocab": 64}, micro_batch_size=1, precision="fp32")
    assert gpt.batch_mixer is None


@pytest.mark.parametrize("window,causal", [(4, False), (64, True)])
def test_attention_is_priced_causal_only_under_the_causal_mask(tmp_path, window, causal):
    """Hugging Face's mask, evaluated while profiling: the causal one (a window past the sequence)
    marks the attention ops causal, forward and backward (eagerly run without padding, the model
    passes is_causal and the kernel skips the keys past each query); a window of 4 does not."""
    path = tmp_path / "model.py"
    path.write_text(_WINDOWED)
    profile = profile_model(load_model_file(path), {"window": window}, micro_batch_size=1, precision="fp32")
    attention = [op for op in profile.ops if op.op_class == "attention"]
    assert {op.phase for op in attention} == {"forward", "backward"}
    assert all(op.causal == causal for op in attention)



def _masks() -> dict[str, torch.Tensor]:
    """Masks of 600 queries (three row chunks of the check, the last short) as models build them."""
    q, k = 600, 600
    causal = torch.ones(q, k, dtype=torch.bool).tril()
    minimum = torch.finfo(torch.bfloat16).min
    additive = torch.zeros(q, k, dtype=torch.bfloat16).masked_fill(~causal, minimum)
    negative_zero = ((1.0 - causal.to(torch.bfloat16)) * minimum)[None, None]  # -0.0 where allowed
    late = causal.clone()
    late[513, 520] = True  # one key past the diagonal, in the third chunk
    biased = additive.clone()
    biased[300, 2] = -1.0  # a finite bias where the causal mask allows
    window = causal & ~torch.ones(q, k, dtype=torch.bool).tril(-8)
    return {"bool": causal, "additive": additive, "negative zero": negative_zero,
            "batched": additive.expand(2, 1, q, k), "rectangular": causal[:300], "late key": late,
            "bias": biased, "window": window, "full": torch.ones(q, k, dtype=torch.bool),
            "second batch differs": torch.stack([causal, late])}


@pytest.mark.parametrize("name", list(_masks()))
def test_causal_mask_judged_as_the_runtime_judges_it(name):
    """The profile's judgement of a mask (a few rows at a time) is the runtime's
    (`is_local_causal_mask` over the whole mask) together with the absence of any finite bias."""
    from autopar.sections.context_parallel import is_local_causal_mask
    from autopar.trace.sequence import _is_causal

    mask = _masks()[name]
    q, k = mask.shape[-2:]
    no_bias = mask.dtype == torch.bool or not bool(((mask != 0) & (mask > torch.finfo(mask.dtype).min / 2)).any())
    expected = no_bias and is_local_causal_mask(mask, q, k)
    assert _is_causal(mask) == expected
    assert expected == (name in {"bool", "additive", "negative zero", "batched", "rectangular"})


_PADDED = """
import torch
import transformers as hf
from torch.nn import functional as F

def build_model():
    config = hf.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                           vocab_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                           attention_probs_dropout_prob=0.0)
    config._attn_implementation = "sdpa"
    return hf.BertForMaskedLM(config)

def example_batch(batch_size):
    tokens = torch.randint(3, 64, (batch_size, 17))
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "attention_mask": torch.ones(batch_size, 16),
            "position_ids": torch.arange(16).expand(batch_size, 16)}

def loss_fn(output, batch):
    return F.cross_entropy(output.logits.flatten(0, -2), batch["targets"].flatten())
"""


def test_a_padding_mask_from_the_batch_blocks_cp_in_its_own_words(tmp_path):
    """BERT given `attention_mask` passes SDPA a mask read from the batch (here every token kept,
    so every query sees every key): no causal mask, refused at profile, and named as the padding
    mask it is, not as a sliding window (ALBERT's held-out cp2 said "sliding window")."""
    path = tmp_path / "model.py"
    path.write_text(_PADDED)
    profile = profile_model(load_model_file(path), {}, micro_batch_size=1, precision="fp32")
    assert [found.split(" (_")[0] for found in profile.sequence_mixers] == [
        "attention with a mask built from the batch (a padding mask such as attention_mask), which context "
        "parallelism's attention does not take"]
