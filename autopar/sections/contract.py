"""The model.py contract: load the user's file by path, make batches, feed them, take the loss.

Written once: planning (autopar.model_file, the trace) feeds batches and takes losses with these
functions, and the generated module is written with this file's text (a section of its own,
autopar/codegen/assemble.py), so what was traced and what runs take the same inputs. It imports
nothing of autopar, so the generated file runs where autopar is not installed.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode


def import_file(path: str | Path, name: str) -> Any:
    """Import a Python file by its path under ``name``, registered first (its dataclasses look
    their module up while it executes); by path, so no module on sys.path can stand in for it."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path} is not a Python file that can be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_model_file(path: str | Path) -> Any:
    """Import model.py from its path; its folder goes on sys.path so it can import neighbours."""
    path = Path(path).resolve()
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    return import_file(path, f"user_model_{path.stem}")


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def accepted_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``kwargs`` that ``fn``'s signature takes (all of them if it has **kw)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(kwargs)
    names = {p.name for p in params
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


def build_model(model_module: Any, model_kwargs: dict[str, Any], seed: int) -> torch.nn.Module:
    """The unsharded model, on CPU, from ``seed``: every rank builds the same weights, so the
    sharded model starts exactly where a single-device run of the original would."""
    torch.manual_seed(seed)
    return model_module.build_model(**accepted_kwargs(model_module.build_model, model_kwargs))


def make_batch(model_module: Any, model_kwargs: dict[str, Any], batch_size: int, seed: int) -> Any:
    """``example_batch(batch_size)`` drawn from its own seed, without disturbing the global RNG.

    Every rank draws the same global batch for a step and keeps its data-parallel slice, so any
    plan (and the single-process reference) trains on exactly the same samples.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_module.example_batch(batch_size, **accepted_kwargs(model_module.example_batch, model_kwargs))


def _forwards_everything(forward: Callable[..., Any]) -> bool:
    params = inspect.signature(forward).parameters.values()
    return any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params) \
        and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def signature_module(model: nn.Module) -> nn.Module:
    """The module whose forward says what a batch feeds: ``model``, or the module a wrapper that
    forwards everything (DDP's ``forward(*inputs, **kwargs)``) holds as ``.module``."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) and _forwards_everything(model.forward) else model


def model_inputs(model: nn.Module, batch: Any) -> tuple[tuple, dict]:
    """(args, kwargs) for forward: a dict batch becomes keyword arguments (only those forward
    takes, so labels may ride along for the loss), a tuple/list positional ones, a tensor the
    single argument."""
    forward = signature_module(model).forward
    if isinstance(batch, dict):
        return (), accepted_kwargs(forward, batch)
    if isinstance(batch, (tuple, list)):
        params = inspect.signature(forward).parameters.values()
        if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params):
            return tuple(batch), {}
        positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                       inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        return tuple(batch[: max(1, len(positional))]), {}
    return (batch,), {}


class NoLoss(TypeError):
    """The model's output holds no loss and model.py defines no loss_fn."""


def compute_loss(model_module: Any, output: Any, batch: Any) -> torch.Tensor:
    """``loss_fn(output, batch)`` if model.py defines it, else ``output.loss``, else the mean."""
    loss_fn = getattr(model_module, "loss_fn", None)
    if callable(loss_fn):
        return loss_fn(output, batch)
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, torch.Tensor):
        return output.float().mean()
    raise NoLoss(f"the model returned {type(output).__name__} with no loss and model.py "
                 "defines no loss_fn(output, batch)")


_DROPOUTS = frozenset({F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout})
_SDPA_DROPOUT_P = 4  # scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, ...)
_RNNS = frozenset({torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu})  # what nn.LSTM, nn.GRU, nn.RNN call
_RNN_DROPOUT = 5


class DropoutOff(TorchFunctionMode):
    """While active, the forward's dropout draws nothing: `F.dropout` and its variants (what
    nn.Dropout and Hugging Face's eager attention call) return their input, and attention's own
    dropout (scaled_dot_product_attention's ``dropout_p``, nn.MultiheadAttention's) and the
    dropout between a stacked nn.LSTM's, nn.GRU's or nn.RNN's layers are off.
    Compile's check trains the sharded plan and the one-process reference under it: a mask drawn
    for a slice of the batch or a shard of the activations is not the one a single process draws,
    so with dropout on no sharded run could equal one process. Training runs with dropout on
    unless the module is given --dropout-off. Random draws of other kinds (a router sampling its
    experts, noise added to inputs) are left as they are."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}  # copied only where changed: this runs for every torch call of the step
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            if len(args) > _SDPA_DROPOUT_P:
                args = (*args[:_SDPA_DROPOUT_P], 0.0, *args[_SDPA_DROPOUT_P + 1:])
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
        elif func is F.multi_head_attention_forward:
            kwargs = {**kwargs, "training": False}  # its only use of the flag is the attention weights' dropout
        elif func in _RNNS:
            # (input, hx, params, has_biases, layers, dropout, ...), or packed (data, batch_sizes,
            # hx, params, ...): the dropout between stacked layers, one place later when packed
            packed = isinstance(args[1], torch.Tensor) and args[1].dtype == torch.int64 and args[1].dim() == 1
            at = _RNN_DROPOUT + packed
            args = (*args[:at], 0.0, *args[at + 1:])
        return func(*args, **kwargs)


def map_batch(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``fn`` applied to every tensor of a batch: a tensor, or dicts, tuples and lists of them."""
    if isinstance(batch, dict):
        return {k: map_batch(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_batch(v, fn) for v in batch)
    return fn(batch)


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Rows ``start:stop`` of every tensor in the batch (dim 0 is the sample dim)."""
    return map_batch(batch, lambda tensor: tensor[start:stop])


def tokens_per_sample(batch: Any) -> int:
    """Sequence length of the first integer tensor of shape (batch, seq, ...); 1 for other data."""
    leaves = (list(batch.values()) if isinstance(batch, dict)
              else list(batch) if isinstance(batch, (tuple, list)) else [batch])
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and not leaf.is_floating_point():
            return int(leaf.shape[1])
    return 1


def holds_parameters(model: nn.Module, name: str) -> bool:
    """Whether ``model`` has module ``name`` with parameters (a pipeline stage drops others')."""
    try:
        return bool(list(model.get_submodule(name).parameters()))
    except AttributeError:
        return False


def tensor_of(module: nn.Module, name: str) -> torch.Tensor:
    """A module's parameter or buffer by name (torch types a module's attributes as Tensor or
    Module); what is not a tensor is a bug of the caller."""
    value = getattr(module, name)
    assert isinstance(value, torch.Tensor), f"{type(module).__name__}.{name} is not a tensor"
    return value


def bias_of(module: nn.Module) -> torch.Tensor | None:
    """A linear-like module's bias, None where it has none."""
    return tensor_of(module, "bias") if getattr(module, "bias", None) is not None else None
