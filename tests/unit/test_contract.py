"""The model.py contract is written once (autopar/sections/contract.py): planning feeds batches and takes
losses with the functions the generated module is written with."""
from __future__ import annotations

import ast

import pytest
import torch
from torch import nn

from autopar import model_file
from autopar.sections import contract
from autopar.codegen.assemble import section_source


class Takes(nn.Module):
    def __init__(self):
        super().__init__()
        self.module = nn.Linear(2, 2)  # a submodule that happens to be called `module`

    def forward(self, ids, mask=None):
        return self.module(ids)


class Forwarding(nn.Module):
    """DDP's shape: forward(*inputs, **kwargs) to the wrapped .module."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.module = inner

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)


def test_planning_uses_the_contract_the_generated_module_is_written_with():
    assert model_file.model_inputs is contract.model_inputs
    assert model_file.accepted_kwargs is contract.accepted_kwargs
    functions = {node.name for node in ast.parse(section_source("contract")).body if isinstance(node, ast.FunctionDef)}
    assert {"model_inputs", "compute_loss", "accepted_kwargs", "signature_module"} <= functions


def test_a_forwarding_wrapper_is_looked_through_and_a_submodule_named_module_is_not():
    """A dict batch feeds what forward takes: the model's own signature, even with a child named
    `module`; through a wrapper that forwards everything, the wrapped model's (labels stay out)."""
    batch = {"ids": torch.ones(1, 2), "mask": torch.ones(1, 2), "labels": torch.zeros(1)}
    model = Takes()
    assert set(contract.model_inputs(model, batch)[1]) == {"ids", "mask"}
    assert set(contract.model_inputs(Forwarding(model), batch)[1]) == {"ids", "mask"}
    assert contract.signature_module(model) is model


def test_no_loss_is_the_model_files_fault_in_planning():
    """The generated module raises NoLoss (a TypeError); planning names model.py and the fix."""
    from autopar.errors import ModelFileError

    class Bare:
        loss_fn = None
        path = type("P", (), {"name": "model.py"})()

    with pytest.raises(contract.NoLoss):
        contract.compute_loss(Bare(), ("not", "a", "loss"), {})
    with pytest.raises(ModelFileError, match="defines no loss_fn"):
        model_file.compute_loss(Bare(), ("not", "a", "loss"), {})
    assert contract.compute_loss(Bare(), torch.ones(2), {}).item() == 1.0
