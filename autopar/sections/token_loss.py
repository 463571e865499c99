"""Token-level losses: a mean over the tokens a loss counts, kept exact across ranks and micro-batches.

A language model's cross-entropy averages over its label tokens, and masked LMs (labels of -100
outside the masked tokens) or padded batches count a different number in each sample. A
data-parallel rank, a context-parallel shard or a micro-batch averaging over its own tokens
would weigh each token by its part's count instead of the batch's, and train another model.

So each micro-batch's mean loss is multiplied by the number of targets it counted (read from
the loss's autograd graph: the ``total_weight`` that ``nll_loss_forward`` saves for backward),
which makes it the sum over its tokens; after the step's last backward one all-reduce over
every rank gives the global count N, and the gradients, summed by backward and averaged over
the data-parallel and context-parallel ranks, are scaled by (micro-batches x those ranks) / N:
those of the one-process mean over the whole batch, as Hugging Face's ``num_items_in_batch``
computes it for gradient accumulation. The logged loss is the same sum over N, and so is the
validation loss, whose forward keeps no autograd graph: there the counts are recorded as the
nll ops run (`counting`).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode

# Autograd's nodes of ATen's nll_loss_forward / nll_loss2d_forward: they keep the count.
COUNTING_NODES = ("NllLossBackward0", "NllLoss2DBackward0")
MEAN_REDUCTION = 1  # ATen's Reduction::Mean
MOST_NODES_WALKED = 256  # the loss op sits a few nodes from the loss; this bounds a walk past it
COUNTING_OPS = (torch.ops.aten.nll_loss_forward, torch.ops.aten.nll_loss2d_forward)  # (loss, total_weight)


def counted_targets(loss: torch.Tensor) -> torch.Tensor:
    """The number of targets ``loss`` averages over (float64, 0-dim), read from its autograd graph:
    the nearest mean nll_loss's saved total weight (targets not ignored, weighted by class weights
    when given)."""
    frontier, seen = [loss.grad_fn], set[Any]()
    while frontier and len(seen) < MOST_NODES_WALKED:
        node = frontier.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ in COUNTING_NODES:
            if getattr(node, "_saved_reduction") != MEAN_REDUCTION:  # what autograd saved of the call
                break
            count = getattr(node, "_saved_total_weight")
            count = count.full_tensor() if isinstance(count, DTensor) else count
            return count.detach().to(torch.float64)
        frontier.extend(next_node for next_node, _ in node.next_functions)
    raise RuntimeError("the loss's mean over its targets (cross_entropy / nll_loss with reduction='mean') was not "
                       f"found within {MOST_NODES_WALKED} autograd nodes of the loss, where the plan found one when "
                       "the model was profiled: if the loss changed since, compile the model again")


class TokenCounts:
    """This rank's counted targets over one step's micro-batches, and what makes them global."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.counts: list[torch.Tensor] = []
        self.weighing = False

    def start(self) -> None:
        """Weigh the losses computed from here to `finish` (a training step's; validation's are
        plain means)."""
        self.counts.clear()
        self.weighing = True

    def weigh(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (a mean over its counted targets) times their count: their sum."""
        if not self.weighing:
            return loss
        count = counted_targets(loss)
        self.counts.append(count)
        count = count.to(loss.dtype)
        if isinstance(loss, DTensor):
            count = DTensor.from_local(count, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
        return sum_over_targets(loss, count)

    def weigh_output(self, output: torch.Tensor, target: Any) -> torch.Tensor:
        """A pipeline schedule's loss function: the last stage's output is the loss."""
        return self.weigh(output)

    def counting(self) -> "CountedTargets":
        """Record the count of every mean nll_loss run inside (validation: no autograd graph)."""
        self.counts.clear()
        return CountedTargets(self.counts)

    def summed(self, losses: torch.Tensor) -> torch.Tensor:
        """The micro-batches' means ``losses`` (1-D, in order) times their recorded counts: their
        sums (a part without a counted target adds nothing)."""
        return sum_over_targets(losses, torch.stack(self.counts[-len(losses):]).to(losses.dtype))

    def global_count(self, micro_batches: int) -> torch.Tensor:
        """The targets the whole batch counts, over every rank, times the tensor-parallel ranks
        (each counts the same ones). The micro-batches' counts are the last ones: on its first
        step, torch's pipeline schedule calls the loss function once more, before them, to infer
        gradient shapes."""
        count = torch.stack(self.counts[-micro_batches:]).sum() if self.counts else \
            torch.zeros((), dtype=torch.float64, device=self.device)
        dist.all_reduce(count)  # every rank: only a pipeline's last stage counts
        return count

    def share_of_mean(self, micro_batches: int, averaged_over: int, tp: int) -> torch.Tensor:
        """What turns a sum over this rank's counted targets into its share of the batch's mean,
        as the ranks' shares are averaged (the logged loss; gradients over ``averaged_over``
        data-parallel x context-parallel ranks): those ranks x tp / the global count."""
        return (averaged_over * tp / self.global_count(micro_batches)).float()

    def finish(self, modules: list[nn.Module], averaged_over: int, micro_batches: int, tp: int,
               loss: torch.Tensor | None) -> torch.Tensor | None:
        """After the step's backward: scale the gradients to the one-process mean over the whole
        batch, and return this rank's share of the logged loss (the mean of its micro-batches'
        sums, ``loss``, scaled alike; None where the rank computes no loss).

        Args:
            averaged_over: ranks each gradient is averaged over (data-parallel x context-parallel).
            micro_batches: micro-batches per step (backward divided each one's loss by it).
            tp: tensor-parallel ranks, which all count the same targets.
        """
        self.weighing = False
        factor = micro_batches * self.share_of_mean(micro_batches, averaged_over, tp)
        grads = {id(p): p.grad for module in modules for p in module.parameters() if p.grad is not None}
        with torch.no_grad():
            for grad in grads.values():
                (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(factor.to(grad.dtype))
        return None if loss is None else loss * factor


def sum_over_targets(mean: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """A mean over counted targets times their count: their sum. A part without a counted target
    has a mean of 0/0 (nan): it adds nothing, as in one process (its gradient is 0 either way)."""
    return torch.where(count > 0, mean, torch.zeros_like(mean)) * count


class CountedTargets(TorchDispatchMode):
    """Appends to ``counts`` the count (float64) of every mean nll_loss that runs while active."""

    def __init__(self, counts: list[torch.Tensor]) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        reduction = args[3] if len(args) > 3 else (kwargs or {}).get("reduction", MEAN_REDUCTION)
        if func.overloadpacket in COUNTING_OPS and reduction == MEAN_REDUCTION:
            count = out[1].full_tensor() if isinstance(out[1], DTensor) else out[1]
            self.counts.append(count.detach().to(torch.float64))
        return out
