"""Gradient synchronisation across data-parallel ranks by the algorithm the planner priced cheapest.

    ring          FSDP's reduction (NCCL's ring; on gloo its own ring): nothing to do here.
    hierarchical  per bucket: reduce-scatter inside each node, all-reduce of each shard across
                  nodes (one rank per node and shard), all-gather inside the node. Moves 1/g of
                  the data over the network (g = data-parallel ranks per node).
    halving_doubling
                  per bucket: recursive halving (a reduce-scatter in log2 n pairwise exchanges,
                  each of half the data still held) then recursive doubling (the all-gather, in
                  reverse); Rabenseifner, in Thakur, Rabenseifner & Gropp 2005 §4.4. Ranks beyond
                  the largest power of two p hand their whole bucket to rank i - p first and get
                  the sum back last.
    ps            parameter server (Li et al. 2014): the first rank of each data-parallel group
                  holds the optimizer and its state; workers push their gradients to it, it
                  averages and steps, and they pull the updated parameters. O(n) traffic at the
                  server, no optimizer state on workers.
Each wraps the optimizer (sync, then step), so the training loop is the same for every plan; a
``before_step`` given to ``step`` (gradient clipping, clipping.py) runs between the two, on the
averaged gradients, and ``step`` returns what it returned.
Gradients travel in flat buckets of the plan's size (bounded extra memory per step).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autopar.sections.mesh import axis_names
from autopar.sections.optimizer import _local, all_gather_single, reduce_scatter_single


def dp_groups(mesh: DeviceMesh, axis: str) -> list[list[int]]:
    """Every group of ranks along ``axis`` (all of them: new process groups are made collectively)."""
    grid = mesh.mesh
    dim = axis_names(mesh).index(axis)
    return grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()


def node_subgroups(groups: list[list[int]], gpus_per_node: int) -> tuple[list[list[int]], list[list[int]]]:
    """(intra-node, inter-node) subgroups of each data-parallel group: ranks sharing a node, and
    ranks at the same position on their nodes."""
    intra, inter = [], []
    for group in groups:
        by_node: dict[int, list[int]] = {}
        for rank in group:
            by_node.setdefault(rank // gpus_per_node, []).append(rank)
        nodes = list(by_node.values())
        if len({len(n) for n in nodes}) != 1:
            raise ValueError(f"hierarchical all-reduce needs the same data-parallel ranks on every node, got {nodes}")
        intra += nodes
        inter += [list(column) for column in zip(*nodes)]
    return intra, inter


def buckets(parameters: list[nn.Parameter], bucket_bytes: int) -> list[list[nn.Parameter]]:
    """Consecutive parameters grouped up to ``bucket_bytes`` of fp32 gradient each."""
    result: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in parameters:
        nbytes = _local(p).numel() * 4
        if result[-1] and size + nbytes > bucket_bytes:
            result.append([])
            size = 0
        result[-1].append(p)
        size += nbytes
    return [b for b in result if b]


def ensure_grads(parameters: list[nn.Parameter]) -> None:
    """Zero gradients for parameters backward did not reach, so every rank's buckets line up."""
    for p in parameters:
        if p.grad is None:
            p.grad = torch.zeros_like(p)


def local_grads(bucket: list[nn.Parameter]) -> list[torch.Tensor]:
    """The rank-local gradients of a bucket's parameters (`ensure_grads` gave each one)."""
    found = []
    for parameter in bucket:
        if parameter.grad is None:
            raise RuntimeError("a parameter of the bucket has no gradient: ensure_grads runs before the exchange")
        found.append(_local(parameter.grad))
    return found


def wait_all(works: list[dist.Work | None]) -> None:
    """Wait for the point-to-point operations this rank started (None: it was in no group)."""
    for work in works:
        if work is not None:
            work.wait()


def flat_grads(bucket: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([(_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p))).reshape(-1).float()
                      for p in bucket])


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class HierarchicalSync:
    """Average gradients over the data-parallel group in three steps (see the module docstring),
    then run the wrapped optimizer."""

    reduces_gradients = True  # clipping.py's step_optimizer passes before_step

    def __init__(self, named: list[tuple[str, nn.Parameter]], optimizer, intra: dist.ProcessGroup,
                 inter: dist.ProcessGroup, dp: int, bucket_bytes: int):
        self.parameters = [p for _, p in named if p.requires_grad]
        self.optimizer, self.intra, self.inter, self.dp = optimizer, intra, inter, dp
        self.buckets = buckets(self.parameters, bucket_bytes)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, before_step: Callable[[], Any] | None = None) -> Any:
        per_node = dist.get_world_size(self.intra)
        ensure_grads(self.parameters)
        for bucket in self.buckets:
            flat = flat_grads(bucket)
            padded = torch.nn.functional.pad(flat, (0, -flat.numel() % per_node))
            shard = torch.empty(padded.numel() // per_node, dtype=padded.dtype, device=padded.device)
            reduce_scatter_single(shard, padded, group=self.intra)
            dist.all_reduce(shard, group=self.inter)
            all_gather_single(padded, shard, group=self.intra)
            unflatten_into(padded[:flat.numel()] / self.dp, local_grads(bucket))
        result = before_step() if before_step is not None else None
        self.optimizer.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


def exchange(send: torch.Tensor, receive: torch.Tensor, peer: int) -> None:
    """Send ``send`` to global rank ``peer`` while receiving ``receive`` from it."""
    wait_all([dist.isend(send, dst=peer), dist.irecv(receive, src=peer)])


def halving_doubling_all_reduce(flat: torch.Tensor, ranks: list[int]) -> None:
    """Sum ``flat`` over the global ``ranks`` (this rank among them) in place, by recursive
    halving and doubling (see the module docstring)."""
    n, me = len(ranks), ranks.index(dist.get_rank())
    core = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    if me >= core:  # a surplus rank: its partner in the core reduces for it
        dist.send(flat, dst=ranks[me - core])
        dist.recv(flat, src=ranks[me - core])
        return
    if me + core < n:
        received = torch.empty_like(flat)
        dist.recv(received, src=ranks[me + core])
        flat += received
    # Halving: partners at distance core/2, core/4, ..., 1 split the piece both hold; each keeps
    # one half (the lower rank the lower half) and adds the partner's copy of it.
    rounds, low, high, distance = [], 0, flat.numel(), core // 2
    while distance:
        partner, middle = me ^ distance, (low + high) // 2
        keep, give = ((low, middle), (middle, high)) if me < partner else ((middle, high), (low, middle))
        received = torch.empty(keep[1] - keep[0], dtype=flat.dtype, device=flat.device)
        exchange(flat[give[0]:give[1]].clone(), received, ranks[partner])
        flat[keep[0]:keep[1]] += received
        rounds.append((partner, keep, give))
        (low, high), distance = keep, distance // 2
    # Doubling, rounds in reverse: each summed piece goes back to the partner that gave it up.
    for partner, keep, give in reversed(rounds):
        received = torch.empty(give[1] - give[0], dtype=flat.dtype, device=flat.device)
        exchange(flat[keep[0]:keep[1]].clone(), received, ranks[partner])
        flat[give[0]:give[1]] = received
    if me + core < n:
        dist.send(flat, dst=ranks[me + core])


class HalvingDoublingSync:
    """Average gradients over the data-parallel group by recursive halving and doubling, bucket
    by bucket, then run the wrapped optimizer."""

    reduces_gradients = True  # clipping.py's step_optimizer passes before_step

    def __init__(self, named: list[tuple[str, nn.Parameter]], optimizer, group: dist.ProcessGroup, bucket_bytes: int):
        self.parameters = [p for _, p in named if p.requires_grad]
        self.optimizer = optimizer
        self.ranks = dist.get_process_group_ranks(group)
        self.buckets = buckets(self.parameters, bucket_bytes)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, before_step: Callable[[], Any] | None = None) -> Any:
        ensure_grads(self.parameters)
        for bucket in self.buckets:
            flat = flat_grads(bucket)
            halving_doubling_all_reduce(flat, self.ranks)
            unflatten_into(flat / len(self.ranks), local_grads(bucket))
        result = before_step() if before_step is not None else None
        self.optimizer.step()
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)


class ParameterServer:
    """The group's first rank serves: receives every worker's gradients (push), averages them,
    steps the only optimizer, and sends the parameters back (pull). Workers take part in
    ``before_step`` too (a clipping norm's all-reduce spans every rank); their gradients, left
    unaveraged, count nowhere (the server's copy counts) and are not used."""

    reduces_gradients = True  # clipping.py's step_optimizer passes before_step

    def __init__(self, named: list[tuple[str, nn.Parameter]], make_optimizer, group: dist.ProcessGroup,
                 bucket_bytes: int):
        """``make_optimizer(named)`` builds the server's optimizer over (FQN, parameter) pairs."""
        named = [(n, p) for n, p in named if p.requires_grad]
        self.parameters = [p for _, p in named]
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.server = self.ranks[0]
        self.is_server = dist.get_rank() == self.server
        self.optimizer = make_optimizer(named) if self.is_server else None
        self.buckets = buckets(self.parameters, bucket_bytes)

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    @torch.no_grad()
    def step(self, before_step: Callable[[], Any] | None = None) -> Any:
        workers = [r for r in self.ranks if r != self.server]
        for bucket in self.buckets:
            flat = flat_grads(bucket)
            if self.is_server:
                received = [torch.empty_like(flat) for _ in workers]
                wait_all([dist.irecv(buf, src=w, group=self.group) for buf, w in zip(received, workers)])
                total = flat + sum(received)
                ensure_grads(bucket)
                unflatten_into(total / len(self.ranks), local_grads(bucket))
            else:
                dist.send(flat, dst=self.server, group=self.group)
        result = before_step() if before_step is not None else None
        if self.optimizer is not None:  # the server's
            self.optimizer.step()
        for bucket in self.buckets:
            flat = torch.cat([_local(p).detach().reshape(-1).float() for p in bucket])
            if self.is_server:
                wait_all([dist.isend(flat, dst=w, group=self.group) for w in workers])
            else:
                dist.recv(flat, src=self.server, group=self.group)
                unflatten_into(flat, [_local(p).data for p in bucket])
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.parameters:
            p.grad = None
