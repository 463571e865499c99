"""Capture one training step (forward, loss and backward) as an fx graph of ATen ops.

We trace `make_fx` over a function that runs the model functionally, computes the loss and
calls `torch.autograd.grad`, with every tensor a FakeTensor: the joint graph costs no real
memory, and a model written for eager mode (including Hugging Face code that checks
`is_fake_tensor` to skip data-dependent branches) runs unchanged.

Every node is annotated (``node.meta["custom"]``) with the FQN of the innermost module whose
forward produced it. Backward nodes are matched to the forward op that created their autograd
node through `seq_nr`: hooks on the autograd graph publish each node's sequence number while
it runs, which is how PyTorch's own AOT tracer copies forward metadata onto backward nodes.
"""
from __future__ import annotations

import contextlib
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx
from torch.func import functional_call

from autopar.data_dependent import is_data_dependent, user_frame
from autopar.errors import TraceError
from autopar.trace.grouped_mm import allow_fp32_grouped_mm_on_fake_tensors
from autopar.trace.ops import op_name
from autopar.model_file import FakeBuild, ModelFile, check_batch_feeds, compute_loss, model_inputs

MODULE_KEY = "autopar_module"
PHASE_KEY = "autopar_phase"
FORWARD, BACKWARD = "forward", "backward"


@dataclass
class CapturedStep:
    """The joint graph plus what is needed to read it.

    Attributes:
        graph_module: forward + backward ATen graph; placeholders are parameters, buffers, then
            the batch's tensors, in that order.
        param_names: FQN of each parameter placeholder (tied weights appear once).
        buffer_names: FQN of each buffer placeholder.
        node_module: fx node name -> FQN of the module that produced it ("" for the root, None
            for code outside the model such as the loss).
        node_phase: fx node name -> "forward" or "backward".
    """

    graph_module: torch.fx.GraphModule
    param_names: list[str]
    buffer_names: list[str]
    node_module: dict[str, str | None]
    node_phase: dict[str, str]

    def forward_calls(self) -> Iterator[torch.fx.Node]:
        """The forward pass's op calls, in graph order."""
        return (node for node in self.graph_module.graph.nodes
                if node.op == "call_function" and self.node_phase.get(node.name) != BACKWARD)

    def forward_calls_of(self, ops: Mapping[str, int]) -> Iterator[tuple[torch.fx.Node, str, Any]]:
        """The forward calls of the ATen ops named in ``ops`` (op name -> index of an argument),
        each with its name and that argument (None when not passed)."""
        for node in self.forward_calls():
            name = next((part for part in op_name(node.target).split(".") if part in ops), None)
            if name is not None:
                index = ops[name]
                yield node, name, node.args[index] if len(node.args) > index else None


def capture_training_step(model_file: ModelFile, build: FakeBuild) -> CapturedStep:
    """Trace forward + loss + backward of ``build.model`` on ``build.batch``.

    Args:
        model_file: supplies the loss and how a batch is fed to the model.
        build: model and batch made under one FakeTensorMode.
    """
    allow_fp32_grouped_mm_on_fake_tensors()
    model = build.model
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    module_names = {module: name for name, module in model.named_modules(remove_duplicate=False)}
    annotations = _ModuleAnnotations(module_names)
    # Frozen parameters (requires_grad=False: a fine-tuning set-up, a fixed positional table)
    # get no gradient; asking autograd for one would fail the whole trace.
    trainable = [name for name, param in params.items() if param.requires_grad]

    def training_step(params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor], batch: Any):
        args, kwargs = model_inputs(model, batch)
        with annotations.installed():
            output = functional_call(model, {**params, **buffers}, args, kwargs)
            loss = compute_loss(model_file, output, batch)
        _publish_seq_nr_during_backward(loss)
        with fx_traceback.annotate({PHASE_KEY: BACKWARD}):
            grads = torch.autograd.grad(loss, [params[name] for name in trainable], allow_unused=True)
        return loss, grads

    check_batch_feeds(model, build.batch, model_file)
    with fx_traceback.preserve_node_meta(), build.active():
        try:
            graph_module = make_fx(training_step)(params, buffers, build.batch)
        except Exception as err:  # noqa: BLE001 - reported with the module and construct
            raise _trace_error(err, annotations.stack_at_failure, model_file.path, build.data_dependent) from None
        finally:
            annotations.unwind()
    node_module, node_phase = _attribute_nodes(graph_module)
    return CapturedStep(graph_module=graph_module, param_names=list(params),
                        buffer_names=list(buffers), node_module=node_module, node_phase=node_phase)


class _ModuleAnnotations:
    """Global forward hooks that tag every traced op with its innermost module's FQN."""

    def __init__(self, module_names: dict[torch.nn.Module, str]):
        self.module_names = module_names
        self.open: list[tuple[str, contextlib.AbstractContextManager]] = []
        self.stack_at_failure: list[str] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._enter)
        post = torch.nn.modules.module.register_module_forward_hook(self._exit)
        try:
            yield
        except Exception:
            self.stack_at_failure = [name for name, _ in self.open]
            raise
        finally:
            pre.remove()
            post.remove()

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        name = self.module_names.get(module)
        if name is None:
            return
        context = fx_traceback.annotate({MODULE_KEY: name})
        context.__enter__()
        self.open.append((name, context))

    def _exit(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.module_names.get(module) is not None and self.open:
            self.open.pop()[1].__exit__(None, None, None)

    def unwind(self) -> None:
        """Close annotations left open by a forward that raised."""
        while self.open:
            with contextlib.suppress(Exception):
                self.open.pop()[1].__exit__(None, None, None)


def _publish_seq_nr_during_backward(loss: torch.Tensor) -> None:
    """Make each backward op carry the seq_nr of the forward op whose autograd node it runs."""
    if loss.grad_fn is None:
        raise TraceError("The loss does not depend on any parameter, so there is no backward to plan.",
                         "return a loss computed from the model's output.")
    seen: set[torch.autograd.graph.Node] = set()
    todo: list[torch.autograd.graph.Node | None] = [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        seq_nr = node._sequence_nr()
        node.register_prehook(lambda grad_outputs, seq_nr=seq_nr: fx_traceback.set_grad_fn_seq_nr(seq_nr))
        node.register_hook(lambda grad_inputs, grad_outputs: fx_traceback.reset_grad_fn_seq_nr())
        todo.extend(next_node for next_node, _ in node.next_functions)


def _attribute_nodes(graph_module: torch.fx.GraphModule) -> tuple[dict[str, str | None], dict[str, str]]:
    """Phase and owning module of every node (backward nodes via their forward op's seq_nr)."""
    node_module: dict[str, str | None] = {}
    node_phase: dict[str, str] = {}
    module_of_seq_nr: dict[int, str | None] = {}
    previous_backward_module: str | None = None
    for node in graph_module.graph.nodes:
        custom = node.meta.get("custom") or {}
        seq_nr = node.meta.get("seq_nr")
        if custom.get(PHASE_KEY) == BACKWARD:
            node_phase[node.name] = BACKWARD
            module = module_of_seq_nr.get(seq_nr, previous_backward_module)
            previous_backward_module = module
        else:
            node_phase[node.name] = FORWARD
            module = custom.get(MODULE_KEY)
            if seq_nr is not None and node.op == "call_function":
                module_of_seq_nr.setdefault(seq_nr, module)
        node_module[node.name] = module
    return node_module, node_phase


def _raised_in(err: Exception, model_path: Path, function: str) -> bool:
    """Whether the innermost frame of the user's model.py that ``err`` passed through is ``function``."""
    mine = [frame for frame in traceback.extract_tb(err.__traceback__)
            if Path(frame.filename).resolve() == Path(model_path).resolve()]
    return bool(mine) and mine[-1].name == function


def _trace_error(err: Exception, module_stack: list[str], model_path: Path, retried: bool) -> TraceError:
    """Name the module and the construct that stopped tracing, and how to fix it.

    A stop at a tensor's value is marked ``data_dependent`` so the caller traces again with the
    batch's values (autopar.data_dependent); ``retried`` says that was already done."""
    module = module_stack[-1] if module_stack else "(outside any module)"
    where = user_frame(traceback.extract_tb(err.__traceback__)) or "an unknown location"
    text = f"{type(err).__name__}: {err}".splitlines()[0]
    data_dependent = is_data_dependent(err)
    if data_dependent and retried:
        construct = ("a branch or size that depends on a tensor's value computed from the weights, which "
                     "planning does not have (values computed from the batch alone are read)")
        fix = ("make the branch depend on shapes or configuration, or on the batch's values, use "
               "torch.where / torch._check, or move the check out of forward().")
    elif data_dependent:
        construct = "data-dependent control flow (a Python branch or .item() on a tensor's value)"
        fix = ("make the branch depend on shapes or configuration instead of tensor values, use "
               "torch.where / torch._check, or move the check out of forward().")
    elif isinstance(err, TypeError) and "object is not callable" in str(err) and _raised_in(err, model_path, "loss_fn"):
        construct = (f"loss_fn called its first argument ({text}), but autopar calls loss_fn(output, batch) with what "
                     "the model's forward returned, not with the model")
        fix = "compute the loss from the output in loss_fn(output, batch); autopar runs the model itself."
    else:
        construct = f"an operation that cannot run on fake tensors ({text})"
        fix = ("register a fake kernel for a custom op (torch.library.register_fake), or write the module "
               "with standard torch ops.")
    error = TraceError(f"Tracing stopped in module '{module}' at {where}: {construct}.", fix)
    error.data_dependent = data_dependent and not retried
    if not data_dependent or retried:
        # A real build may run it (autopar.model_file.build_real): say where and why. A value read
        # from the weights is there too: building may have made it (ConvNeXt's drop-path rates).
        error.fake_unsupported = f"{where}: {text}"
    return error
