"""Attention written out (autopar.solver.intra_op: a product of two activations reads no weight,
a softmax of attention scores may run on the rank's heads): split by heads like a fused kernel,
while a softmax over a projection's features still needs them whole."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autopar.model_file import load_model_file
from autopar.profile import profile_model
from autopar.solver.tp_split import ILPSplitter
from cost_models.hardware import get_gpu
from cost_models.topology import ClusterConfig, ClusterSpec
from tests.profiles import planner_splitter, tp_split, traced

SHAPE = dict(layers=2, hidden=256, heads=4, seq_len=256, vocab=512)

# A block whose middle is a softmax over a projection's outputs (a router's or a classifier's):
# on a column split each rank would normalise over its share of the features alone.
FEATURE_SOFTMAX = textwrap.dedent('''
    import torch
    from torch import nn


    class Block(nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.up = nn.Linear(hidden, 4 * hidden)
            self.down = nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            return x + self.down(self.up(x).softmax(dim=-1))


    class Net(nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.embed = nn.Embedding(128, hidden)
            self.blocks = nn.ModuleList(Block(hidden) for _ in range(2))

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return x


    def build_model(hidden: int = 256):
        return Net(hidden)


    def example_batch(batch_size: int):
        return {"tokens": torch.randint(0, 128, (batch_size, 64))}


    def loss_fn(out, batch):
        return out.float().pow(2).mean()
''')


def _block(profile) -> str:
    return next(layer.name for layer in profile.layers if layer.is_block)


@pytest.mark.parametrize("tp", [2, 4])
def test_unfused_attention_splits_like_sdpa(tp):
    """The written-out GPT block gets the fused one's split: every projection and the attention
    between them sharded, the same share of its parameters and the same collectives."""
    unfused = traced("gpt.py", "bf16", 2, attention="unfused", **SHAPE)
    fused = traced("gpt.py", "bf16", 2, **SHAPE)
    split, reference = tp_split(unfused, _block(unfused), tp), tp_split(fused, _block(fused), tp)
    styles = {module.rsplit(".", 1)[-1]: style for module, style in split.styles.items()}
    assert styles == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "out_proj": "rowwise",
                      "fc_in": "colwise", "fc_out": "rowwise"}
    assert split.tp_sharded_param_fraction == pytest.approx(reference.tp_sharded_param_fraction)
    assert split.comm == reference.comm
    # Nothing of the scores runs whole: what stays replicated is the fused block's (norms, residual
    # adds) and the causal mask built in forward.
    assert split.replicated_forward_s < 1.2 * reference.replicated_forward_s


def test_a_softmax_over_a_projections_features_keeps_them_whole(tmp_path: Path):
    """Offered a split, the softmax over `up`'s features would normalise each rank's share alone;
    it is not offered one, so `up` cannot pair with `down` through it."""
    splitter = _first_block_split_on_a_pair(tmp_path / "feature_softmax.py", FEATURE_SOFTMAX)
    assert splitter.solutions[("blocks.0", 2)].get("blocks.0.down") != "rowwise"


def _first_block_split_on_a_pair(path: Path, source: str) -> ILPSplitter:
    """The splitter after splitting ``source``'s first block over an H100 pair."""
    path.write_text(source)
    profile = profile_model(load_model_file(path), {}, 1, "fp32")
    cluster = ClusterSpec.from_config(ClusterConfig(name="pair", gpu="H100-SXM", nodes=1, gpus_per_node=2))
    splitter = ILPSplitter(profile)
    splitter.split("blocks.0", 2, cluster.group_links([0, 1]), get_gpu("H100-SXM"))
    return splitter


@pytest.mark.parametrize("tp", [2, 4])
def test_dropouts_leave_the_pairs_split_and_mark_the_attention_drawing_on_shards(tp):
    """Dropout on the probabilities runs on the rank's heads (its region listed as drawing random
    numbers on shards, seeded per rank by the generated code); dropout on the residual branches
    runs on the whole output after the all-reduce. The residual one once made the ILP keep each
    output projection column-parallel, its dropout on shards and a gather after it (code that
    does not exist), and the rounds that then gathered every unpaired column left all whole."""
    dropped = traced("gpt.py", "bf16", 2, attention="unfused", attention_dropout=0.1, hidden_dropout=0.1, **SHAPE)
    block = _block(dropped)
    styles = {module.rsplit(".", 1)[-1]: style for module, style in tp_split(dropped, block, tp).styles.items()}
    assert styles == {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "out_proj": "rowwise",
                      "fc_in": "colwise", "fc_out": "rowwise"}
    assert planner_splitter(dropped).random_regions[(block, tp)] == {f"{block}.attn"}


GLOBAL_VIEWS_DROPOUT = FEATURE_SOFTMAX.replace('''class Block(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(self.up(x).softmax(dim=-1))''', '''class Block(nn.Module):
    def __init__(self, hidden, heads=4):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        b, s, h = x.shape  # global sizes: the region keeps DTensor activations
        q, k, v = (p(x).view(b, s, self.heads, h // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        probs = torch.nn.functional.dropout((q @ k.transpose(-2, -1)).softmax(dim=-1), 0.1, self.training)
        return x + self.o((probs @ v).transpose(1, 2).reshape(b, s, h))''')


def test_a_region_keeping_dtensors_draws_on_whole_activations(tmp_path: Path):
    """Dropout in attention that views by global sizes: the region runs on DTensors, whose random
    ops go through DTensor's own generator offsets (not replayed by recomputation), so its draws
    run on whole activations and the region is not listed as drawing on shards."""
    splitter = _first_block_split_on_a_pair(tmp_path / "global_views_dropout.py", GLOBAL_VIEWS_DROPOUT)
    assert ("blocks.0", 2) in splitter._whole_draws  # its first split drew on shards in a DTensor region
    assert not splitter.random_regions[("blocks.0", 2)] & splitter.dtensor_regions[("blocks.0", 2)]
