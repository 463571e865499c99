"""Plans written for other engines (autopar/emit/): each file is read back by the engine's own
config classes (torchtitan's ParallelismConfig/TrainingConfig through tyro and its ParallelDims,
megatron-core's ModelParallelConfig and TransformerConfig, DeepSpeed's DeepSpeedConfig,
accelerate's config file and FSDP plugin), which validate it, and gives the plan's degrees back;
what an engine cannot run is refused by name."""
from __future__ import annotations

import argparse
import json
from dataclasses import field, make_dataclass

import pytest
import yaml

from autopar.emit import EngineRefusal, engine_files, write_engine_files
from autopar.errors import UserError
from tests.dist.plans import GPT, REPO, make_plan

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def plans():
    return {"zero3_dp4": make_plan(GPT, dp=4, zero=3),
            "zero2_dp2_tp2_sp": make_plan(GPT, dp=2, tp=2, zero=2, sp=True),
            "zero1_dp2_tp2_pp2_v2": make_plan(GPT, dp=2, tp=2, pp=2, zero=1, schedule="interleaved_1f1b", chunks=2),
            "cp2_ring_full": make_plan(GPT, dp=2, cp=2, zero=3, cp_strategy="ring",
                                       recompute={f"blocks.{i}": "full" for i in range(GPT.blocks)}),
            "dp2_zero0": make_plan(GPT, dp=2)}


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_torchtitan_reads_the_degrees_back(plans):
    import tyro
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import custom_registry
    from torchtitan.distributed import ParallelDims

    # The two sections of torchtitan's job config the file sets, parsed as its ConfigManager does.
    Job = make_dataclass("Job", [("parallelism", ParallelismConfig, field(default_factory=ParallelismConfig)),
                                 ("training", TrainingConfig, field(default_factory=TrainingConfig))])

    for name in ("zero3_dp4", "zero2_dp2_tp2_sp", "cp2_ring_full"):
        plan = plans[name]
        text = engine_files(plan, ["torchtitan"])["torchtitan_args.txt"]
        job = tyro.cli(Job, args=_lines(text), registry=custom_registry)
        p = job.parallelism
        dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                            cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                            ep=p.expert_parallel_degree, world_size=plan.world_size)
        assert (dims.dp_replicate * dims.dp_shard, dims.tp, dims.pp, dims.cp) == (plan.dp, plan.tp, plan.pp, plan.cp)
        assert p.enable_sequence_parallel == plan.sequence_parallel
        assert p.fsdp_reshard_after_forward == ("always" if plan.zero_stage == 3 else "never")
        assert job.training.global_batch_size == plan.global_batch_size
        assert job.training.local_batch_size * plan.dp == plan.global_batch_size
        assert ("full" in text) == (name == "cp2_ring_full")


def _megatron_args(text: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()  # the flags of Megatron-LM's arguments.py that the file uses
    for flag in ("tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size",
                 "expert-model-parallel-size", "expert-tensor-parallel-size", "micro-batch-size", "global-batch-size",
                 "num-virtual-stages-per-pipeline-rank", "recompute-num-layers"):
        parser.add_argument(f"--{flag}", type=int)
    for flag in ("cp-comm-type", "recompute-granularity", "recompute-method"):
        parser.add_argument(f"--{flag}")
    for flag in ("sequence-parallel", "use-distributed-optimizer", "bf16", "fp16"):
        parser.add_argument(f"--{flag}", action="store_true")
    return parser.parse_args([word for line in _lines(text) for word in line.split()])


def test_megatron_core_accepts_the_arguments(plans):
    import torch
    from megatron.core import ModelParallelConfig
    from megatron.core.transformer import TransformerConfig

    plan = plans["zero1_dp2_tp2_pp2_v2"]
    args = _megatron_args(engine_files(plan, ["megatron"])["megatron_args.txt"])
    parallel = ModelParallelConfig(tensor_model_parallel_size=args.tensor_model_parallel_size,
                                   pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                                   virtual_pipeline_model_parallel_size=args.num_virtual_stages_per_pipeline_rank,
                                   sequence_parallel=args.sequence_parallel,
                                   context_parallel_size=args.context_parallel_size,
                                   expert_model_parallel_size=args.expert_model_parallel_size,
                                   pipeline_dtype=torch.float32)
    assert (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
            parallel.virtual_pipeline_model_parallel_size) == (plan.tp, plan.pp, plan.chunks)
    assert args.use_distributed_optimizer and args.micro_batch_size == plan.micro_batch_size
    assert args.global_batch_size == plan.global_batch_size
    TransformerConfig(num_layers=GPT.blocks, hidden_size=GPT.kwargs["hidden"], num_attention_heads=GPT.kwargs["heads"],
                      tensor_model_parallel_size=args.tensor_model_parallel_size,
                      pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                      sequence_parallel=args.sequence_parallel, pipeline_dtype=torch.float32)
    full = _megatron_args(engine_files(plans["cp2_ring_full"], ["megatron"])["megatron_args.txt"]) \
        if plans["cp2_ring_full"].zero_stage <= 1 else None
    assert full is None  # ZeRO-3 is refused below


def test_deepspeed_config_holds_its_batch_arithmetic(plans, monkeypatch):
    from deepspeed.runtime import config as deepspeed_config
    from deepspeed.runtime.config import DeepSpeedConfig

    # Outside a process group DeepSpeed takes a world of 1 before asking the unit below.
    monkeypatch.setattr(deepspeed_config.dist, "get_rank", lambda *_: 0)

    class DataParallel:  # DeepSpeed asks a model-parallel unit for the data-parallel size
        def __init__(self, size: int):
            self.size = size

        def get_data_parallel_world_size(self) -> int:
            return self.size

        def get_model_parallel_world_size(self) -> int:
            return 1

    for name in ("zero3_dp4", "dp2_zero0"):
        plan = plans[name]
        settings = json.loads(engine_files(plan, ["deepspeed"])["deepspeed.json"])
        config = DeepSpeedConfig(settings, mpu=DataParallel(plan.dp))
        assert config.zero_optimization_stage == plan.zero_stage
        assert (config.train_batch_size, config.train_micro_batch_size_per_gpu, config.gradient_accumulation_steps) \
            == (plan.global_batch_size, plan.micro_batch_size, plan.num_micro_batches)


def test_accelerate_reads_the_fsdp_config(plans, tmp_path):
    from accelerate import FullyShardedDataParallelPlugin, ParallelismConfig
    from accelerate.commands.config.config_args import ClusterConfig

    plan = plans["zero2_dp2_tp2_sp"]
    path = write_engine_files(plan, ["accelerate"], tmp_path)[0]
    loaded = ClusterConfig.from_yaml_file(path)
    assert loaded.num_processes == plan.world_size and loaded.distributed_type == "FSDP"
    fsdp = loaded.fsdp_config
    plugin = FullyShardedDataParallelPlugin(fsdp_version=fsdp["fsdp_version"],
                                            reshard_after_forward=fsdp["fsdp_reshard_after_forward"],
                                            activation_checkpointing=fsdp["fsdp_activation_checkpointing"])
    assert plugin.reshard_after_forward is False  # ZeRO-2
    sizes = {key.removeprefix("parallelism_config_"): value for key, value in loaded.parallelism_config.items()}
    parallel = ParallelismConfig(**sizes)
    assert (parallel.dp_shard_size, parallel.tp_size, parallel.cp_size) == (plan.dp, plan.tp, plan.cp)


@pytest.mark.parametrize("case, engine, reason", [
    ("zero3_dp4", "megatron", "distributed optimizer is ZeRO-1"),
    ("zero1_dp2_tp2_pp2_v2", "torchtitan", "no ZeRO-1"),
    ("zero1_dp2_tp2_pp2_v2", "deepspeed", "tp=2 is model code"),
    ("zero1_dp2_tp2_pp2_v2", "accelerate", "no pipeline parallelism"),
    ("dp2_zero0", "accelerate", "not ZeRO-0"),
])
def test_what_an_engine_cannot_run_is_refused_by_name(plans, case, engine, reason):
    with pytest.raises(EngineRefusal, match=reason):
        engine_files(plans[case], [engine])


def test_a_refusal_writes_no_file_and_an_unknown_engine_is_named(plans, tmp_path):
    with pytest.raises(EngineRefusal):
        write_engine_files(plans["zero3_dp4"], ["deepspeed", "megatron"], tmp_path)
    assert not list(tmp_path.iterdir())
    with pytest.raises(UserError, match="no such engine.*torchtitan, megatron"):
        engine_files(plans["zero3_dp4"], ["nemo"])


def test_mixed_recomputation_is_refused_not_approximated():
    plan = make_plan(GPT, dp=2, zero=3, recompute={"blocks.0": "full", "blocks.1": "selective"})
    with pytest.raises(EngineRefusal, match="recomputation differs by block"):
        engine_files(plan, ["torchtitan"])
    assert yaml  # the accelerate file is YAML (read above)


SMALL = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "model.layers=2", "model.hidden=64", "model.heads=4",
         "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8", "train.precision=fp32"]


def test_plan_and_compile_write_the_engine_files_beside_plan_json(examples_dir, tmp_path, capsys):
    from autopar.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *SMALL, "plan.dp=2", "plan.zero_stage=3", "--emit", "deepspeed",
                 "--emit", "accelerate", "--out", str(out)]) == 0
    assert json.loads((tmp_path / "deepspeed.json").read_text())["zero_optimization"] == {"stage": 3}
    assert yaml.safe_load((tmp_path / "accelerate_fsdp.yaml").read_text())["num_processes"] == 2
    compiled = tmp_path / "compiled"
    assert main(["compile", str(examples_dir / "gpt.py"), *SMALL, "plan.dp=2", "plan.zero_stage=1",
                 "--emit", "megatron", "--out-dir", str(compiled)]) == 0
    assert "--use-distributed-optimizer" in (compiled / "megatron_args.txt").read_text()
    assert "megatron_args.txt" in capsys.readouterr().out


def test_a_plan_the_engine_cannot_run_writes_nothing(examples_dir, tmp_path, capsys):
    from autopar.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *SMALL, "plan.dp=2", "plan.zero_stage=3", "--emit", "megatron",
                 "--out", str(out)]) == 1
    assert "Megatron-LM's distributed optimizer is ZeRO-1" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def _settings_text(engine: str, run: dict) -> str:
    """A published row's settings as that engine's users write them."""
    plan = run["plan"]
    if engine == "megatron":  # Megatron-LM's SC21 scripts (run_table_1.sh)
        words = [f"--tensor-model-parallel-size {plan.get('tp', 1)}",
                 f"--pipeline-model-parallel-size {plan.get('pp', 1)}",
                 f"--micro-batch-size {plan['micro_batch_size']}", f"--global-batch-size {run['global_batch_size']}",
                 f"--num-layers {run['model']['layers']}", "--checkpoint-activations", "--fp16", "--seq-length 2048"]
        if plan.get("chunks", 1) > 1:
            per_stage = run["model"]["layers"] // (plan["pp"] * plan["chunks"])
            words.append(f"--num-layers-per-virtual-pipeline-stage {per_stage}")
        return " \\\n".join(words)
    return "\n".join([f"--parallelism.data_parallel_shard_degree={plan['dp']}",  # torchtitan's 8B FSDP run
                      f"--training.local_batch_size={plan['micro_batch_size']}",
                      f"--training.global_batch_size={run['global_batch_size']}",
                      f"--activation_checkpoint.mode={plan['recompute']}", "--training.seq_len=8192"])


@pytest.mark.parametrize("row, engine", [("A1-3.6B", "megatron"), ("A1-39.1B", "megatron"),
                                         ("D7-8B-fsdp8", "torchtitan")])
def test_an_engine_file_prices_like_the_published_rows_pins(row, engine, tmp_path):
    """`estimate --from` reads the row's settings as its engine spells them and prices exactly what
    the row's plan.* pins price."""
    from autopar.config import compose_config
    from autopar.driver import run_estimate
    from autopar.emit import read_engine_file
    from benchmarks.published.compare import cached_profile, load_runs, overrides

    run = next(r for r in load_runs() if r["id"] == row)
    path = tmp_path / ("args.txt")
    path.write_text(_settings_text(engine, run))
    settings = read_engine_file(path)
    assert settings.engine == engine
    pinned = overrides(run)
    base = [item for item in pinned if not item.startswith("plan.")]
    cfg = compose_config(pinned)
    profile = cached_profile(run, cfg)
    model = REPO / "examples" / run["model"]["file"]
    expected = run_estimate(model, cfg, profile=profile)[2].step_time_s
    priced = run_estimate(model, compose_config([*base, *settings.overrides()]), profile=profile)[2].step_time_s
    assert priced == pytest.approx(expected, rel=1e-9)
    assert settings.ignored == (["--seq-length"] if engine == "megatron" else ["--training.seq_len"])


def test_estimate_from_a_file_prints_it_beside_the_best_engine_config_and_the_best_plan(examples_dir, tmp_path, capsys):
    from autopar.cli import main

    file = tmp_path / "deepspeed.json"
    file.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 3},
                                "fp16": {"enabled": False}, "steps_per_print": 10, "wandb": {"enabled": True}}))
    assert main(["estimate", str(examples_dir / "gpt.py"), *SMALL, "--from", str(file)]) == 0
    out = capsys.readouterr().out
    yours = float(out.split("your config (deepspeed.json, deepspeed): ")[1].split()[0])
    engine_line = out.split("best deepspeed config: ")[1].splitlines()[0]
    assert "tp=1 pp=1 cp=1" in engine_line  # a DeepSpeed config splits data only
    best = float(out.split("best plan: ")[1].split(": ")[1].split()[0])
    assert best <= float(engine_line.split(": ")[1].split()[0]) <= yours * (1 + 1e-9)
    assert "not priced (not parallelism or batch settings): wandb" in out


@pytest.mark.parametrize("keys, reduced", [({"communication_data_type": "fp32"}, "fp32"),
                                            ({"fp32_allreduce": True}, "fp32"),
                                            ({"communication_data_type": "fp16"}, "compute"), ({}, None)])
def test_a_deepspeed_config_says_what_its_gradients_are_reduced_in(tmp_path, keys, reduced):
    """communication_data_type / fp32_allreduce pin train.grad_reduce_dtype; neither leaves it to
    the engine's default (the 16-bit gradients under fp16)."""
    from autopar.emit import read_engine_file

    file = tmp_path / "deepspeed.json"
    file.write_text(json.dumps({"fp16": {"enabled": True}, **keys}))
    settings = read_engine_file(file)
    assert settings.pins.get("train.grad_reduce_dtype") == reduced
    assert not settings.ignored


@pytest.mark.parametrize("flag, reduced", [("--accumulate-allreduce-grads-in-fp32", "fp32"),
                                          ("--grad-reduce-in-bf16", "compute"), ("", None)])
def test_megatron_arguments_say_what_its_gradients_are_reduced_in(tmp_path, flag, reduced):
    from autopar.emit import read_engine_file

    file = tmp_path / "megatron_args.txt"
    file.write_text(f"--fp16\n--micro-batch-size 1\n{flag}\n")
    settings = read_engine_file(file)
    assert settings.pins.get("train.grad_reduce_dtype") == reduced
    assert not settings.ignored


def test_a_file_autopar_cannot_read_is_named(examples_dir, tmp_path, capsys):
    from autopar.cli import main

    file = tmp_path / "settings.txt"
    file.write_text("learning_rate: 3e-4\n")
    assert main(["estimate", str(examples_dir / "gpt.py"), *SMALL, "--from", str(file)]) == 1
    assert "is not a settings file autopar reads" in capsys.readouterr().err


def test_expert_parallel_degrees_go_to_torchtitan_and_back(examples_dir, tmp_path):
    """A Mixtral-style plan with experts over 2 ranks (under ZeRO-3, as autopar runs expert
    parallelism): torchtitan's file carries the degree, torchtitan's ParallelDims accepts it and
    `--from` reads it back; Megatron-LM, whose distributed optimizer is ZeRO-1, refuses the plan."""
    import tyro
    from torchtitan.config import ParallelismConfig
    from torchtitan.config.manager import custom_registry
    from torchtitan.distributed import ParallelDims

    from autopar.config import compose_config
    from autopar.driver import run_plan
    from autopar.emit import read_engine_file

    model = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.kv_heads=2", "model.ffn=64",
             "model.experts=4", "model.top_k=2", "model.vocab=128", "model.seq_len=32"]
    plan = run_plan(examples_dir / "mixtral.py", compose_config(
        ["cluster=cpu_gloo", "cluster.gpus_per_node=4", "train.global_batch_size=8", "train.precision=fp32", *model,
         "plan.dp=4", "plan.ep=2", "plan.zero_stage=3", "plan.tp=1", "plan.pp=1"])).plan
    assert plan.ep == 2
    text = engine_files(plan, ["torchtitan"])["torchtitan_args.txt"]
    Job = make_dataclass("Job", [("parallelism", ParallelismConfig, field(default_factory=ParallelismConfig))])
    parallel = tyro.cli(Job, args=[line for line in _lines(text) if line.startswith("--parallelism.")],
                        registry=custom_registry).parallelism
    ParallelDims(dp_replicate=1, dp_shard=parallel.data_parallel_shard_degree, cp=1, tp=1, pp=1,
                 ep=parallel.expert_parallel_degree, world_size=plan.world_size)
    assert parallel.expert_parallel_degree == 2
    path = tmp_path / "torchtitan_args.txt"
    path.write_text(text)
    assert read_engine_file(path).pins["plan.ep"] == 2
    with pytest.raises(EngineRefusal, match="ZeRO-1"):
        engine_files(plan, ["megatron"])


def test_an_unknown_engine_is_refused_before_tracing(examples_dir, capsys):
    from autopar.cli import main

    assert main(["plan", str(examples_dir / "gpt.py"), *SMALL, "plan.engine=nemo"]) == 1
    err = capsys.readouterr().err
    assert "plan.engine=nemo is not an engine" in err and "torchtitan, megatron, deepspeed, accelerate" in err


def test_plan_never_replaces_a_settings_file_the_user_wrote(examples_dir, tmp_path, capsys):
    from autopar.cli import main

    mine = tmp_path / "deepspeed.json"
    mine.write_text('{"train_batch_size": 1024}')
    assert main(["plan", str(examples_dir / "gpt.py"), *SMALL, "plan.dp=2", "plan.zero_stage=3", "--emit", "deepspeed",
                 "--out", str(tmp_path / "plan.json")]) == 1
    assert "deepspeed.json" in capsys.readouterr().err
    assert mine.read_text() == '{"train_batch_size": 1024}' and not (tmp_path / "plan.json").exists()


ENGINE_REJECTS = {  # file name -> (text, words of the refusal), on SMALL's 2 ranks
    "megatron_args.txt": ("--tensor-model-parallel-size 3\n--micro-batch-size 1\n--global-batch-size 8\n",
                          ["megatron", "not divisible by tensor x pipeline x context parallel sizes 3 x 1 x 1"]),
    "megatron_batch.txt": ("--tensor-model-parallel-size 1\n--micro-batch-size 3\n--global-batch-size 8\n",
                           ["--global-batch-size 8 is not divisible by --micro-batch-size 3 x data-parallel size 2"]),
    "deepspeed.json": (json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 1,
                                   "gradient_accumulation_steps": 1}),
                       ["train_batch_size 8 is not train_micro_batch_size_per_gpu 1 x gradient_accumulation_steps "
                        "1 x 2 ranks"]),
    "torchtitan_args.txt": ("--parallelism.data_parallel_shard_degree=4\n--parallelism.tensor_parallel_degree=1\n",
                            ["the degrees multiply to 4, not the world size 2"]),
    "accelerate_fsdp.yaml": (yaml.safe_dump({"distributed_type": "FSDP", "parallelism_config": {
        "parallelism_config_dp_shard_size": 4, "parallelism_config_tp_size": 1}}),
        ["parallelism_config's sizes multiply to 4, not the world size 2"]),
}


@pytest.mark.parametrize("name", list(ENGINE_REJECTS))
def test_estimate_from_names_what_the_engine_itself_would_reject(name, examples_dir, tmp_path, capsys):
    """Degrees that do not divide the world, batch sizes that do not add up: each engine's own check
    of its file, named before anything is priced."""
    from autopar.cli import main

    text, words = ENGINE_REJECTS[name]
    file = tmp_path / (name if not name.startswith("megatron") else "megatron_args.txt")
    file.write_text(text)
    assert main(["estimate", str(examples_dir / "gpt.py"), *SMALL, "--from", str(file)]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "would reject" in err and all(word in err for word in words), err


def test_megatron_sequence_parallel_without_tp_is_priced_as_megatron_runs_it(tmp_path):
    """Megatron-LM turns --sequence-parallel off at a tensor-parallel size of 1 (and says so): read
    back, the file pins no sequence parallelism and carries that note; DeepSpeed's two precisions
    at once are refused at read."""
    from autopar.emit import read_engine_file

    file = tmp_path / "megatron_args.txt"
    file.write_text("--tensor-model-parallel-size 1\n--sequence-parallel\n--micro-batch-size 1\n")
    settings = read_engine_file(file)
    assert settings.pins["plan.sequence_parallel"] is False and "turns it off" in settings.notes[0]
    both = tmp_path / "deepspeed.json"
    both.write_text(json.dumps({"bf16": {"enabled": True}, "fp16": {"enabled": True}}))
    with pytest.raises(UserError, match="bf16 and fp16 both enabled"):
        read_engine_file(both)


@pytest.mark.parametrize("engine, precision, reduced", [
    ("megatron", "fp16", "compute"), ("megatron", "bf16", "fp32"), ("deepspeed", "fp16", "compute"),
    ("torchtitan", "fp16", "fp32"), ("", "fp16", "fp32")])
def test_a_named_engine_is_priced_reducing_gradients_in_its_dtype(engine, precision, reduced):
    """Megatron-LM and DeepSpeed all-reduce the 16-bit gradients under fp16 (Megatron-LM turns on
    fp32 reductions itself under bf16); torchtitan and the generated module reduce in fp32. An
    explicit train.grad_reduce_dtype wins."""
    from autopar.config import compose_config
    from autopar.specs import train_spec

    pins = [f"train.precision={precision}", "train.global_batch_size=8"] + ([f"plan.engine={engine}"] if engine else [])
    assert train_spec(compose_config(pins)).grad_reduce_dtype == reduced
    explicit = "fp32" if reduced == "compute" else "compute"
    assert train_spec(compose_config([*pins, f"train.grad_reduce_dtype={explicit}"])).grad_reduce_dtype == explicit


def test_a_named_engine_is_priced_as_it_runs_tensor_parallelism(examples_dir, tmp_path):
    """Megatron-LM's TP runs on plain tensors (no DTensor dispatch on the host): with
    plan.engine=megatron a tp=2 plan on an H100 node is priced as train.tp_runtime=plain prices it,
    below the generated module's DTensor price; an explicit train.tp_runtime wins; a Megatron file
    read back carries its engine, so `--from` prices it so too."""
    from autopar.config import compose_config
    from autopar.driver import run_estimate
    from autopar.emit import read_engine_file

    pins = ["cluster=dgx_h100", "cluster.nodes=1", "model.layers=2", "model.hidden=64", "model.heads=4",
            "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8", "plan.tp=2"]

    def price(*extra: str) -> float:
        return run_estimate(examples_dir / "gpt.py", compose_config([*pins, *extra]))[2].step_time_s

    megatron = price("plan.engine=megatron")
    assert megatron == price("train.tp_runtime=plain") < price()
    assert price("plan.engine=megatron", "train.tp_runtime=dtensor") == price()
    file = tmp_path / "megatron_args.txt"
    file.write_text("--tensor-model-parallel-size 2\n--micro-batch-size 1\n--global-batch-size 8\n")
    assert read_engine_file(file).pins["plan.engine"] == "megatron"


def test_a_saved_plan_priced_as_an_engine_runs_it_is_compiled_with_the_modules_price(examples_dir, tmp_path):
    """`autopar plan` with plan.engine=megatron prices a tp=2 plan as Megatron-LM runs it (plain TP,
    16-bit fp16 reductions) and the file says so, so it is priced again the same way; compiling it
    writes autopar's module, so compile prices it again as that module runs (plan.json, report and
    the interval scaled with it) and the compiled plan.json records the module's runtimes."""
    from autopar.cli import main
    from autopar.saved import price_saved_plan, read_plan

    pins = ["cluster=dgx_h100", "cluster.nodes=1", "model.layers=2", "model.hidden=64", "model.heads=4",
            "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8", "train.precision=fp16", "plan.tp=2"]
    saved = tmp_path / "plan.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *pins, "plan.engine=megatron", "--out", str(saved)]) == 0
    assert main(["compile", str(examples_dir / "gpt.py"), *pins, "--plan", str(saved),
                 "--out-dir", str(tmp_path / "out")]) == 0
    file, compiled = read_plan(saved), read_plan(tmp_path / "out" / "plan.json")
    assert (file.tp_runtime, file.grad_reduce_dtype) == ("plain", "compute")
    assert (compiled.tp_runtime, compiled.grad_reduce_dtype) == ("dtensor", "fp32")
    assert price_saved_plan(file, examples_dir / "gpt.py")[1].step_time_s == file.predicted.step_time_s
    generated = price_saved_plan(compiled, examples_dir / "gpt.py")[1].step_time_s
    assert compiled.predicted.step_time_s == generated > file.predicted.step_time_s
    width = file.predicted.step_time_high_s / file.predicted.step_time_s
    assert compiled.predicted.step_time_high_s / compiled.predicted.step_time_s == pytest.approx(width)
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["estimate"]["step_time_s"] == report["plan"]["predicted"]["step_time_s"] == generated


def test_a_saved_plan_is_compiled_at_its_own_price_under_the_settings_it_was_planned_with(examples_dir, tmp_path):
    """Settings a plan file does not record (here: no gradient clipping, optim.max_grad_norm=0) are
    compile's own: planned and compiled with them, the plan keeps the planner's price, which
    re-pricing with the defaults (clipping: one more all-reduce a step) would have changed."""
    from autopar.cli import main
    from autopar.saved import price_saved_plan, read_plan

    pins = ["cluster=dgx_h100", "cluster.nodes=1", "model.layers=2", "model.hidden=64", "model.heads=4",
            "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8", "plan.tp=2", "optim.max_grad_norm=0"]
    saved = tmp_path / "plan.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *pins, "--out", str(saved)]) == 0
    assert main(["compile", str(examples_dir / "gpt.py"), *pins, "--plan", str(saved),
                 "--out-dir", str(tmp_path / "out")]) == 0
    from cost_models.step import TrainSpec

    planned = read_plan(saved).predicted.step_time_s
    assert read_plan(saved).clip_grad_norm is False  # recorded, so priced again without clipping
    assert price_saved_plan(read_plan(saved), examples_dir / "gpt.py")[1].step_time_s == planned
    assert read_plan(tmp_path / "out" / "plan.json").predicted.step_time_s == planned
    defaults = TrainSpec(global_batch_size=8)  # clipping
    assert price_saved_plan(read_plan(saved), examples_dir / "gpt.py", train=defaults)[1].step_time_s > planned
