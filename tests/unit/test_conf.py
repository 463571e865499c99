"""The Hydra configuration: every preset composes and validates, every schema field is documented,
overrides reach the planner, and typos are refused instead of silently ignored."""
from __future__ import annotations

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from autopar import config
from autopar.config import compose_config
from autopar.specs import build_cluster
from autopar.driver import run_plan
from autopar.errors import ConfigError
from cost_models import topology

CONF = Path(__file__).resolve().parents[2] / "autopar" / "conf"
TINY = ["model.layers=2", "model.hidden=64", "model.heads=4", "model.seq_len=32", "model.vocab=128",
        "train.global_batch_size=8", "train.precision=fp32"]


@pytest.mark.parametrize("preset", sorted(p.stem for p in (CONF / "cluster").glob("*.yaml")))
def test_every_cluster_preset_composes_and_builds(preset, tmp_path):
    overrides = [f"cluster={preset}"]
    if preset == "calibrated":  # needs a measured profile: a minimal one
        profile = tmp_path / "hw.yaml"
        profile.write_text(yaml.safe_dump({"gpus": {"cpu": {"peak_flops": {"fp32": 5e10}}},
                                           "links": {"intra": {"bandwidth_Bps": 2e9, "latency_s": 5e-5}}}))
        overrides.append(f"cluster.hardware_profile={profile}")
    cfg = compose_config(overrides)
    cluster = build_cluster(cfg)
    assert cluster.name == preset and cluster.world_size >= 1
    assert cfg.cluster.name == preset


def test_the_issue_presets_exist():
    wanted = {"dgx_a100_40g", "dgx_a100_80g", "dgx_h100", "hgx_h200", "pcie_l40s_x8", "mixed_h100_a100", "cpu_gloo",
              "calibrated"}
    assert wanted <= {p.stem for p in (CONF / "cluster").glob("*.yaml")}
    for group in ("train", "solver", "plan"):
        assert list((CONF / group).glob("*.yaml")), group


def _undocumented(cls) -> list[str]:
    """Fields of a dataclass not followed by a docstring in its source."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    documented = set()
    for statement, following in zip(body, body[1:]):
        if isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr) and \
                isinstance(following.value, ast.Constant) and isinstance(following.value.value, str):
            documented.add(statement.target.id)
    return [f.name for f in fields(cls) if f.name not in documented]


@pytest.mark.parametrize("schema", [config.TrainConfig, config.SolverConfig, config.PlanPins, topology.ClusterConfig,
                                    topology.NodeGroupConfig])
def test_every_schema_field_has_a_docstring(schema):
    assert _undocumented(schema) == []


@pytest.mark.parametrize("override", ["cluster.nodez=2", "solver.time_limit=3", "train.global_batch=8",
                                      "plan.tp=two", "cluster=dgx_h1000"])
def test_typos_are_refused_with_the_key_named(override):
    with pytest.raises(ConfigError) as caught:
        compose_config([override])
    assert override.split("=")[0].split(".")[-1] in str(caught.value) or override.split("=")[1] in str(caught.value)


def test_overrides_reach_the_planner(examples_dir):
    """Pins and solver settings given as overrides shape the plan: tp pinned, only GPipe allowed,
    one runner-up, and the cluster size from cluster.gpus_per_node."""
    cfg = compose_config(["cluster=cpu_gloo", "cluster.gpus_per_node=4", "plan.tp=2", "plan.pp=2",
                          "solver.schedules=[gpipe]", "solver.top_k=1", *TINY])
    result = run_plan(examples_dir / "gpt.py", cfg)
    plan = result.plan
    assert (plan.tp, plan.pp, plan.world_size, plan.schedule) == (2, 2, 4, "gpipe")
    assert len([a for a in result.alternatives if "over memory" not in a.reason]) <= 1
    assert plan.provenance.cluster_config["gpus_per_node"] == 4
