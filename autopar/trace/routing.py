"""Tokens per expert, measured from a trained router: what dropless expert parallelism waits for.

A router that favours some experts makes the expert-parallel rank holding them the slowest of
its group (cost_models.expert_parallel.routing_pace). `train.moe_imbalance` states that skew as
one factor; with `train.router_checkpoint=PATH` it is measured instead:

1. the model is built at the size being compiled, on the CPU with real tensors, and the
   checkpoint's weights are loaded into it (a state dict written by ``torch.save``, read with
   ``weights_only=True``, so nothing in the file runs);
2. `train.router_batches` batches of the model file's ``example_batch`` run forward, without
   gradients;
3. a hook on each experts module that routes its own tokens (``forward(hidden_states,
   top_k_index, top_k_weights)``: exchanged dropless) counts the (token, choice) pairs each
   expert receives.

The counts price, for every ep, the busiest rank of the experts as `apply_ep` places them
(consecutive blocks of E / ep). Experts taking their tokens grouped with a capacity move and
compute every slot however tokens route, so there is nothing to measure for them.

    load = measure_expert_load(model_file, {"arch": "mixtral"}, Path("router.pt"), batch_size=2, batches=4)
    load["model.layers.0.mlp.experts"]  # [tokens sent to expert 0, 1, ...]
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from autopar.errors import ConfigError
from autopar.model_file import ModelFile, build_model, call_model, make_batch
from autopar.trace.experts import EXPERTS_MODULE, required_inputs

# A model larger than this is not built for real on the planning machine: measure on a smaller
# configuration of it (fewer layers) and pass that checkpoint.
MAX_MEASURED_PARAMETER_BYTES = 8 * 2**30
ROUTED_ARITY = 3


def measure_expert_load(model_file: ModelFile, kwargs: dict[str, Any], checkpoint: Path, batch_size: int,
                        batches: int) -> dict[str, list[int]]:
    """Experts module FQN -> (token, choice) pairs each of its experts received over ``batches``
    forward passes of ``example_batch(batch_size)`` with the checkpoint's weights."""
    if not checkpoint.is_file():
        raise ConfigError(f"train.router_checkpoint={checkpoint} is not a file.",
                          "pass a state dict saved with torch.save(model.state_dict(), PATH), or leave it unset.")
    with torch.device("meta"):
        size = sum(p.numel() * p.element_size() for p in build_model(model_file, kwargs).parameters())
    if size > MAX_MEASURED_PARAMETER_BYTES:
        raise ConfigError(f"measuring the router builds the model for real, and at this size it holds "
                          f"{size / 2**30:.1f} GiB of parameters (the limit is "
                          f"{MAX_MEASURED_PARAMETER_BYTES / 2**30:.0f} GiB).",
                          "measure on a smaller configuration of the model (fewer layers) with its checkpoint, "
                          "and pass the measured skew as train.moe_imbalance.")
    model = build_model(model_file, kwargs)
    _load_weights(model, checkpoint)
    counts: dict[str, torch.Tensor] = {}
    handles = []
    for fqn, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if fqn.split(".")[-1] != EXPERTS_MODULE or len(required_inputs(module)) != ROUTED_ARITY or not experts:
            continue
        counts[fqn] = torch.zeros(experts, dtype=torch.long)

        def count(_: Any, args: tuple, fqn: str = fqn) -> None:
            chosen = args[1].reshape(-1)
            counts[fqn] += torch.bincount(chosen[chosen < len(counts[fqn])], minlength=len(counts[fqn]))
        handles.append(module.register_forward_pre_hook(count))
    if not counts:
        raise ConfigError("train.router_checkpoint was given, but the model has no experts module that routes its "
                          "own tokens (forward(hidden_states, top_k_index, top_k_weights)): grouped experts compute "
                          "every capacity slot whatever the routing, so there is nothing to measure.",
                          "leave train.router_checkpoint unset.")
    model.eval()
    try:
        with torch.no_grad():
            for index in range(batches):
                torch.manual_seed(index)
                call_model(model, make_batch(model_file, batch_size, kwargs))
    finally:
        for handle in handles:
            handle.remove()
    return {fqn: tensor.tolist() for fqn, tensor in counts.items()}


def _load_weights(model: torch.nn.Module, checkpoint: Path) -> None:
    """The checkpoint's tensors into ``model``, refused in words when they do not match it."""
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception as error:  # a pickle with code, a truncated file, another format
        raise ConfigError(f"train.router_checkpoint={checkpoint} could not be read as a state dict ({error}).",
                          "save it with torch.save(model.state_dict(), PATH).") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise ConfigError(f"train.router_checkpoint={checkpoint} holds a {type(state).__name__}, not a state dict.",
                          "save it with torch.save(model.state_dict(), PATH).")
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a tensor of another shape
        raise ConfigError(f"train.router_checkpoint={checkpoint} does not fit the model built with these model.* "
                          f"settings: {str(error).splitlines()[-1].strip()}",
                          "pass the model.* overrides the checkpoint was trained with.") from None
    if result.missing_keys or result.unexpected_keys:
        missing, unexpected = result.missing_keys[:3], result.unexpected_keys[:3]
        raise ConfigError(f"train.router_checkpoint={checkpoint} does not match the model built with these "
                          f"model.* settings (missing: {missing}; unexpected: {unexpected}).",
                          "pass the model.* overrides the checkpoint was trained with.")
