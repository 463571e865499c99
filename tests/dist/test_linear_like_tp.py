"""Linear-like modules split on 2 gloo ranks train exactly like one process: GPT-2's Conv1D
(weight stored (in, out)) under the transposed styles, FalconLinear (an nn.Linear whose own
forward computes x @ W.T + b) under torch's, and an output the model modifies in place copied
once (sections/linear_like.py). Parameters keep their names and their unsplit layout."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.dist.harness import run_ranks

HIDDEN, STEPS = 8, 3


class Conv1D(nn.Module):
    """Hugging Face's Conv1D, as transformers writes it (its forward reads its global size)."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class FalconLinear(nn.Linear):
    def forward(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = Conv1D(4 * HIDDEN, HIDDEN), Conv1D(HIDDEN, 4 * HIDDEN)
        self.up, self.down = FalconLinear(HIDDEN, 4 * HIDDEN), FalconLinear(4 * HIDDEN, HIDDEN)

    def forward(self, x):
        y = self.c_proj(F.gelu(self.c_fc(x)))
        y += x  # Falcon's mlp_output += attention_output: in place on a split module's output
        return y + self.down(F.gelu(self.up(y)))


def _train(rank: int, world_size: int) -> tuple[list[float], dict[str, list]]:
    """Losses and final parameters (unsplit, as nested lists: tensors do not cross processes well)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from autopar.sections.linear_like import OwnedOutput, TransposedColwiseParallel, TransposedRowwiseParallel

    torch.manual_seed(0)
    model = Model()
    if world_size > 1:
        mesh = init_device_mesh("cpu", (world_size,))
        parallelize_module(model, mesh, {"c_fc": TransposedColwiseParallel(),
                                         "c_proj": OwnedOutput(style=TransposedRowwiseParallel()),
                                         "up": ColwiseParallel(), "down": RowwiseParallel()})
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(STEPS):
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().tolist()
                    for name, p in model.named_parameters()}


def test_linear_like_modules_split_train_like_one_process():
    losses, parameters = _train(0, 1)
    parameters = {name: torch.tensor(value) for name, value in parameters.items()}
    sharded = run_ranks(_train, 2)
    for rank_losses, rank_parameters in sharded:
        rank_parameters = {name: torch.tensor(value) for name, value in rank_parameters.items()}
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(losses), rtol=1e-5, atol=0)
        assert {n: p.shape for n, p in rank_parameters.items()} == {n: p.shape for n, p in parameters.items()}
        assert rank_parameters["c_fc.weight"].shape == (HIDDEN, 4 * HIDDEN)  # (in, out), as saved unsplit
        for name, expected in parameters.items():
            torch.testing.assert_close(rank_parameters[name], expected, rtol=1e-4, atol=1e-5, msg=name)
    assert losses[-1] < losses[0]


def test_the_sharded_weights_hold_each_rank_its_columns_and_rows():
    """c_fc's (in, out) weight is split along dim 1 (its output features), c_proj's along dim 0."""
    shapes = run_ranks(_local_shapes, 2)
    assert shapes[0] == {"c_fc.weight": (HIDDEN, 2 * HIDDEN), "c_fc.bias": (2 * HIDDEN,),
                         "c_proj.weight": (2 * HIDDEN, HIDDEN), "c_proj.bias": (HIDDEN,)}


def _local_shapes(rank: int, world_size: int) -> dict[str, tuple[int, ...]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from autopar.sections.linear_like import TransposedColwiseParallel, TransposedRowwiseParallel

    model = Model()
    parallelize_module(model, init_device_mesh("cpu", (world_size,)),
                       {"c_fc": TransposedColwiseParallel(), "c_proj": TransposedRowwiseParallel()})
    return {name: tuple(p.to_local().shape) for name, p in model.named_parameters() if name.startswith("c_")}
