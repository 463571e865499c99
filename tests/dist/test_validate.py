"""`autopar validate` and `autopar calibrate --from` end to end on 2 gloo ranks."""
from __future__ import annotations

import json

import pytest
import yaml

from autopar.cli import main

TINY = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "model.layers=2", "model.hidden=64", "model.heads=4",
        "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8", "train.precision=fp32", "plan.dp=2",
        "plan.zero_stage=0"]


@pytest.fixture(scope="module")
def validated(examples_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("validate") / "tiny"
    assert main(["compile", str(examples_dir / "gpt.py"), *TINY, "--out-dir", str(out), "-q"]) == 0
    assert main(["validate", str(out), "--steps", "3", "-q"]) == 0
    return out


def test_validate_json_has_predicted_and_measured_fields_for_every_rank(validated):
    data = json.loads((validated / "validate.json").read_text())
    assert data["world_size"] == 2 and sorted(r["rank"] for r in data["ranks"]) == [0, 1]
    for rank in data["ranks"]:
        for key in ("step_time_s", "comm_s", "compute_s", "peak_memory_bytes"):
            assert rank["predicted"][key] >= 0 and rank["measured"][key] >= 0
        measured = rank["measured"]
        assert measured["step_time_s"] > 0 and measured["comm_s"] > 0  # DP all-reduces gradients
        assert measured["peak_memory_bytes"] > 0
        assert set(rank["error_pct"]) == {"step_time_s", "peak_memory_bytes"}
    assert len(json.loads((validated / "measure" / "rank_0.json").read_text())["step_times_s"]) == 3


def test_calibrate_from_the_run_writes_factors_that_reprice_it(validated, tmp_path):
    out = tmp_path / "hw.yaml"
    assert main(["calibrate", "--from", str(validated / "validate.json"), "--out", str(out), "-q"]) == 0
    scale = yaml.safe_load(out.read_text())["time_scale"]
    data = json.loads((validated / "validate.json").read_text())
    slowest = max(data["ranks"], key=lambda r: r["measured"]["step_time_s"])
    predicted_compute = sum(data["time_breakdown"][p] for p in ("compute", "recompute", "optimizer"))
    # The profile keeps each factor to 6 decimals (feedback.write_profile): a small factor (a fast
    # machine) carries a relative rounding of several 1e-6, so the factor itself is compared (to
    # within one unit of its last decimal).
    assert scale["compute"] == pytest.approx(slowest["measured"]["compute_s"] / predicted_compute, rel=0, abs=1e-6)
    assert scale["dp_comm"] > 0
