"""What an experts module's forward takes: the fact that decides how expert parallelism
exchanges its tokens.

The generated expert parallelism (autopar/sections/expert_parallel.py) reaches a module named
``experts`` in one of two ways (cost_models.expert_parallel.ExpertExchange): a forward taking
one input, the tokens already grouped by expert [E, tokens, ...], is wrapped in fixed-size
all-to-alls; Hugging Face's experts modules (Mixtral, Qwen2-MoE, DeepSeek-V3 in transformers 5)
take the flat tokens with each token's chosen experts and gates, ``forward(hidden_states,
top_k_index, top_k_weights)``, and are exchanged dropless. The profile records each experts
module's required inputs so the search prices the right exchange and leaves ep > 1 out for a
module taking anything else.
"""
from __future__ import annotations

import inspect

from torch import nn

EXPERTS_MODULE = "experts"


def required_inputs(module: nn.Module) -> list[str]:
    """Names of the positional arguments ``module.forward`` cannot run without."""
    return [p.name for p in inspect.signature(module.forward).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def experts_inputs(model: nn.Module) -> dict[str, list[str]]:
    """FQN -> required inputs of the forward of every module named ``experts`` that holds
    parameters of its own (a ModuleList of per-expert MLPs holds none and is never exchanged)."""
    return {name: required_inputs(module) for name, module in model.named_modules()
            if name.split(".")[-1] == EXPERTS_MODULE and any(True for _ in module.parameters(recurse=False))}
