"""Cutting a model into pipeline stages without ranks: what a skipped layer stands in for, which
values a module split would not carry, and what a traced split sends."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipeline
from transformers.modeling_outputs import BaseModelOutput

from autopar.sections.pipeline import SkippedLayer, StageExit, send_contiguous, split_stage
from autopar.codegen.stage_flow import layer_reads, uncarried_read
from tests.dist.plans import GPT, boundary_stages

ZOO_MODELS = Path(__file__).resolve().parents[1] / "zoo" / "models"
CPU = torch.device("cpu")


class _Encoder(nn.Module):
    """A layer returning a Hugging Face output object, read by position and by name after it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> BaseModelOutput:
        return BaseModelOutput(last_hidden_state=self.proj(x))


def test_skipped_layer_keeps_the_output_type_and_answers_attribute_reads_from_memory_it_does_not_hold():
    skipped = SkippedLayer(_Encoder(), CPU)
    output = skipped(torch.randn(2, 3, 4))
    assert isinstance(output, BaseModelOutput)  # code after the layer reads output[0], output.last_hidden_state
    assert output[0].shape == (2, 3, 4) and not output[0].is_meta and output[0].abs().sum() == 0
    assert skipped.proj.weight.dtype == torch.float32 and skipped.proj.weight.is_meta  # ViT reads a weight's dtype
    assert list(skipped.parameters()) == []  # trained by the stage that owns it, not this one



class _TypedLayers(nn.Module):
    """ModernBERT's habit: forward reads each layer's attribute before calling it (which mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        for index, layer in enumerate(self.layers):
            layer.attention_type = "global" if index % 2 == 0 else "sliding"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x) * (1.0 if layer.attention_type == "global" else 0.5)
        return x


def test_a_stage_exit_answers_the_later_layers_attribute_reads_without_holding_their_weights():
    stage = split_stage(_TypedLayers(), [["layers.0"], ["layers.1", "layers.2"]], 0, None, torch.randn(2, 4), CPU)
    exits = list(stage.model.layers)[1:]
    assert all(isinstance(layer, StageExit) for layer in exits)
    assert [layer.attention_type for layer in exits] == ["sliding", "global"]
    assert all(layer.weight.is_meta for layer in exits)  # read from a meta copy: no memory held
    assert len(list(stage.parameters())) == 2  # layers.0's weight and bias only

class _Experts(nn.Module):
    """A fp32 grouped GEMM, as Hugging Face's MoE experts run it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        offsets = torch.tensor([3, tokens.shape[0]], dtype=torch.int32, device=tokens.device)
        return torch._grouped_mm(tokens, self.weight, offs=offsets)


def test_skipped_fp32_grouped_gemm_is_shaped_although_its_meta_kernel_takes_only_bf16():
    tokens = torch.randn(5, 8)
    expected = _Experts()(tokens)  # the CPU kernel takes fp32
    output = SkippedLayer(_Experts(), CPU)(tokens)
    assert (output.shape, output.dtype) == (expected.shape, torch.float32)


class _ExpertsByIndex(nn.Module):
    """DBRX's expert loop: each expert's weight indexed with a 0-d tensor (``.item()``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 8, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(tokens)
        for expert in torch.tensor([0, 2]):
            out = out + tokens @ self.weight[expert]
        return out


class _ExpertsBySizes(nn.Module):
    """JetMoE's expert loop: the tokens per expert copied to the host (``.tolist()``), which on
    meta tensors raises NotImplementedError, not the RuntimeError of ``.item()``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        chosen = (tokens[:, 0] > 0).long()
        gates = torch.zeros(tokens.shape[0], 2, device=tokens.device).scatter(1, chosen[:, None], 1)
        sizes = gates.long().sum(0).tolist()
        order = chosen.argsort()
        parts = [part @ self.weight[i] for i, part in enumerate(tokens[order].split(sizes))]
        return torch.cat(parts)[order.argsort()]


@pytest.mark.parametrize("layer", [_ExpertsByIndex, _ExpertsBySizes])
def test_a_layer_that_reads_a_value_is_shaped_like_its_input(layer):
    tokens = torch.randn(5, 8)
    output = SkippedLayer(layer(), CPU)(tokens)
    assert output.shape == layer()(tokens).shape and not output.is_meta and output.abs().sum() == 0


class _Broken(nn.Module):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens @ torch.ones(3, 3)  # a shape error, not a value read


def test_a_layer_failing_otherwise_on_meta_still_fails():
    with pytest.raises(RuntimeError, match="same reduction dim"):
        SkippedLayer(_Broken(), CPU)(torch.randn(5, 8))


class _EncoderDecoder(nn.Module):
    """An encoder stack held as one ModuleList layer, iterated (never called) by forward."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.encoder:
            x = layer(x)
        return self.head(x)


def test_a_module_list_layer_is_skipped_and_exited_child_by_child():
    later = split_stage(_EncoderDecoder(), [["encoder"], ["head"]], 1, None, torch.randn(2, 4), CPU)
    assert all(isinstance(child, SkippedLayer) for child in later.model.encoder)
    earlier = split_stage(_EncoderDecoder(), [["head"], ["encoder"]], 0, None, torch.randn(2, 4), CPU)
    assert all(isinstance(child, StageExit) for child in earlier.model.encoder)


def test_a_stack_of_blocks_is_carried_by_its_first_input():
    reads = layer_reads(GPT.path, GPT.kwargs, GPT.layer_names)
    assert uncarried_read(boundary_stages(GPT), reads) is None


def test_an_encoder_output_read_by_decoder_layers_is_named_as_not_carried():
    """Both stacks split into blocks: the encoder's last block, read by every decoder block
    beside its first input, is what a cut between the stacks would not carry."""
    layers = ["embed", "pos", "encoder.0", "encoder.1", "decoder.0", "decoder.1", "norm", "head"]
    reads = layer_reads(ZOO_MODELS / "encdec.py", {}, layers)
    problem = uncarried_read([layers[:4], layers[4:]], reads)
    assert problem is not None and "decoder.0" in problem and "encoder.1 (stage 0)" in problem
    assert reads.first["encoder.1"] == {"encoder.0"}  # the encoder's blocks carry each other
    assert uncarried_read([layers], reads) is None  # one stage carries nothing


def test_a_loss_reading_the_first_stage_is_named_as_not_carried(tmp_path):
    model_file = tmp_path / "towers.py"
    model_file.write_text(textwrap.dedent("""
        import torch
        from torch import nn

        class Towers(nn.Module):
            def __init__(self):
                super().__init__()
                self.image = nn.Linear(4, 4)
                self.text = nn.Linear(4, 4)

            def forward(self, x):
                return self.image(x), self.text(x)

        def build_model():
            return Towers()

        def example_batch(batch_size):
            return torch.randn(batch_size, 4)

        def loss_fn(output, batch):
            return (output[0] * output[1]).sum()
    """))
    problem = uncarried_read([["image"], ["text"]], layer_reads(model_file, {}, ["image", "text"]))
    assert problem is not None and problem.startswith("the loss reads the output of image (stage 0)")


class _Transposing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).transpose(1, 2))


def test_a_traced_stage_sends_and_receives_contiguous_tensors_with_unchanged_values():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 4)
    pipe = pipeline(_Transposing(), mb_args=(x,), split_spec={"second": SplitPoint.BEGINNING})
    first, second = pipe.get_stage_module(0), pipe.get_stage_module(1)
    before = first(x)
    assert not before.is_contiguous()  # what gloo and NCCL refuse to send
    for stage in (first, second):
        send_contiguous(stage)
    after = first(x)
    assert after.is_contiguous() and torch.equal(after, before)
    received = [node.meta["val"] for node in second.graph.nodes if node.op == "placeholder"]
    assert all(value.is_contiguous() for value in received if isinstance(value, torch.Tensor))
    outputs = [node for node in first.graph.nodes if node.op == "output"][0].args[0]
    assert all(node.meta["val"].is_contiguous() for node in torch.fx.node.map_arg(outputs, lambda n: [n])
               if hasattr(node, "meta"))


def test_a_traced_pipeline_refuses_a_read_past_a_stage():
    """Cut into four (virtual) stages as the planner cut the encoder-decoder under interleaved
    1F1B, a decoder block reads the encoder two stages back and the loss reads the targets the
    first stage copies, which torch's traced stages cannot send; two stages carry every read."""
    from autopar.codegen.stage_flow import skipped_read

    layers = ["embed", "pos", "encoder.0", "encoder.1", "decoder.0", "decoder.1", "norm", "head"]
    reads = layer_reads(ZOO_MODELS / "encdec.py", {}, layers)
    four = [layers[:3], layers[3:5], layers[5:6], layers[6:]]
    assert skipped_read(four, reads) == "the loss reads the batch, which stage 0 copies, past the stages between"
    encoder_early = [layers[:2], layers[2:4], layers[4:5], layers[5:]]
    # The decoder's first block reads the embeddings the encoder's input came from, two stages back.
    assert skipped_read(encoder_early, reads) == ("layer decoder.0 (stage 2) reads the output of embed "
                                                  "(stage 0) past the stages between")
    assert skipped_read([layers[:4], layers[4:]], reads) is None


class _UnreadBias(nn.Module):
    """A masked-LM head as DeBERTa-v2 writes it with untied embeddings: the head's own bias
    beside a decoder that has one too, so the forward never reads it; the embedding is tied to
    a second name (``tied_embed``) read by nothing either."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.tied_embed = self.embed
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.decoder = nn.Linear(8, 16)
        self.bias = nn.Parameter(torch.randn(16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.decoder(x)


def test_a_traced_split_carries_a_parameter_no_graph_reads_on_the_first_stage_unchanged():
    from types import SimpleNamespace

    from autopar.sections.pipeline import named_parameters_in_stage, split_with_tracer

    torch.manual_seed(0)
    model = _UnreadBias()
    bias = model.bias.detach().clone()
    tokens = torch.randint(0, 16, (2, 5))
    batch = {"tokens": tokens, "targets": tokens}
    loss_of = SimpleNamespace(loss_fn=lambda output, b: nn.functional.cross_entropy(output.flatten(0, 1),
                                                                                     b["targets"].flatten()))
    pipe = split_with_tracer(model, [["layers.0"], ["layers.1"]], loss_of, batch)
    stages = [dict(named_parameters_in_stage(pipe.get_stage_module(i))) for i in range(pipe.num_stages)]
    every = {name for stage in stages for name in stage}
    assert every | {"tied_embed.weight"} == {name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert "bias" in stages[0] and "bias" not in stages[1] and torch.equal(stages[0]["bias"], bias)
    # The stage still runs its graph, which reads none of it: no gradient, so no step changes it.
    sent = pipe.get_stage_module(0)(tokens)
    sent = sent[0] if isinstance(sent, tuple) else sent
    sent.float().sum().backward()
    assert stages[0]["bias"].grad is None and stages[0]["embed.weight"].grad is not None
