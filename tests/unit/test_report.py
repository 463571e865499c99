"""Plan reports, the simulated timeline and sweeps: what they contain, not how they look."""
from __future__ import annotations

import csv
import json
import random
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from autopar.cli import main
from autopar.plans import Plan
from autopar.report.timeline import COMMUNICATION, schedule_order, simulate
from cost_models.pipeline import pipeline_step_time_s, simulate_schedule

TINY = ["model.layers=4", "model.hidden=64", "model.heads=4", "model.seq_len=32", "model.vocab=128",
        "train.precision=fp32"]


def test_timeline_matches_the_reference_schedule_player():
    """GPipe and 1F1B with uneven random stages: the timeline's makespan is the reference
    simulator's (which the cost model's closed form is tested against)."""
    rng = random.Random(3)
    for _ in range(100):
        p, m, schedule = rng.randint(1, 4), rng.randint(1, 8), rng.choice(["gpipe", "1f1b"])
        forward = [rng.uniform(0.5, 2) for _ in range(p)]
        backward = [rng.uniform(1, 4) for _ in range(p)]
        stages = [{"forward_s": f, "backward_s": b, "send_s": 0.0} for f, b in zip(forward, backward)]
        timeline = simulate(stages, [{}] * p, p, 1, m, schedule)
        assert timeline.step_time_s == pytest.approx(simulate_schedule(forward, backward, m, schedule))


@pytest.mark.parametrize("p,v,m", [(2, 2, 2), (2, 3, 4), (4, 2, 8), (4, 3, 4)])
def test_interleaved_timeline_equals_the_closed_form_for_equal_stages(p, v, m):
    """(m + (p-1)/v)·D for equal stages (Narayanan et al. 2021): the interleaved order plays to it."""
    stages = [{"forward_s": 1.0, "backward_s": 2.0, "send_s": 0.0}] * (p * v)
    timeline = simulate(stages, [{}] * p, p, v, m, "interleaved_1f1b")
    assert timeline.step_time_s == pytest.approx(pipeline_step_time_s([3.0 * v] * p, m, v))
    assert timeline.bubble_s(p - 1) == pytest.approx((p - 1) * 3.0)


def test_schedule_order_runs_every_op_once():
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2)):
        for d in range(4):
            ops = schedule_order(schedule, 4, v, 8, d)
            assert sorted(ops) == sorted((kind, c, mb) for kind in "FB" for c in range(v) for mb in range(8))


def test_sends_sit_on_their_own_track_and_delay_the_next_stage():
    stages = [{"forward_s": 1.0, "backward_s": 2.0, "send_s": 0.5},
              {"forward_s": 1.0, "backward_s": 2.0, "send_s": 0.0}]
    timeline = simulate(stages, [{"dp_comm_s": 0.25, "optimizer_s": 0.1}] * 2, 2, 1, 2, "1f1b")
    sends = [e for e in timeline.events if e.phase == "send"]
    assert sends and all(e.lane == COMMUNICATION for e in sends)
    first_on_1 = min(e.start_s for e in timeline.events if e.pp_rank == 1 and e.phase == "forward")
    assert first_on_1 == pytest.approx(1.5)  # stage 0's forward, then its send
    assert sum(1 for e in timeline.events if e.phase == "dp_sync") == 2


@pytest.fixture(scope="module")
def reported(examples_dir, tmp_path_factory) -> Path:
    """A pipelined plan of a tiny GPT on 4 CPU ranks, with its report written."""
    folder = tmp_path_factory.mktemp("report")
    code = main(["plan", str(examples_dir / "gpt.py"), "cluster=cpu_gloo", "cluster.gpus_per_node=4", "plan.pp=2",
                 "plan.tp=2", "train.global_batch_size=8", *TINY, "--out", str(folder / "plan.json"),
                 "--report", str(folder), "-q"])
    assert code == 0
    return folder


class _Checker(HTMLParser):
    """Collects tags and every URL-bearing attribute; checks nesting of non-void tags."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.urls: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


def test_report_html_is_well_formed_and_self_contained(reported):
    text = (reported / "report.html").read_text()
    checker = _Checker()
    checker.feed(text)
    assert checker.stack == []
    assert checker.urls and all(url.startswith("data:image/png;base64,") for url in checker.urls)
    assert not re.search(r"https?://", text)
    assert checker.tags.count("img") == 3 and checker.tags.count("table") >= 6


def test_report_says_what_the_issue_asks(reported):
    text = (reported / "report.md").read_text()
    plan = Plan.load(reported / "plan.json")
    for heading in ("The plan in words", "Predicted performance", "Where the step time goes", "Device mesh",
                    "Pipeline stages and memory per rank", "Timeline of one step", "Alternatives and why they lost",
                    "What binds this plan", "Cost model assumptions"):
        assert f"## {heading}" in text
    assert "TP 2 inside the node" in text and "PP 2 inside the node" in text
    assert "your pins: plan.tp=2, plan.pp=2" in text
    # The mesh grid gives every rank its coordinate, matching the plan's rank grid.
    grid = plan.rank_grid()  # (dp, pp, cp, tp)
    for rank in range(plan.world_size):
        coords = [(d, p, c, t) for d in range(plan.dp) for p in range(plan.pp) for c in range(plan.cp)
                  for t in range(plan.tp) if grid[d][p][c][t] == rank][0]
        assert f"r{rank} pp{coords[1]} tp{coords[3]}" in text


def test_timeline_json_has_one_event_per_rank_micro_batch_and_phase(reported):
    plan = Plan.load(reported / "plan.json")
    trace = json.loads((reported / "timeline.json").read_text())
    ops = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] in ("forward", "backward")]
    keys = [(e["pid"], e["args"]["micro_batch"], e["args"]["stage"], e["cat"]) for e in ops]
    assert len(keys) == len(set(keys)) == plan.pp * plan.chunks * plan.num_micro_batches * 2
    assert {e["pid"] for e in ops} == set(range(plan.pp))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"compute", "communication"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in ops)


def test_report_verb_rerenders_a_folder_and_reprices_a_bare_plan(examples_dir, reported, tmp_path):
    assert main(["report", str(reported), "-q"]) == 0
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "plan.json").write_text((reported / "plan.json").read_text())
    assert main(["report", str(bare / "plan.json"), "--model", str(examples_dir / "gpt.py"), "-q"]) == 0
    again = json.loads((bare / "report.json").read_text())
    first = json.loads((reported / "report.json").read_text())
    assert again["estimate"]["step_time_s"] == pytest.approx(first["estimate"]["step_time_s"], rel=1e-9)
    assert again["alternatives"] == [] and "Rebuilt from plan.json" in (bare / "report.md").read_text()
    # plan.json keeps no wall time (byte-stable), so the re-priced report says so instead of "0.0 s"
    assert again["solver_seconds"] is None and first["solver_seconds"] > 0
    assert "search time not recorded" in (bare / "report.md").read_text()
    assert "search time not recorded" not in (reported / "report.md").read_text()


def test_report_of_a_corrupted_plan_exits_1_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "plan.json").write_text("{not json")
    assert main(["report", str(tmp_path / "plan.json")]) == 1
    assert "not a readable plan" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


def test_sweep_of_three_points_writes_three_rows(examples_dir, tmp_path):
    out = tmp_path / "sweep"
    code = main(["plan", str(examples_dir / "gpt.py"), "-m", "cluster=cpu_gloo", "cluster.gpus_per_node=1,2,4",
                 "cluster.price_per_gpu_hour=2.0", "train.global_batch_size=8", *TINY, "--out-dir", str(out), "-q"])
    assert code == 0
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [int(row["gpus"]) for row in rows] == [1, 2, 4]
    for row in rows:
        plan = Plan.load(out / row["point"] / "plan.json")
        assert int(row["dp"]) * int(row["tp"]) * int(row["pp"]) * int(row["cp"]) == int(row["gpus"]) == plan.world_size
        expected = 2.0 * plan.world_size / 3600 / plan.predicted.tokens_per_s * 1e6
        assert float(row["cost_per_million_tokens"]) == pytest.approx(expected, rel=1e-5)
    assert (out / "sweep.png").stat().st_size > 0 \
        and (out / "sweep.md").read_text().count("| cluster.gpus_per_node=") == 3


def test_a_bad_sweep_value_exits_1_before_planning(examples_dir, tmp_path, capsys):
    code = main(["plan", str(examples_dir / "gpt.py"), "-m", "cluster=cpu_gloo", "cluster.gpus_per_node=1,two",
                 *TINY, "--out-dir", str(tmp_path / "s")])
    assert code == 1
    assert "gpus_per_node" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_loss_curves_keep_the_last_record_of_each_step():
    """A run killed after step 2 restarts from a checkpoint at step 1: steps 1 and 2 are
    recorded twice, and the restarted attempt's records are the curve."""
    from autopar.report.training import loss_curves

    first = [{"step": s, "loss": loss, "attempt": 0, "run_id": "a", "step_time_s": 0.5}
             for s, loss in ((0, 4.0), (1, 3.0), (2, 2.5))]
    validation = [{"step": 2, "val_loss": 3.5}]
    restart = [{"step": s, "loss": loss, "attempt": 1, "run_id": "a", "step_time_s": 0.25}
               for s, loss in ((1, 3.25), (2, 2.75), (3, 2.0))]
    curves = loss_curves(first + validation + restart + [{"step": 4, "val_loss": 2.5}])
    assert curves.train == [(0, 4.0), (1, 3.25), (2, 2.75), (3, 2.0)]
    assert curves.validation == [(2, 3.5), (4, 2.5)]
    assert curves.step_times_s == [0.5, 0.25, 0.25, 0.25]


def test_moving_average_is_the_trailing_mean():
    from autopar.report.training import moving_average

    assert moving_average([4.0, 2.0, 6.0, 0.0], 2) == [4.0, 3.0, 4.0, 3.0]


def test_report_draws_the_loss_curves_of_run_jsonl(reported, tmp_path):
    import shutil

    assert not (reported / "loss.png").exists() and "Training run" not in (reported / "report.md").read_text()
    folder = tmp_path / "trained"
    shutil.copytree(reported, folder)
    records = [{"step": s, "loss": 5.0 - 0.1 * s, "step_time_s": 0.1, "attempt": 0, "run_id": "r"} for s in range(30)]
    records += [{"step": s, "val_loss": 5.2 - 0.1 * s} for s in (9, 19, 29)]
    (folder / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 30, "lo')
    assert main(["report", str(folder), "-q"]) == 0
    assert (folder / "loss.png").read_bytes().startswith(b"\x89PNG")
    markdown = (folder / "report.md").read_text()
    assert "![loss curves](loss.png)" in markdown
    assert ("30 steps recorded (steps 0-29); last training loss 2.1000; last validation loss 2.3000 (step 29)"
            in markdown)
    html_images = (folder / "report.html").read_text().count("<img")
    assert html_images == (reported / "report.html").read_text().count("<img") + 1
