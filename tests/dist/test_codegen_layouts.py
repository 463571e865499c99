"""What each ZeRO stage, TP and PP leave on a rank: the memory-saving properties the cost model
prices, checked on the generated module's own setup (2 gloo ranks, tiny GPT)."""
from __future__ import annotations


import pytest
import torch
from torch.distributed.tensor import DTensor

from autopar.runtime.generated import command_line, import_generated
from autopar.codegen import generate
from tests.dist.harness import run_ranks
from tests.dist.plans import GPT, make_plan

CASES = {
    "zero0": dict(dp=2, zero=0),
    "zero1": dict(dp=2, zero=1),
    "zero2": dict(dp=2, zero=2),
    "zero3": dict(dp=2, zero=3),
    "tp2": dict(tp=2),
    "pp2": dict(pp=2),
}


def _local_numel(tensor: torch.Tensor) -> int:
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()


def _inspect(rank: int, world_size: int, scripts: dict[str, str]) -> dict[str, dict]:
    """Set each generated module up (no training) and report what this rank holds."""
    torch.set_num_threads(1)
    facts = {}
    for name, script in scripts.items():
        module = import_generated(script, f"layout_{name}")
        args = command_line(module, lr=1e-3)
        training, config = module.train_config(module.PLAN, args), module.parallel_config(module.PLAN)
        model_module = module.load_model_file(training.model_file)
        parallel = module.setup(training, config, module.tp_plan, model_module, torch.device("cpu"))
        root = parallel.modules[0]
        params = dict(module.named_parameters_in_stage(root)) if parallel.schedule else dict(root.named_parameters())
        fact = {"local_numel": sum(_local_numel(p) for p in {id(p): p for p in params.values()}.values()),
                "names": sorted(params), "optimizer": type(parallel.optimizer).__name__,
                "shard_numel": getattr(getattr(parallel.optimizer, "shard", None), "numel", lambda: None)()}
        if name == "tp2":
            fact["q_proj"] = tuple(params["blocks.0.attn.q_proj.weight"].to_local().shape)
            fact["out_proj"] = tuple(params["blocks.0.attn.out_proj.weight"].to_local().shape)
        if name in ("zero2", "zero3"):
            # One forward without backward: ZeRO-3 frees the gathered block parameters right
            # away; ZeRO-2 keeps them for the backward that would follow.
            batch = module.local_batch(training, config, model_module, 0, parallel.mesh, torch.device("cpu"))
            micro = module.slice_batch(batch, 0, training.micro_batch_size)
            root(**module.model_inputs(root, micro)[1])
            fact["block_weight_after_forward"] = type(root.blocks[1].attn.q_proj.weight).__name__
        facts[name] = fact
    return facts


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    scripts = {name: str(generate(make_plan(GPT, **pins), GPT.path, root / name).script)
               for name, pins in CASES.items()}
    return run_ranks(_inspect, 2, scripts, timeout_s=600)


def _total_numel() -> int:
    from autopar.model_file import build_model, load_model_file
    return sum(p.numel() for p in build_model(load_model_file(GPT.path), GPT.kwargs).parameters())


def test_zero0_and_zero1_replicate_parameters_and_only_zero1_shards_optimizer_state(layouts):
    total = _total_numel()
    for rank in layouts:
        assert rank["zero0"]["local_numel"] == total and rank["zero0"]["optimizer"] == "LocalAdamW"
        assert rank["zero1"]["local_numel"] == total and rank["zero1"]["optimizer"] == "ShardedAdamW"
        assert rank["zero1"]["shard_numel"] == pytest.approx(total / 2, abs=1)


def test_zero2_and_zero3_shard_parameters_and_differ_after_forward(layouts):
    total = _total_numel()
    for rank in layouts:
        for stage in ("zero2", "zero3"):
            assert rank[stage]["local_numel"] == pytest.approx(total / 2, rel=0.02)
        assert rank["zero3"]["block_weight_after_forward"] == "DTensor"  # resharded after forward
        assert rank["zero2"]["block_weight_after_forward"] == "Parameter"  # kept gathered for backward


def test_tensor_parallel_splits_attention_heads_and_output_rows(layouts):
    for rank in layouts:
        assert rank["tp2"]["q_proj"] == (16, 32)  # half the heads: output features split
        assert rank["tp2"]["out_proj"] == (32, 16)  # row-parallel: input features split


def test_pipeline_ranks_hold_only_their_stages_layers(layouts):
    first, last = layouts[0]["pp2"]["names"], layouts[1]["pp2"]["names"]
    assert {n.split(".")[1] for n in first if n.startswith("blocks.")} == {"0", "1"}
    assert {n.split(".")[1] for n in last if n.startswith("blocks.")} == {"2", "3"}
    assert "wpe.weight" in first and "wpe.weight" not in last and "ln_f.weight" in last
    # The tied embedding/head has a copy on each end of the pipeline.
    assert "wte.weight" in first and "lm_head.weight" in last
