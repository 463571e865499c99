"""What code generation needs to know about the model beyond the plan, found without real memory.

The model is built and run once under FakeTensorMode (as planning does), and we record:
each module's class, which parameters are tied, and how each module is called (its first
input positionally or by keyword), which decides how a tensor-parallel input style is written.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar.codegen.in_place import outputs_modified_in_place
from autopar.model_file import FakeBuild, build_fake_for, call_model, load_model_file
from autopar.sections.contract import tokens_per_sample
from autopar.sections.expert_parallel import router_width
from autopar.trace.linear_like import affine_layout
from autopar.trace.experts import experts_inputs
from autopar.trace.sequence import position_argument
from cost_models.expert_parallel import feed_forward_width, is_dropless

NORM_CLASS_HINTS = ("norm",)


@dataclass(frozen=True)
class ModuleFacts:
    """One module: its kind and how its forward was called.

    Attributes:
        class_name: the module's class.
        kind: "linear", "embedding", "norm", "container" or "other".
        first_input: None if the first input came positionally, else its keyword name.
        has_parameters: whether it directly or indirectly holds parameters.
        called: whether the forward ran the module (unused modules get no styles).
        outputs: how many values forward returned as a tuple/list, or None for a single value.
        positional_inputs: how many arguments its first call passed positionally (a Hugging Face
            BERT layer gets the hidden states and its attention mask).
        transposed: a linear layer storing its weight ``(in, out)`` (GPT-2's Conv1D), split by
            the transposed styles (sections/linear_like.py) rather than torch's.
        output_modified_in_place: the model's code modifies its output in place (Falcon's
            ``mlp_output += ...``): a split copies it (autopar.codegen.in_place).
    """

    class_name: str
    kind: str
    first_input: str | None
    has_parameters: bool
    called: bool
    outputs: int | None = None
    positional_inputs: int = 1
    transposed: bool = False
    output_modified_in_place: bool = False


@dataclass(frozen=True)
class ModelFacts:
    """Facts about the model as the plan's model kwargs build it.

    Attributes:
        modules: FQN -> ModuleFacts, in definition order ("" is the root).
        tied_parameters: groups of parameter FQNs sharing one tensor (definition order).
        children: FQN -> its direct children's FQNs.
        position_argument: the root forward's token-position argument (position_ids / positions),
            which context parallelism feeds with each rank's global positions; None if it has none.
        mask_argument: the root forward's padding-mask argument (attention_mask), or None.
        dropless_experts: its experts modules route their own tokens (exchanged dropless, with
            sizes that follow the routing: cost_models.expert_parallel.ExpertExchange).
        expert_width: what every experts module's feed-forward width divides into (0: expert
            tensor parallelism cannot split it; cost_models.expert_parallel.feed_forward_width).
        seq_len: tokens per sample of the example batch (1 for data without a sequence).
        vocab_rows: rows of the model's largest nn.Embedding (the most token ids it can take;
            0 without one).
    """

    modules: dict[str, ModuleFacts]
    tied_parameters: list[list[str]]
    children: dict[str, list[str]] = field(default_factory=dict)
    position_argument: str | None = None
    mask_argument: str | None = None
    dropless_experts: bool = False
    expert_width: int | None = None
    seq_len: int = 1
    vocab_rows: int = 0

    def kind(self, name: str) -> str:
        return self.modules[name].kind if name in self.modules else "other"


def module_kind(module: nn.Module) -> str:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if affine_layout(module) is not None:
        return "linear"  # an affine map by what its forward computes (autopar.trace.linear_like)
    if isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return "container"
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) \
            or any(h in type(module).__name__.lower() for h in NORM_CLASS_HINTS):
        return "norm"
    return "other"


def inspect_model(model_path: str | Path, model_kwargs: dict[str, Any], batch_size: int = 1,
                  real_values: str | None = None) -> ModelFacts:
    """Build ``model_path``'s model under FakeTensorMode, run one forward, and record its facts
    (built for real where the plan says fake tensors cannot run it: ``real_values``)."""
    model_file = load_model_file(model_path)
    return build_fake_for(model_file, model_kwargs, batch_size, _inspect_built, real_values=real_values)


def _inspect_built(build: FakeBuild) -> ModelFacts:
    model = build.model
    first_inputs: dict[str, str | None] = {}
    positional: dict[str, int] = {}
    outputs: dict[str, int | None] = {}
    handles = []
    for name, module in model.named_modules():
        def record(mod: nn.Module, args: tuple, kwargs: dict, name: str = name) -> None:
            if name in first_inputs:
                return
            positional[name] = len(args)
            if args:
                first_inputs[name] = None
            else:
                parameters = list(inspect.signature(mod.forward).parameters)
                first_inputs[name] = (parameters[0] if parameters and parameters[0] in kwargs
                                      else next(iter(kwargs), None))
        def record_output(mod: nn.Module, args: tuple, output: Any, name: str = name) -> None:
            outputs.setdefault(name, len(output) if isinstance(output, (tuple, list)) else None)
        handles.append(module.register_forward_pre_hook(record, with_kwargs=True))
        handles.append(module.register_forward_hook(record_output))
    try:
        with build.active(), torch.no_grad():
            modified = outputs_modified_in_place(model, lambda: call_model(model, build.batch))
    finally:
        for handle in handles:
            handle.remove()
    modules = {name: ModuleFacts(class_name=type(module).__name__, kind=module_kind(module),
                                 first_input=first_inputs.get(name),
                                 has_parameters=any(True for _ in module.parameters()),
                                 called=name in first_inputs, outputs=outputs.get(name),
                                 positional_inputs=positional.get(name, 1),
                                 transposed=bool(getattr(affine_layout(module), "transposed", False)),
                                 output_modified_in_place=name in modified)
               for name, module in model.named_modules()}
    children = {name: [f"{name}.{child}" if name else child for child, _ in module.named_children()]
                for name, module in model.named_modules()}
    return ModelFacts(modules=modules, tied_parameters=tied_parameter_groups(model), children=children,
                      position_argument=position_argument(model),
                      mask_argument="attention_mask" if "attention_mask" in inspect.signature(model.forward).parameters
                      else None,
                      dropless_experts=is_dropless(experts_inputs(model)), expert_width=experts_width(model),
                      seq_len=tokens_per_sample(build.batch),
                      vocab_rows=max((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)),
                                     default=0))


def experts_width(model: nn.Module) -> int | None:
    """What every experts module's feed-forward width divides into (None: no experts; 0: one
    cannot be split)."""
    widths = [feed_forward_width([list(p.shape) for p in module.parameters(recurse=False)],
                                 router_width(model, name, next(module.parameters(recurse=False)).shape[0]))
              for name, module in model.named_modules()
              if name.split(".")[-1] == "experts" and any(True for _ in module.parameters(recurse=False))]
    if not widths:
        return None
    return math.gcd(*widths) if all(widths) else 0


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Parameter FQNs that name the same tensor, grouped, first definition first."""
    by_tensor: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(parameter), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]
