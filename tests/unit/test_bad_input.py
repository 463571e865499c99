"""Bad input through the command line: every case exits 1 with one paragraph naming the problem
and the fix, writes nothing, and shows no traceback from inside torch."""
from __future__ import annotations

import json
import re
import resource
import textwrap
from pathlib import Path

import pytest

from autopar.cli import main
from tests.conftest import write_model_file

TINY_GPT = ["model.layers=1", "model.hidden=64", "model.heads=4", "model.seq_len=16", "model.vocab=128",
            "train.global_batch_size=8", "train.precision=fp32"]


def fails(capsys, argv: list[str], *words: str, unwritten: tuple[Path, ...] = ()) -> str:
    """Run the CLI, check it exits 1 with one paragraph containing every word (case-insensitive)
    and without a traceback, that no path in ``unwritten`` exists; return the message."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert err.startswith("error:") and "Fix:" in err, err
    assert "Traceback" not in err and "\n\n" not in err, err
    for word in words:
        assert word.lower() in err.lower(), f"{word!r} missing from: {err}"
    for path in unwritten:
        assert not path.exists(), f"{path} was written"
    return err


def outputs(tmp_path: Path) -> tuple[Path, ...]:
    """What a plan/compile/report run would write under tmp_path."""
    return tmp_path / "plan.json", tmp_path / "out", tmp_path / "report"


def _suggested(err: str, key: str, end: str = ")") -> str:
    """The value the message suggests for ``key`` (e.g. '... cluster.nodes=2).' -> '2')."""
    found = re.search(rf"{re.escape(key)}=([\w.-]+?){re.escape(end)}", err)
    assert found, f"no {key}= suggestion in: {err}"
    return found.group(1)


def _address_space_bytes() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@pytest.fixture
def capped_memory():
    """Caps this process's address space a few GiB above its current size while the test runs,
    so that a regression which really attempts a 260 GiB allocation fails at once instead of
    exhausting the machine."""
    current = _address_space_bytes()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if current is None:
        yield
        return
    cap = current + 6 * 2**30
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


# -- 1, 2: the model file itself ----------------------------------------------------------------

def test_syntax_error_names_file_and_line(tmp_path, capsys):
    model = write_model_file(tmp_path, "import torch\n\ndef build_model(:\n    pass\n")
    fails(capsys, ["plan", str(model), "--out", str(tmp_path / "plan.json")], "model.py:3: syntax error",
          "`def build_model(:`", "py_compile", unwritten=outputs(tmp_path))


@pytest.mark.parametrize("source, missing", [
    ("import torch\ndef example_batch(batch_size):\n    return torch.zeros(batch_size, 2)\n", "build_model()"),
    ("import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n", "example_batch()"),
])
def test_missing_contract_function_is_named(tmp_path, capsys, source, missing):
    model = write_model_file(tmp_path, source)
    fails(capsys, ["compile", str(model), "--out-dir", str(tmp_path / "out")], f"does not define {missing}",
          "define build_model(**kw)", unwritten=outputs(tmp_path))


# -- 3: real allocations ------------------------------------------------------------------------

HUGE_AT_IMPORT = """
import torch
TABLE = torch.ones(70_000_000_000)  # 70B fp32 values: 260 GiB
def build_model():
    return torch.nn.Linear(4, 4)
def example_batch(batch_size):
    return torch.randn(batch_size, 4)
"""

HUGE_NUMPY_IN_BUILD = """
import numpy as np
import torch
def build_model():
    model = torch.nn.Linear(4, 4)
    model.table = torch.from_numpy(np.ones(70_000_000_000, dtype=np.float32))
    return model
def example_batch(batch_size):
    return torch.randn(batch_size, 4)
"""


def test_huge_real_tensor_at_import_is_refused_before_allocating(tmp_path, capsys, capped_memory):
    """The guard names the size from a meta run: an attempted allocation would instead fail
    with the allocator's own message (or, uncapped, exhaust the machine)."""
    model = write_model_file(tmp_path, HUGE_AT_IMPORT)
    fails(capsys, ["plan", str(model), "--out", str(tmp_path / "plan.json")], "260.8 GiB", "model.py:3",
          "refused before allocating", "torch.device('meta')", "build_model()", "checkpoints",
          unwritten=outputs(tmp_path))


def test_running_out_of_memory_in_build_model_explains_meta_building(tmp_path, capsys, capped_memory):
    model = write_model_file(tmp_path, HUGE_NUMPY_IN_BUILD)
    fails(capsys, ["compile", str(model), "--out-dir", str(tmp_path / "out")], "build_model()", "ran out of memory",
          "model.py:6", "FakeTensorMode", "torch.device('meta')", unwritten=outputs(tmp_path))


def test_huge_tensor_made_inside_build_model_costs_nothing(tmp_path, capped_memory):
    """The same 70B values created in build_model(), even with device='cpu', are fake tensors:
    planning proceeds (under a cap far below their 260 GiB)."""
    model = write_model_file(tmp_path, textwrap.dedent("""
        import torch
        class Huge(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.table = torch.nn.Parameter(torch.empty(70_000_000_000 // 4096, 4096, device="cpu"))
            def forward(self, x):
                return x @ self.table[:4].T
        def build_model():
            return Huge()
        def example_batch(batch_size):
            return torch.randn(batch_size, 4096)
    """))
    out = tmp_path / "profile.json"
    assert main(["profile", str(model), "--out", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["param_count"] == 70_000_000_000 // 4096 * 4096


def test_small_tensors_at_import_are_allowed(tmp_path):
    """The guard refuses only large allocations: module-level constants still work."""
    model = write_model_file(tmp_path, HUGE_AT_IMPORT.replace("70_000_000_000", "1000"))
    out = tmp_path / "profile.json"
    assert main(["profile", str(model), "--out", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["param_count"] == 20


# -- 4: untraceable control flow ----------------------------------------------------------------

DATA_DEPENDENT = """
import torch
from torch import nn
class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
    def forward(self, x):
        y = self.proj(x)
        if y.sum() > 0:
            return y
        return -y
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = Gate()
        self.head = nn.Linear(8, 1)
    def forward(self, x):
        return self.head(self.gate(x))
def build_model():
    return Net()
def example_batch(batch_size):
    return torch.randn(batch_size, 8)
"""


def test_data_dependent_branch_is_planned_and_the_guess_named(tmp_path, capsys):
    """A branch on a value computed from the weights has no value on fake tensors: it is planned
    with a guess (autopar/data_dependent.py), and plan.json and the plan's words name the line."""
    model = write_model_file(tmp_path, DATA_DEPENDENT)
    assert main(["plan", str(model), "--out", str(tmp_path / "plan.json")]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["data_dependent"]
    (decided,) = plan["estimated"]
    assert "model.py:10 (`if y.sum() > 0:`)" in decided
    out = " ".join(capsys.readouterr().out.split())
    assert "value-dependent code" in out and "if y.sum() > 0:" in out


# -- 5: an op no tensor-parallel split covers ---------------------------------------------------

SORTING_BLOCKS = """
import torch
from torch import nn
class Mix(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
    def forward(self, x):
        # sorting along the features: a shard of them sorts to something else
        return x + self.down(torch.sort(self.up(x), dim=-1).values)
class Net(nn.Module):
    def __init__(self, hidden, layers):
        super().__init__()
        self.embed = nn.Linear(16, hidden)
        self.blocks = nn.ModuleList(Mix(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, 1)
    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
def build_model(hidden=256, layers=2):
    return Net(hidden, layers)
def example_batch(batch_size):
    return torch.randn(batch_size, 64, 16)
"""


def test_op_without_a_tp_split_is_replicated_and_reported(tmp_path, capsys):
    """The ILP may not feed the sort a feature shard (column-parallel `up` into row-parallel
    `down` would sort each rank's slice): the sort runs replicated and the report says so."""
    model = write_model_file(tmp_path, SORTING_BLOCKS)
    out, report = tmp_path / "plan.json", tmp_path / "report"
    assert main(["plan", str(model), "cluster=dgx_h100", "plan.tp=2", "train.global_batch_size=8", "--out", str(out),
                 "--report", str(report)]) == 0
    assert "replicated under TP: aten.sort" in capsys.readouterr().out
    plan = json.loads(out.read_text())
    assert plan["tp"] == 2
    assert all(plan["tp_styles"].get(f"blocks.{i}.down") != "rowwise" for i in range(2))
    notes = [line for line in (report / "report.md").read_text().splitlines() if "aten.sort" in line]
    assert len(notes) == 1 and "replicated" in notes[0] and "blocks.0, blocks.1" in notes[0]


# -- 6: impossible clusters ---------------------------------------------------------------------

@pytest.mark.parametrize("override", ["cluster.nodes=0", "cluster.gpus_per_node=0"])
def test_cluster_without_gpus(examples_dir, tmp_path, capsys, override):
    fails(capsys, ["plan", str(examples_dir / "mlp.py"), override, "--out", str(tmp_path / "plan.json")],
          override, "out of range", "at least 1", unwritten=outputs(tmp_path))


def test_unknown_gpu_lists_known_types(examples_dir, tmp_path, capsys):
    from cost_models.hardware import known_gpus

    err = fails(capsys, ["compile", str(examples_dir / "mlp.py"), "cluster.gpu=H1000", "--out-dir",
                         str(tmp_path / "out")], "Unknown GPU type 'H1000'", unwritten=outputs(tmp_path))
    assert all(name in err for name in known_gpus())


# -- 9: contradictory pins ----------------------------------------------------------------------

HEADS_32 = ["model.layers=1", "model.hidden=256", "model.heads=32", "model.seq_len=16", "model.vocab=128",
            "train.precision=fp32", "cluster=dgx_h100"]


def test_tp_that_does_not_divide_the_heads_lists_legal_degrees(examples_dir, tmp_path, capsys):
    err = fails(capsys, ["plan", str(examples_dir / "gpt.py"), *HEADS_32, "plan.tp=3", "--out",
                         str(tmp_path / "plan.json")], "plan.tp=3", "32 attention heads are not divisible by tp=3",
                unwritten=outputs(tmp_path))
    legal = err.split("use one of tp=")[1].split(" (")[0]
    assert legal == "1, 2, 4, 8"  # 16 and 32 divide the heads but not into one 8-GPU node
    out = tmp_path / "legal.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *HEADS_32, "plan.tp=8", "--out", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["tp"] == 8


def test_tp_that_does_not_divide_the_node_names_the_groups_that_cross(examples_dir, tmp_path, capsys):
    """tp=3 divides the 48 heads and the 24 GPUs of three 8-GPU nodes, but ranks 6, 7 and 8 would
    form a TP group across two nodes: refused before the search, with the degrees that stay in one."""
    heads_48 = [*HEADS_32, "model.heads=48", "model.hidden=384"]
    fails(capsys, ["plan", str(examples_dir / "gpt.py"), *heads_48, "cluster.nodes=3", "plan.tp=3",
                   "--out", str(tmp_path / "plan.json")],
          "plan.tp=3 does not divide the 8 GPUs of a node", "ranks 6 to 8", "use one of tp=1, 2, 4, 8, or set",
          unwritten=outputs(tmp_path))


def test_dp_that_does_not_divide_the_batch(examples_dir, tmp_path, capsys):
    fails(capsys, ["plan", str(examples_dir / "gpt.py"), *HEADS_32, "cluster.gpus_per_node=6", "plan.dp=3",
                   "train.global_batch_size=8", "--out", str(tmp_path / "plan.json")],
          "plan.dp=3 does not divide train.global_batch_size=8", "one of 1, 2", "multiple of 3",
          unwritten=outputs(tmp_path))


def test_pins_needing_more_gpus_than_the_cluster_has(examples_dir, tmp_path, capsys):
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), *HEADS_32, "plan.dp=4", "plan.tp=4", "--out-dir",
                   str(tmp_path / "out")], "dp=4×tp=4 need 16 GPUs; the cluster has 8", "cluster.nodes",
          unwritten=outputs(tmp_path))


def test_batch_no_split_can_serve_names_the_nearest_batch_that_can(examples_dir, tmp_path, capsys):
    """23 samples on 6 GPUs: dp must be 1 and a 2-head model cannot fill 6 GPUs with tp/pp/cp."""
    args = ["plan", str(examples_dir / "gpt.py"), "model.layers=1", "model.hidden=64", "model.heads=2",
            "model.seq_len=16", "model.vocab=128", "train.precision=fp32", "cluster=dgx_h100",
            "cluster.gpus_per_node=6"]
    err = fails(capsys, args + ["train.global_batch_size=23", "--out", str(tmp_path / "plan.json")],
                "No plan satisfies the constraints", "global batch 23", unwritten=outputs(tmp_path))
    batch = int(_suggested(err, "train.global_batch_size", end=" "))
    assert batch == 24
    out = tmp_path / "fits.json"
    assert main(args + [f"train.global_batch_size={batch}", "--out", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["global_batch_size"] == 24


@pytest.mark.parametrize("pin, words", [
    ("plan.schedule=zigzag", ("plan.schedule=zigzag", "gpipe, 1f1b, interleaved_1f1b")),
    ("plan.zero_stage=5", ("plan.zero_stage=5", "from 0 to 3")),
    ("plan.pp=2", ("plan.pp=2", "1 repeated blocks", "at most 1")),
    ("plan.micro_batch_size=3", ("plan.micro_batch_size=3", "global batch of 8")),
])
def test_impossible_single_pins(examples_dir, tmp_path, capsys, pin, words):
    fails(capsys, ["plan", str(examples_dir / "gpt.py"), *TINY_GPT, pin, "--out", str(tmp_path / "plan.json")],
          *words, unwritten=outputs(tmp_path))


# -- 10: corrupted plan files -------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved_plan(examples_dir, tmp_path_factory) -> Path:
    """A real plan.json of the tiny GPT on the CPU cluster (planned once for these tests)."""
    out = tmp_path_factory.mktemp("saved") / "plan.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *TINY_GPT, "cluster=cpu_gloo", "--out", str(out), "-q"]) == 0
    return out


def corrupted(saved_plan: Path, folder: Path, how: str) -> Path:
    """plan.json cut in half, or parsable but inconsistent (a layer dropped from its stages, or
    priced with a runtime no engine has)."""
    folder.mkdir(parents=True, exist_ok=True)
    text = saved_plan.read_text()
    if how == "truncated":
        text = text[: len(text) // 2]
    elif how == "unknown runtime":
        text = json.dumps({**json.loads(text), "tp_runtime": "nccl"})
    else:
        data = json.loads(text)
        data["stages"][0] = data["stages"][0][1:]
        text = json.dumps(data)
    path = folder / "plan.json"
    path.write_text(text)
    return path


CORRUPTION = pytest.mark.parametrize("how, words", [("truncated", ("not a readable plan", "JSONDecodeError")),
                                                    ("inconsistent", ("not a valid plan", "stages")),
                                                    ("unknown runtime", ("not a valid plan", "tp_runtime 'nccl'",
                                                                         "dtensor"))])


@CORRUPTION
def test_corrupted_plan_given_to_report(saved_plan, tmp_path, capsys, how, words):
    plan = corrupted(saved_plan, tmp_path / "in", how)
    fails(capsys, ["report", str(plan), "--out-dir", str(tmp_path / "report")], *words, "autopar plan",
          unwritten=outputs(tmp_path))
    fails(capsys, ["report", str(plan.parent)], *words)
    assert sorted(p.name for p in plan.parent.iterdir()) == ["plan.json"]


@CORRUPTION
def test_corrupted_plan_given_to_run(saved_plan, tmp_path, capsys, how, words):
    plan = corrupted(saved_plan, tmp_path / "out", how)
    fails(capsys, ["run", str(plan.parent), "--steps", "1"], *words)
    assert sorted(p.name for p in plan.parent.iterdir()) == ["plan.json"]


@CORRUPTION
def test_corrupted_plan_given_to_compile(examples_dir, saved_plan, tmp_path, capsys, how, words):
    plan = corrupted(saved_plan, tmp_path / "in", how)
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), *TINY_GPT, "cluster=cpu_gloo", "--plan", str(plan),
                   "--out-dir", str(tmp_path / "out")], *words, unwritten=outputs(tmp_path))


# -- 7: nothing fits in memory ------------------------------------------------------------------

def test_model_too_big_names_more_nodes_that_really_fit(examples_dir, tmp_path, capsys):
    """1.6B parameters with Adam need ~26 GB; the CPU 'GPU' has 19 GiB usable."""
    args = ["plan", str(examples_dir / "gpt.py"), "cluster=cpu_gloo", "cluster.gpus_per_node=1", "model.layers=2",
            "model.hidden=8192", "model.heads=8", "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8",
            "train.precision=fp32"]
    err = fails(capsys, args + ["--out", str(tmp_path / "plan.json")], "Nothing fits in memory on 1 × cpu",
                "the nodes", unwritten=outputs(tmp_path))
    nodes = int(_suggested(err, "cluster.nodes"))
    assert nodes > 1
    out = tmp_path / "fits.json"
    assert main(args + [f"cluster.nodes={nodes}", "--out", str(out), "-q"]) == 0
    plan = json.loads(out.read_text())
    assert plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"] == nodes


def test_pinned_model_too_big_names_a_bigger_gpu_that_really_fits(examples_dir, tmp_path, capsys):
    """5B parameters pinned to one GPU (more nodes cannot help): the smallest GPU that holds
    them is named."""
    args = ["plan", str(examples_dir / "gpt.py"), "cluster=dgx_h100", "cluster.gpus_per_node=1", "model.layers=4",
            "model.hidden=10240", "model.heads=8", "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8",
            "plan.dp=1", "plan.tp=1", "plan.pp=1", "plan.cp=1"]
    err = fails(capsys, args + ["--out", str(tmp_path / "plan.json")], "Nothing fits in memory on 1 × H100-SXM",
                "under your pins (plan.dp=1", unwritten=outputs(tmp_path))
    gpu = _suggested(err, "cluster.gpu")
    assert gpu == "H200"  # the smallest catalogue GPU above 80 GB
    out = tmp_path / "fits.json"
    assert main(args + [f"cluster.gpu={gpu}", "--out", str(out), "-q"]) == 0
    assert json.loads(out.read_text())["dp"] == 1


# -- 8: the solver's time limit -----------------------------------------------------------------

TIME_LIMITED = ["cluster=dgx_h100", "cluster.nodes=16", "model.layers=16", "model.hidden=1024", "model.heads=16",
                "model.seq_len=512", "model.vocab=4096", "train.global_batch_size=512"]


def test_time_limit_returns_a_plan_marked_not_optimal(examples_dir, tmp_path, capsys):
    """A 1 ms wall-clock cap on ~32,000 candidates: the search still returns the first plan it
    finds (deterministically: it stops right after), marked FEASIBLE with its gap everywhere, and
    says the result depends on the machine's load."""
    out, report = tmp_path / "plan.json", tmp_path / "report"
    code = main(["plan", str(examples_dir / "gpt.py"), *TIME_LIMITED, "solver.time_limit_s=0.001", "--out", str(out),
                 "--report", str(report)])
    printed = capsys.readouterr().out
    assert code == 0
    solver = json.loads(out.read_text())["solver"]
    assert solver["status"] == "FEASIBLE" and 0 < solver["gap"] < 1
    assert "not proven optimal" in " ".join(printed.split()) and f"gap {solver['gap']:.1%}" in printed
    assert solver["stopped_by"] == "time_limit" and "depends on the machine's load" in " ".join(printed.split())
    assert "Not proven optimal" in (report / "report.md").read_text()
    full = tmp_path / "full.json"
    assert main(["plan", str(examples_dir / "gpt.py"), *TIME_LIMITED, "--out", str(full), "-q"]) == 0
    optimal = json.loads(full.read_text())["solver"]
    assert optimal["status"] == "OPTIMAL"
    # the gap bounds how far the returned plan can be from the optimum
    assert solver["objective"] * (1 - solver["gap"]) - 1e-9 <= optimal["objective"] <= solver["objective"]


def test_unknown_zero3_runtime_names_the_choices(examples_dir, capsys):
    """train.zero3_runtime picks how ZeRO-3 is priced; a value no runtime has is refused, naming both."""
    fails(capsys, ["estimate", str(examples_dir / "gpt.py"), "train.zero3_runtime=deepspeed", "plan.zero_stage=3"],
          "unknown train.zero3_runtime 'deepspeed'", "fsdp2", "deepspeed_2021")


def test_unknown_grad_reduce_dtype_names_the_choices(examples_dir, capsys):
    """train.grad_reduce_dtype says what gradients are reduced in; a value neither is refused, naming both."""
    fails(capsys, ["estimate", str(examples_dir / "gpt.py"), "train.grad_reduce_dtype=bf16"],
          "unknown train.grad_reduce_dtype 'bf16'", "fp32", "compute")


@pytest.mark.parametrize("setting", ["train.tp_runtime=plain", "train.tp_runtime=megatron_core",
                                     "train.zero3_runtime=deepspeed_2021", "train.selective_runtime=torchtitan_op",
                                     "train.grad_reduce_dtype=compute"])
def test_compile_refuses_a_runtime_only_another_engine_runs(examples_dir, tmp_path, capsys, setting):
    """These settings price other engines' runs; compile writes autopar's module, which runs none of
    them, so its plan would promise a step time that module does not run: refused before anything is
    traced or written, naming the setting and where it belongs."""
    out = tmp_path / "out"
    key = setting.split("=")[0]
    fails(capsys, ["compile", str(examples_dir / "gpt.py"), "cluster=cpu_gloo", "train.precision=fp16", setting,
                   "--out-dir", str(out)], key, "prices a run of another engine", f"leave {key} unset",
          "autopar estimate", unwritten=(out,))


def test_compile_prices_the_generated_module_whatever_engine_narrows_the_search():
    """plan.engine still narrows compile's search, but compile prices the module it writes: the engine's
    runtimes (Megatron-LM's plain TP and 16-bit fp16 reductions) give way to the generated ones."""
    from autopar.config import compose_config
    from autopar.specs import generated_module_settings, train_spec

    cfg = compose_config(["plan.engine=megatron", "train.precision=fp16"])
    engine = train_spec(cfg)
    compiled = train_spec(generated_module_settings(cfg))
    assert (engine.tp_runtime, engine.grad_reduce_dtype) == ("plain", "compute")
    assert (compiled.tp_runtime, compiled.zero3_runtime, compiled.selective_runtime, compiled.grad_reduce_dtype) \
        == ("dtensor", "fsdp2", "autopar", "fp32")
    assert generated_module_settings(cfg).plan.engine == "megatron"


def test_unknown_tp_runtime_names_the_choices(examples_dir, capsys):
    """train.tp_runtime picks how TP is priced; a value no runtime has is refused, naming both."""
    fails(capsys, ["estimate", str(examples_dir / "gpt.py"), "train.tp_runtime=megatron", "plan.tp=2"],
          "unknown train.tp_runtime 'megatron'", "dtensor", "plain")
