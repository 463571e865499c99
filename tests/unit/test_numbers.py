"""Every number a user gives is checked where it is read: each numeric field of the cluster,
train, solver and plan schemas and of a plan.json has one declared range (autopar/domain/bounds.py),
and a value outside it is refused in one paragraph naming the field, the value and the range,
before any work; never priced, replaced by a preset's value, or blamed on something else."""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.config import PlanPins, SolverConfig, SweepConfig, TrainConfig
from autopar.saved import read_plan
from autopar.errors import ConfigError
from autopar.plans import Plan
from cost_models.topology import ClusterConfig, ClusterSpec, NodeGroupConfig

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")


def refused(capsys, argv: list[str], *words: str) -> str:
    """The CLI exits 1 with one paragraph holding every word; the message."""
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 1, err
    assert err.startswith("error:") and "Fix:" in err and "Traceback" not in err, err
    for word in words:
        assert word in err, f"{word!r} missing from: {err}"
    return err


@pytest.fixture
def no_tracing(monkeypatch):
    """Tracing fails the test: a number out of range must be refused before it."""
    import autopar.driver

    def traced(*args, **kwargs):
        raise AssertionError("the model was traced before the settings were checked")

    monkeypatch.setattr(autopar.driver, "run_profile", traced)


# -- the instances of the issue -------------------------------------------------------------------

@pytest.mark.parametrize("value", ["-5", "nan", "0"])
def test_intra_node_bandwidth_out_of_range_is_refused_not_priced(capsys, no_tracing, value):
    """-5 and nan were priced faster than the real link; 0 was replaced by the preset's link."""
    err = refused(capsys, ["estimate", MLP, f"cluster.intra_node_bandwidth_GBps={value}"],
                  "cluster.intra_node_bandwidth_GBps=", "above 0", "or null")
    assert f"={float(value)}" in err


def test_infinite_latency_is_refused_not_an_overflow(capsys, no_tracing):
    refused(capsys, ["estimate", MLP, "cluster.intra_node_latency_us=inf"], "cluster.intra_node_latency_us=inf",
            "a finite number")


def test_micro_batch_of_zero_is_named_not_blamed_on_fake_tensors(capsys, no_tracing):
    err = refused(capsys, ["profile", MLP, "train.micro_batch_size=0"], "train.micro_batch_size=0",
                  "an integer from 1 to 16,777,216", "train.micro_batch_size=1")
    assert "fake tensors" not in err


def test_pinned_degree_of_zero_is_refused_not_replaced_by_one(capsys, no_tracing):
    """plan.tp=0 was read as `plan.tp or 1`."""
    refused(capsys, ["estimate", MLP, "plan.tp=0"], "plan.tp=0", "or null (the solver chooses)")


def test_batch_the_pinned_split_cannot_divide_is_refused_before_tracing(capsys, no_tracing):
    """dgx_h100 (8 GPUs, dp=8 by default) cannot split 12 samples."""
    refused(capsys, ["estimate", MLP, "train.global_batch_size=12"], "train.global_batch_size=12",
            "not a multiple of dp×micro_batch_size = 8×1")


def test_a_set_bandwidth_is_used_and_null_means_the_catalogue():
    """The link a cluster is priced with is the one given, however slow; only null takes the GPU's."""
    slow = ClusterSpec.from_config(ClusterConfig(gpu="H100-SXM", intra_node_bandwidth_GBps=0.5))
    catalogue = ClusterSpec.from_config(ClusterConfig(gpu="H100-SXM", intra_node_bandwidth_GBps=None))
    assert slow.intra.bandwidth_Bps == pytest.approx(0.5e9 * 0.82)  # NVLink4 reaches 82% of its rate
    assert catalogue.intra.bandwidth_Bps == pytest.approx(450e9 * 0.82)


@pytest.mark.parametrize("field, value", [("intra_node_bandwidth_GBps", 0.0), ("intra_node_bandwidth_GBps", -5.0),
                                          ("inter_node_bandwidth_GBps", math.nan),
                                          ("intra_node_latency_us", math.inf), ("gpus_per_node", 0)])
def test_cluster_spec_refuses_what_the_cli_refuses(field, value):
    """The cost model's own entry point checks the same table (callers other than the CLI)."""
    with pytest.raises(ValueError, match=f"cluster.{field}="):
        ClusterSpec.from_config(ClusterConfig(gpu="H100-SXM", **{field: value}))


# -- every numeric field, through the CLI ---------------------------------------------------------

def numeric_fields(schema: type) -> list[str]:
    """Fields whose type holds an int or a float (optional ones and lists of them included)."""
    hints = typing.get_type_hints(schema)

    def numeric(hint: typing.Any) -> bool:
        if hint in (int, float):
            return True
        return any(numeric(arg) for arg in typing.get_args(hint))

    return [f.name for f in dataclasses.fields(schema) if numeric(hints[f.name]) and hints[f.name] is not bool]


def declared_ranges() -> list[tuple[type, dict]]:
    from autopar.config import (DATA_BOUNDS, OPTIM_BOUNDS, PLAN_PIN_BOUNDS, SOLVER_BOUNDS, SWEEP_BOUNDS, TRAIN_BOUNDS,
                                DataConfig, OptimConfig)
    from autopar.plans import PLAN_PART_BOUNDS
    from cost_models.topology import CLUSTER_BOUNDS, NODE_GROUP_BOUNDS

    parts = [(Plan if not part else typing.get_type_hints(Plan)[part], table)
             for part, table in PLAN_PART_BOUNDS.items()]
    return [(ClusterConfig, CLUSTER_BOUNDS), (NodeGroupConfig, NODE_GROUP_BOUNDS), (TrainConfig, TRAIN_BOUNDS),
            (SolverConfig, SOLVER_BOUNDS), (PlanPins, PLAN_PIN_BOUNDS), (SweepConfig, SWEEP_BOUNDS),
            (OptimConfig, OPTIM_BOUNDS), (DataConfig, DATA_BOUNDS), *parts]


def test_every_numeric_field_has_a_declared_range():
    """A numeric field added to a schema without a range fails here."""
    ranges = declared_ranges()
    assert len(ranges) == 12
    for schema, table in ranges:
        assert sorted(numeric_fields(schema)) == sorted(table), schema.__name__


# Fields where 0 is a meaningful value (the others must refuse it): written out here, not read
# from the tables under test.
ZERO_MEANS_SOMETHING = {("cluster", "intra_node_latency_us"), ("cluster", "inter_node_latency_us"),
                        ("cluster", "memory_headroom_fraction"), ("cluster", "price_per_gpu_hour"),
                        ("train", "eval_every")}
CLI_CASES = [(section, name, value)
             for section, schema in (("cluster", ClusterConfig), ("train", TrainConfig))
             for name in numeric_fields(schema)
             for value in ["nan", "inf", "-1"] + ([] if (section, name) in ZERO_MEANS_SOMETHING else ["0"])]


def test_the_cli_cases_cover_both_schemas():
    assert len({(section, name) for section, name, _ in CLI_CASES}) == 15 and len(CLI_CASES) == 15 * 3 + 10


@pytest.mark.parametrize("section, name, value", CLI_CASES)
def test_out_of_range_cluster_and_train_numbers_exit_1_naming_the_field(capsys, no_tracing, section, name, value):
    refused(capsys, ["estimate", MLP, f"{section}.{name}={value}"], f"{section}.{name}")


@pytest.mark.parametrize("value, words", [("-1", "cluster.node_groups[0].nodes=-1"),
                                          ("nan", "cluster.node_groups.nodes=nan")])
def test_node_group_counts_are_checked(capsys, no_tracing, value, words):
    refused(capsys, ["estimate", MLP, f"cluster.node_groups=[{{gpu: H100-SXM, nodes: {value}}}]"], words)


@pytest.mark.parametrize("override", ["solver.work_limit=0", "solver.threads=0", "solver.zero_stages=[0,4]",
                                      "plan.dp_shares=[2,0]", "sweep.max_step_time_s=-1", "solver.time_limit_s=inf"])
def test_solver_pin_and_sweep_numbers_are_checked(capsys, no_tracing, override):
    refused(capsys, ["plan", MLP, override], override.split("=")[0] + "=")


def test_every_cluster_preset_is_in_range():
    from autopar.config import check_numbers, compose_config

    presets = sorted(p.stem for p in (Path(__file__).resolve().parents[2] / "autopar/conf/cluster").glob("*.yaml"))
    assert "dgx_h100" in presets
    for preset in presets:
        check_numbers(compose_config([f"cluster={preset}"]))


def test_bounds_refuse_bools_strings_and_nan_items():
    from autopar.domain.bounds import Bound, out_of_range

    count = Bound(low=1, integer=True)
    assert not count.accepts(True) and not count.accepts("4") and not count.accepts(4.0) and count.accepts(4)
    shares = Bound(low=1, integer=True, each=True)
    found = out_of_range({"dp_shares": [3, 1, 0]}, {"dp_shares": shares})
    assert found is not None and found.name == "dp_shares"
    assert out_of_range({"x": [1.0, math.nan]}, {"x": Bound(each=True)}) is not None
    assert out_of_range({"x": None}, {"x": Bound(null="unset")}) is None


# -- a plan.json ----------------------------------------------------------------------------------

def valid_plan() -> Plan:
    return Plan(dp=2, micro_batch_size=2, num_micro_batches=2, global_batch_size=8, layer_names=["a", "b"],
                stages=[["a", "b"]])


def edited(tmp_path: Path, change: typing.Callable[[dict], None]) -> Path:
    data = json.loads(valid_plan().to_json())
    change(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))  # json writes nan as NaN, inf as Infinity: Python reads them back
    return path


PLAN_EDITS = {
    "dp=1e30": lambda d: d.update(dp=10**30, global_batch_size=4 * 10**30),
    "micro_batch_size=0": lambda d: d.update(micro_batch_size=0),
    "moe_imbalance=nan": lambda d: d.update(moe_imbalance=math.nan),
    "dp=true": lambda d: d.update(dp=True),  # not read as 1
    "dp=2.5": lambda d: d.update(dp=2.5),  # not truncated to 2
    "tp=inf": lambda d: d.update(tp=math.inf),
    "zero_stage=7": lambda d: d.update(zero_stage=7),
    "dp_shares=[4, 0]": lambda d: d.update(dp_shares=[4, 0]),
    "predicted.step_time_s=-1": lambda d: d["predicted"].update(step_time_s=-1.0),
    "predicted.mfu=inf": lambda d: d["predicted"].update(mfu=math.inf),
    "provenance.traced_micro_batch_size=0": lambda d: d["provenance"].update(traced_micro_batch_size=0),
    "cluster.intra_node_bandwidth_GBps=nan": lambda d: d["provenance"].update(
        cluster_config={"name": "x", "intra_node_bandwidth_GBps": math.nan}),
}


def test_the_plan_edits_start_from_a_valid_plan():
    assert valid_plan().problems() == []


@pytest.mark.parametrize("words", PLAN_EDITS)
def test_plan_json_numbers_out_of_range_are_refused(tmp_path, words):
    path = edited(tmp_path, PLAN_EDITS[words])
    with pytest.raises(ConfigError) as caught:
        read_plan(path)
    assert words.split("=")[0] in str(caught.value) and "not a valid plan" in str(caught.value)


def test_uneven_shares_must_cover_the_ranks(tmp_path):
    path = edited(tmp_path, lambda d: d.update(dp_shares=[3, 2, 1]))
    with pytest.raises(ConfigError, match="dp_shares"):
        read_plan(path)


def test_saved_plan_with_a_huge_degree_is_refused_by_compile_and_report(capsys, tmp_path, no_tracing):
    path = edited(tmp_path, PLAN_EDITS["dp=1e30"])
    refused(capsys, ["compile", MLP, "cluster=cpu_gloo", "--plan", str(path), "--out-dir", str(tmp_path / "out")],
            "dp=1e30", "from 1 to 65,536")
    refused(capsys, ["report", str(path)], "dp=1e30")
    assert not (tmp_path / "out").exists()


# -- autopar run: plan.json against the module it launches ----------------------------------------

@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """The MLP compiled for 2 CPU ranks (dp=2), once for these tests."""
    out = tmp_path_factory.mktemp("numbers") / "out"
    assert main(["compile", MLP, "cluster=cpu_gloo", "cluster.gpus_per_node=2", "train.precision=fp32",
                 "check=off", "--out-dir", str(out), "-q"]) == 0
    return out


@pytest.fixture
def never_launched(monkeypatch):
    import autopar.runtime

    def launched(*args, **kwargs):
        raise AssertionError("torchrun was started")

    monkeypatch.setattr(autopar.runtime, "run_local", launched)


@pytest.mark.parametrize("change, words", [
    (lambda d: d.update(dp=10**30, global_batch_size=d["global_batch_size"] * 10**30 // d["dp"]),
     ("dp=1e30", "from 1 to 65,536")),
    (lambda d: d.update(dp=2 * d["dp"], global_batch_size=2 * d["global_batch_size"]),
     ("compiled for dp=2", "says dp=4", "Nothing was run")),
    (lambda d: d.update(micro_batch_size=d["micro_batch_size"] // 2, num_micro_batches=2 * d["num_micro_batches"]),
     ("micro_batch_size", "compiled for")),
])
def test_run_refuses_a_plan_json_the_module_was_not_compiled_for(capsys, compiled, tmp_path, never_launched,
                                                                   change, words):
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(compiled, folder)
    data = json.loads((folder / "plan.json").read_text())
    assert data["dp"] == 2 and data["micro_batch_size"] % 2 == 0
    change(data)
    (folder / "plan.json").write_text(json.dumps(data))
    refused(capsys, ["run", str(folder), "--steps", "1"], *words)


@pytest.mark.parametrize("override", ["optim.lr=nan", "optim.lr=-1", "train.eval_batches=0", "train.eval_every=2.5",
                                      "optim.max_grad_norm=inf", "data.val_fraction=0.7", "data.num_workers=-1"])
def test_run_overrides_out_of_range_are_refused_before_launching(capsys, compiled, never_launched, override):
    refused(capsys, ["run", str(compiled), "--steps", "1", override], override, "Nothing was run")


def test_run_override_numbers_in_range_pass():
    from autopar.runtime.run_settings import module_arguments

    arguments, _ = module_arguments(["optim.lr=1e-3", "train.eval_every=4", "optim.decay_steps=100"],
                                    {"--lr", "--decay-steps"})
    assert arguments == ["--lr", "1e-3", "--eval-every", "4", "--decay-steps", "100"]


def test_run_accepts_the_plan_json_compile_wrote(compiled):
    from autopar.runtime.run_settings import launch_plan

    assert launch_plan(compiled).world_size == 2


# -- the cluster description: hardware profiles and the GPU catalogue ------------------------------

GOOD_PROFILE = """\
gpus:
  cpu: {peak_flops: {fp32: 5.0e10}, efficiency: {gemm: 1.0}, memory_bandwidth_Bps: 1.0e10, launch_overhead_s: 1.0e-5}
links:
  intra:
    bandwidth_Bps: 1.0e9
    latency_s: 2.0e-4
    collectives: {all_gather: {latency_s: 1.0e-4, bandwidth_Bps: 2.0e9}}
time_scale: {compute: 1.2}
"""


@pytest.mark.parametrize("old, new, words", [
    ("latency_s: 2.0e-4", "latency_s: -1", "links.intra.latency_s=-1"),
    ("bandwidth_Bps: 1.0e9", "bandwidth_Bps: .nan", "links.intra.bandwidth_Bps=nan"),
    ("bandwidth_Bps: 2.0e9", "bandwidth_Bps: .inf", "links.intra.collectives.all_gather.bandwidth_Bps=inf"),
    ("gemm: 1.0", "gemm: 2.5", "gpus.cpu.efficiency="),
    ("fp32: 5.0e10", "fp32: 0", "gpus.cpu.peak_flops="),
    ("compute: 1.2", "compute: 0", "time_scale="),
    ("    latency_s: 2.0e-4\n", "", "links.intra.latency_s is missing"),
    ("time_scale: {compute: 1.2}", "time_scale: {compute: [", "is not YAML"),
])
def test_hardware_profile_numbers_are_checked(capsys, tmp_path, no_tracing, old, new, words):
    path = tmp_path / "hw.yaml"
    path.write_text(GOOD_PROFILE)
    ClusterSpec.from_config(ClusterConfig(hardware_profile=str(path)))  # the unedited profile is fine
    assert old in GOOD_PROFILE
    path.write_text(GOOD_PROFILE.replace(old, new))
    refused(capsys, ["estimate", MLP, "cluster=calibrated", f"cluster.hardware_profile={path}"], words, str(path))


def test_every_catalogue_gpu_has_numbers_in_range():
    from autopar.domain.bounds import Bound, within
    from cost_models.hardware import get_gpu, known_gpus

    positive, share = Bound(low=0, low_open=True), Bound(low=0, high=1, low_open=True, each=True)
    for name in known_gpus():
        gpu = get_gpu(name)
        for value in [*gpu.peak_flops.values(), gpu.memory_bytes, gpu.memory_bandwidth_Bps,
                      gpu.intra_node_bandwidth_GBps]:
            assert within(value, positive), name
        assert within(gpu.efficiency, share) and gpu.launch_overhead_s >= 0, name
