"""GPU catalogue (datasheet numbers), cluster topology (which links a group crosses), the
cluster presets as structured configs, and calibration profiles overriding both."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from cost_models.hardware import get_gpu, known_gpus
from cost_models.topology import (INTER_NODE, INTRA_NODE, LINK_EFFICIENCY, NETWORK_EFFICIENCY, ClusterConfig,
                                  ClusterSpec, NodeGroupConfig)

GB = 1e9
PRESETS = Path(__file__).resolve().parents[2] / "autopar" / "conf" / "cluster"


def test_catalogue_has_every_required_gpu_and_clear_unknown_error():
    for name in ("V100-32GB", "A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "B200", "L40S",
                 "MI300X", "cpu"):
        assert name in known_gpus()
    with pytest.raises(ValueError, match="Unknown GPU type 'Z9000'. Known types: .*A100-80GB.*MI300X"):
        get_gpu("Z9000")


@pytest.mark.parametrize("name,dtype,tflops", [
    ("A100-80GB", "bf16", 312), ("A100-80GB", "tf32", 156), ("A100-40GB", "fp32", 19.5),
    ("H100-SXM", "bf16", 989), ("H100-SXM", "fp8", 1979), ("H100-PCIe", "bf16", 756),
    ("B200", "bf16", 2250), ("MI300X", "fp8", 2614.9), ("L40S", "bf16", 362), ("V100-32GB", "fp16", 125),
])
def test_dense_peaks_are_the_datasheet_numbers(name, dtype, tflops):
    assert get_gpu(name).flops(dtype) == pytest.approx(tflops * 1e12)


def test_memory_and_bandwidth_from_datasheets():
    assert get_gpu("H200").memory_bytes == 141e9 and get_gpu("H200").memory_bandwidth_Bps == 4800e9
    assert get_gpu("a100-40gb").memory_bandwidth_Bps == 1555e9  # lookup ignores case
    assert get_gpu("H100-SXM").intra_node_bandwidth_GBps == 450


def test_dtype_fallbacks():
    # Volta has no bf16 tensor cores: bf16 runs at the fp32 rate, fp16 on tensor cores.
    assert get_gpu("V100-32GB").flops("bf16") == get_gpu("V100-32GB").flops("fp32")
    with pytest.raises(KeyError, match="A100-80GB has no fp8"):
        get_gpu("A100-80GB").flops("fp8")


def test_calibrated_spec_has_its_own_cache_signature():
    gpu = get_gpu("cpu")
    assert gpu.with_overrides(peak_flops={"fp32": 1e11}).signature != gpu.signature
    assert gpu.with_overrides(memory_bytes=1).signature == gpu.signature  # memory does not price ops


def test_group_links_decide_the_level_and_bottleneck():
    spec = ClusterSpec.from_config(ClusterConfig(name="x", gpu="A100-80GB", nodes=2, gpus_per_node=8,
                                                 inter_node_bandwidth_GBps=25))
    inside = spec.group_links(list(range(8)))
    assert inside.level == INTRA_NODE and inside.bandwidth_Bps == pytest.approx(300 * GB * LINK_EFFICIENCY["NVLink3"])
    across = spec.strided_placement(2, 8)  # rank 0 and rank 8: one GPU per node
    assert across.level == INTER_NODE and across.bandwidth_Bps == pytest.approx(25 * GB * NETWORK_EFFICIENCY)
    assert across.ring_link.bandwidth_Bps == pytest.approx(25 * GB * NETWORK_EFFICIENCY)
    everyone = spec.group_links(list(range(16)))  # a ring gets one channel per NIC: 8 x 24 GB/s
    assert everyone.ring_link.bandwidth_Bps == pytest.approx(8 * 25 * GB * NETWORK_EFFICIENCY)
    assert everyone.latency_s == pytest.approx(8e-6)
    with pytest.raises(ValueError, match=r"ranks must lie in \[0, 16\)"):
        spec.group_links([0, 16])


def test_mixed_cluster_has_a_gpu_type_per_rank():
    spec = ClusterSpec.from_config(ClusterConfig(
        name="mixed", gpus_per_node=8, node_groups=[NodeGroupConfig("H100-SXM", 2), NodeGroupConfig("A100-80GB", 1)]))
    types = spec.gpu_types()
    assert len(types) == 24 and types[:16] == ["H100-SXM"] * 16 and types[16:] == ["A100-80GB"] * 8
    assert spec.gpu_of_rank(17).name == "A100-80GB" and not spec.homogeneous
    # The slower GPU's link bounds the intra-node level.
    assert spec.intra.name == "NVLink3"


def test_bad_clusters_fail_clearly():
    with pytest.raises(ValueError, match="cluster.nodes=0 is out of range"):
        ClusterSpec.from_config(ClusterConfig(name="empty", gpu="H100-SXM", nodes=0))
    with pytest.raises(ValueError, match="has no GPUs"):
        ClusterSpec.from_config(ClusterConfig(name="empty", node_groups=[NodeGroupConfig(gpu="H100-SXM", nodes=0)]))
    with pytest.raises(ValueError, match="Unknown GPU type"):
        ClusterSpec.from_config(ClusterConfig(name="typo", gpu="H1OO"))


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS.glob("*.yaml") if p.stem != "calibrated"))
def test_presets_are_structured_cluster_configs(preset):
    """Each preset's keys are ClusterConfig fields, and it resolves to a cluster."""
    data = yaml.safe_load((PRESETS / f"{preset}.yaml").read_text())
    fields = {f.name for f in dataclasses.fields(ClusterConfig)}
    keys = set(data) - {"defaults"}
    assert keys <= fields and data["defaults"] == ["cluster_schema", "_self_"]
    config = OmegaConf.merge(OmegaConf.structured(ClusterConfig), {k: data[k] for k in keys})
    spec = ClusterSpec.from_config(config)
    assert spec.world_size == spec.nodes * config.gpus_per_node and spec.name == preset


def test_mixed_preset_is_an_h100_node_and_an_a100_node():
    data = yaml.safe_load((PRESETS / "mixed_h100_a100.yaml").read_text())
    spec = ClusterSpec.from_config(OmegaConf.merge(OmegaConf.structured(ClusterConfig),
                                                   {k: v for k, v in data.items() if k != "defaults"}))
    assert spec.gpu_types() == ["H100-SXM"] * 8 + ["A100-80GB"] * 8


def test_hardware_profile_overrides_gpu_and_links(tmp_path):
    profile = {"gpus": {"cpu": {"peak_flops": {"fp32": 7.5e10}, "efficiency": {"elementwise": 0.25},
                                "memory_bandwidth_Bps": 2e10, "launch_overhead_s": 4e-6}},
               "links": {"intra": {"bandwidth_Bps": 1.2e9, "latency_s": 2e-4,
                                   "collectives": {"all_gather": {"bandwidth_Bps": 6e8, "latency_s": 3e-4}}}}}
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(profile))
    spec = ClusterSpec.from_config(ClusterConfig(name="calibrated", gpu="cpu", hardware_profile=str(path)))
    gpu = spec.node_gpus[0]
    assert gpu.flops("fp32") == 7.5e10 and gpu.efficiency["elementwise"] == 0.25
    assert gpu.efficiency["gemm"] == 1.0  # untouched entries stay
    assert gpu.memory_bandwidth_Bps == 2e10 and gpu.launch_overhead_s == 4e-6
    assert spec.intra.bandwidth_Bps == 1.2e9 and spec.intra.latency_s == 2e-4  # measured: no efficiency factor
    assert spec.intra.alpha_beta("all_gather") == (3e-4, 6e8)
    assert spec.calibration == str(path)


def test_gemm_shape_efficiency_hand_counts():
    """Tile and wave quantisation against hand counts (cost_models.compute.gemm_shape_efficiency)."""
    from cost_models.compute import gemm_dims, gemm_shape_efficiency

    # 2048 x 2304 on 132 SMs: 256x128 tiles -> 8 x 18 = 144 tiles, 2 waves of 132: 144/264;
    # 128x256 -> 16 x 9 = 144 likewise; 128x128 -> 16 x 18 = 288 tiles, 3 waves: 288/396 (the best)
    assert gemm_shape_efficiency(1, 2048, 2304, 2304, 132) == pytest.approx(288 / 396)
    # 2048 x 288 on 108 SMs: 128x128 tiles -> 16 x 3 = 48 tiles covering 2048 x 384 (tile share 0.75);
    # split-K in 2 -> 96 slices in one wave of 108: 0.75 x 96/108
    assert gemm_shape_efficiency(1, 2048, 288, 2304, 108) == pytest.approx(0.75 * 96 / 108)
    # a large square product: 256x128 tiles -> 32 x 64 = 2048 tiles in 19 waves of 108
    assert gemm_shape_efficiency(1, 8192, 8192, 8192, 108) == pytest.approx(2048 / 2052)
    assert gemm_shape_efficiency(4, 64, 64, 64, 0) == 1.0  # SM count unknown: shape-independent
    op = type("Op", (), {"target": "aten.addmm.default", "input_shapes": [[6912], [2048, 2304], [2304, 6912]]})()
    assert gemm_dims(op) == (1, 2048, 6912, 2304)
    bmm = type("Op", (), {"target": "aten.bmm.default", "input_shapes": [[24, 2048, 96], [24, 96, 2048]]})()
    assert gemm_dims(bmm) == (24, 2048, 2048, 96)


@pytest.mark.unit
def test_a100_efficiencies_carry_the_fitted_compute_scale():
    """The A100's catalogue efficiencies are a lone kernel's divided by the scale fitted to
    published runs (at today's 1.05, hand count: matmul 0.87 / 1.05 = 0.829, attention
    0.52 / 1.05 = 0.495); views stay free and GPUs without a fit keep the defaults."""
    from cost_models.hardware import COMPUTE_TIME_SCALE, DEFAULT_EFFICIENCY

    scale = COMPUTE_TIME_SCALE["A100"]
    for name in ("A100-40GB", "A100-80GB"):
        gpu = get_gpu(name)
        assert gpu.efficiency["gemm"] == pytest.approx(0.87 / scale, abs=1e-3)
        assert gpu.efficiency["attention"] == pytest.approx(0.52 / scale, abs=1e-3)
        assert gpu.efficiency["view"] == 1.0
    assert get_gpu("H100-SXM").efficiency == DEFAULT_EFFICIENCY


def test_power_limit_slows_compute_by_the_cube_root_of_dynamic_power():
    """A Grand Teton H100 at 500 W of its rated 700 W, idling at 128 W: its clock sustains
    ((500 - 128) / (700 - 128))^(1/3) = 0.8664 of the rated-power clock, so a GEMM-bound op takes
    1 / 0.8664 = 1.154x as long and a memory-bound one the same time."""
    from cost_models.compute import roofline_s

    rated = get_gpu("H100-SXM-96GB")
    limited = rated.with_overrides(power_limit_W=500)
    assert limited.clock_share == pytest.approx(0.8664, abs=1e-4)
    gemm = (2 * 8192**3, 3 * 2 * 8192**2)
    assert roofline_s("gemm", *gemm, limited, "bf16") / roofline_s("gemm", *gemm, rated, "bf16") == pytest.approx(
        1 / 0.8664, rel=1e-4)
    copy = (0, 2 * 2**30)
    assert roofline_s("memory", *copy, limited, "bf16") == roofline_s("memory", *copy, rated, "bf16")
    assert rated.with_overrides(power_limit_W=800).clock_share == 1.0  # no clock above the rated limit's
    assert limited.signature != rated.signature  # priced layers are cached per signature


def test_cluster_power_limit_reaches_every_gpu_and_is_checked():
    preset = ClusterConfig(name="teton", gpu="H100-SXM-96GB", nodes=2, gpus_per_node=8, power_limit_W=500)
    cluster = ClusterSpec.from_config(preset)
    assert {gpu.power_limit_W for gpu in cluster.node_gpus} == {500}
    with pytest.raises(ValueError, match="idle power"):
        ClusterSpec.from_config(dataclasses.replace(preset, power_limit_W=100))
    with pytest.raises(ValueError, match="power_limit_W"):
        ClusterSpec.from_config(dataclasses.replace(preset, power_limit_W=-5))


def test_causal_attention_is_priced_by_the_blocks_its_kernel_computes():
    """Causal attention over 4096 tokens (32 query blocks of 128): query block i reads key blocks
    0..i, 33/64 of the square the flop counter counts; its tail is half the longest tile (one
    query block of one head against all 32 key blocks) on one of the H100's 132 SMs."""
    from types import SimpleNamespace

    from cost_models.compute import attention_tail_s, attention_work_share, op_roofline_s, roofline_s

    gpu = get_gpu("H100-SXM")
    flops = 4 * 1 * 16 * 4096**2 * 128
    causal = SimpleNamespace(op_class="attention", flops=flops, bytes_read=0, bytes_written=0,
                             input_shapes=[[1, 16, 4096, 128]], causal=True)
    full = SimpleNamespace(**{**vars(causal), "causal": False})
    assert attention_work_share(causal) == 33 / 64 and attention_work_share(full) == 1.0
    per_sm = 989e12 * gpu.efficiency_of("attention") / 132
    assert attention_tail_s(causal, gpu, "bf16") == pytest.approx(0.5 * flops / (16 * 32) / per_sm)
    assert op_roofline_s(causal, gpu, "bf16") == pytest.approx(
        roofline_s("attention", flops * 33 / 64, 0, gpu, "bf16") + attention_tail_s(causal, gpu, "bf16"))
