"""Fused projections split as their parts (autopar.sections.fused, autopar.solver.tp_fused):
the row order, the cuts answered with each rank's share, the parts read from the model's code,
the rows put back in the model's order, and the styles code generation writes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.sections.checkpoint import RowOrders, fused_row_order
from autopar.sections.fused import FUSED_PARTS, FusedCutError, FusedCuts, permute_output_rows
from autopar.solver.tp_fused import cutting_fused, recorded_parts


def test_row_order_gives_each_contiguous_shard_its_share_of_every_part():
    # q of 4 rows, k and v of 2 each, over 2 ranks: rank 0 holds q[0:2], k[0:1], v[0:1].
    assert fused_row_order([4, 2, 2], 2) == [0, 1, 4, 6, 2, 3, 5, 7]
    assert fused_row_order([2, 2], 1) == [0, 1, 2, 3]
    assert sorted(fused_row_order([8, 4, 4], 4)) == list(range(16))


def _share(full: torch.Tensor, parts: list[int], rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s local output of a column split of permuted rows: its contiguous block."""
    permuted = full.index_select(-1, torch.tensor(fused_row_order(parts, tp)))
    return permuted.chunk(tp, dim=-1)[rank]


@pytest.mark.parametrize("cut", ["split", "split_sizes", "chunk", "slices", "narrow"])
def test_cuts_by_global_sizes_return_this_ranks_share_of_each_part(cut):
    parts, tp = ([8, 8] if cut == "chunk" else [8, 4, 4]), 2  # chunk: equal parts (gate and up)
    full = torch.arange(2 * 3 * 16, dtype=torch.float32).view(2, 3, 16)
    wholes = full.split(parts, dim=-1)
    for rank in range(tp):
        local = _share(full, parts, rank, tp)
        setattr(local, FUSED_PARTS, parts)
        with FusedCuts():
            if cut == "split":
                got = local.split([8, 4, 4], dim=2)
            elif cut == "split_sizes":
                got = torch.split(local, [8, 4, 4], -1)
            elif cut == "chunk":
                got = local.chunk(2, dim=-1)
            elif cut == "slices":
                got = (local[..., :8], local[..., 8:12], local[:, :, 12:])
            else:
                got = (local.narrow(-1, 0, 8), local.narrow(2, 8, 4), local.narrow(-1, 12, 4))
        assert len(got) == len(parts)
        for found, whole in zip(got, wholes):
            assert torch.equal(found, whole.chunk(tp, dim=-1)[rank])


def test_a_cut_across_parts_raises_instead_of_reading_the_wrong_rows():
    local = torch.zeros(2, 8)
    setattr(local, FUSED_PARTS, [8, 4, 4])
    with FusedCuts(), pytest.raises(FusedCutError, match="not one of its parts"):
        local[..., :12]
    with FusedCuts():  # a cut along another dim, or of an untagged tensor, runs as written
        assert local[:1].shape == (1, 8) and torch.zeros(2, 16).split(8, dim=-1)[0].shape == (2, 8)


def test_permuted_rows_and_the_row_orders_put_them_back():
    linear = nn.Linear(3, 8)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    permute_output_rows(linear, [4, 2, 2], 2, weight_dim=0)
    rows = RowOrders({"qkv.weight": (0, [4, 2, 2]), "qkv.bias": (0, [4, 2, 2])}, 2)
    assert not torch.equal(linear.weight, weight)
    assert torch.equal(rows.public("qkv.weight", linear.weight.detach()), weight)
    assert torch.equal(rows.public("qkv.bias", linear.bias.detach()), bias)
    assert torch.equal(rows.private("qkv.weight", weight), linear.weight.detach())
    # Checkpoint entries: the parameter and its moments convert, the step and others stay.
    state = {"model.qkv.weight": linear.weight.detach(), "optimizer.state.qkv.weight.exp_avg": linear.weight.detach(),
             "optimizer.state.qkv.weight.step": torch.tensor(3.0), "model.other.weight": torch.ones(8, 3)}
    public = rows.convert(state, to_public=True)
    assert torch.equal(public["model.qkv.weight"], weight)
    assert torch.equal(public["optimizer.state.qkv.weight.exp_avg"], weight)
    assert public["optimizer.state.qkv.weight.step"] is state["optimizer.state.qkv.weight.step"]
    assert public["model.other.weight"] is state["model.other.weight"]
    assert torch.equal(rows.convert(public, to_public=False)["model.qkv.weight"], linear.weight.detach())


def test_a_transposed_weight_is_permuted_along_its_output_dim():
    weight = torch.arange(12.0).view(3, 4)  # (in, out), GPT-2's Conv1D
    module = nn.Module()
    module.weight = nn.Parameter(weight.clone())
    permute_output_rows(module, [2, 2], 2, weight_dim=1)
    assert torch.equal(module.weight.detach(), weight[:, [0, 2, 1, 3]])


class _Attention(nn.Module):
    def __init__(self, cut: str):
        super().__init__()
        self.cut = cut
        self.qkv = nn.Linear(16, 32)  # q of 16, k and v of 8 (grouped query attention)
        self.o = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.qkv(x)
        if self.cut == "slices":
            q, k, v = out[..., :16], out[..., 16:24], out[..., 24:]
        elif self.cut == "view":
            q, k, v = out.view(*x.shape[:-1], 4, 8)[..., :2, :].flatten(-2), out[..., 16:24], out[..., 24:]
        elif self.cut == "slots":  # Falcon's multi-query way: heads + 2 slots, cut along them
            slots = out.view(*x.shape[:-1], 4, 8)
            q, k, v = slots[..., :-2, :].flatten(-2), slots[..., [-2], :].flatten(-2), slots[..., [-1], :].flatten(-2)
        elif self.cut == "slots_summed":  # the slots read otherwise: not parts
            q, k, v = out.view(*x.shape[:-1], 4, 8).sum(-2).repeat(1, 1, 4).split([16, 8, 8], dim=-1)
        else:
            q, k, v = out.split([16, 8, 8], dim=-1)
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, -1, 4).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


@pytest.mark.parametrize("cut, parts", [("split", [16, 8, 8]), ("slices", [16, 8, 8]), ("view", [16, 8, 8]),
                                       ("slots", [16, 8, 8]), ("slots_summed", None)])
def test_parts_are_read_from_what_the_code_does_with_the_output(cut, parts):
    """Cuts along the last dim, or along slots of a view splitting it (a cut by whole slots),
    give the parts; any other use of the output or of its slots gives none."""
    attention = _Attention(cut)
    assert recorded_parts(attention.qkv, lambda: attention(torch.randn(2, 3, 16))) == parts


def test_a_region_run_on_one_ranks_share_computes_that_ranks_heads():
    """The region with its fused projection narrowed to rank r's permuted rows and its output
    projection to rank r's input columns: the partial outputs of both ranks sum to the whole."""
    torch.manual_seed(0)
    whole = _Attention("split")
    x = torch.randn(2, 3, 16)
    expected = whole(x)
    total = torch.zeros_like(expected)
    for rank in range(2):
        share = _Attention("split")
        order = torch.tensor(fused_row_order([16, 8, 8], 2)).chunk(2)[rank]
        share.qkv = nn.Linear(16, 16)
        share.qkv.weight.data, share.qkv.bias.data = whole.qkv.weight.data[order], whole.qkv.bias.data[order]
        share.o = nn.Linear(8, 16, bias=False)
        share.o.weight.data = whole.o.weight.data.chunk(2, dim=1)[rank]
        with cutting_fused({"": share, "qkv": share.qkv}, {"qkv": [16, 8, 8]}):
            total += share(x)
    torch.testing.assert_close(total + whole.o.bias, expected)


def test_the_report_names_the_fused_projections_split_as_their_parts():
    from autopar.plans import Plan, Predicted
    from autopar.solver.tp_coverage import coverage_notes

    plan = Plan(tp=2, tp_fused={"blocks.0.attn.qkv": [64, 32, 32], "blocks.1.attn.qkv": [64, 32, 32]},
                predicted=Predicted(tp_param_share=1.0, tp_flop_share=0.9))
    assert coverage_notes(plan)[1] == ("2 fused projections split as their parts, each rank holding its share of "
                                       "every part (qkv [64, 32, 32]).")
