"""The in-process API's own parts (autopar/api.py): settings as overrides, where the model file
is, refusals before any work; its training is tests/dist/test_api.py's."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autopar
from autopar import api
from autopar.config import compose_config
from autopar.driver import run_plan
from autopar.errors import UserError

REPO = Path(__file__).resolve().parents[2]
GPT = REPO / "examples" / "gpt.py"
SMALL = ["cluster=cpu_gloo", "cluster.gpus_per_node=2", "model.layers=2", "model.hidden=64", "model.heads=4",
         "model.seq_len=32", "model.vocab=128", "train.global_batch_size=8", "train.precision=fp32"]


def test_keyword_settings_become_the_overrides_the_command_line_takes():
    assert api.overrides_of(("plan.tp=2",), {"cluster": "cpu_gloo", "model": {"layers": 4, "tied": True},
                                             "plan": {"layer_recompute": None, "dp_shares": [3, 1]},
                                             "cluster.nodes": 2}) == \
        ["plan.tp=2", "cluster=cpu_gloo", "model.layers=4", "model.tied=true", "plan.layer_recompute=null",
         "plan.dp_shares=[3,1]", "cluster.nodes=2"]


def test_the_model_file_is_found_from_a_path_a_module_or_a_function():
    assert api.model_path("model.py") == Path("model.py")
    assert api.model_path(api) == Path(api.__file__)
    assert api.model_path(test_the_model_file_is_found_from_a_path_a_module_or_a_function) == Path(__file__)
    with pytest.raises(UserError, match="which file defines"):
        api.model_path(42)


def test_plan_is_the_search_of_autopar_plan():
    """The same plan as the driver's search for the same overrides, settings given as keywords."""
    pins = [item for item in SMALL if not item.startswith("model.")]
    planned = autopar.plan(GPT, *pins, model={"layers": 2, "hidden": 64, "heads": 4, "seq_len": 32, "vocab": 128})
    expected = run_plan(GPT, compose_config(SMALL)).plan
    assert planned.summary() == expected.summary()
    assert autopar.plan(GPT, *SMALL).summary() == expected.summary()  # again, with autopar.plans imported by now
    assert planned.provenance.model_path == expected.provenance.model_path


def test_parallelize_without_a_process_group_says_how_to_start_one():
    plan = run_plan(GPT, compose_config(SMALL)).plan
    with pytest.raises(UserError, match="init_process_group"):
        autopar.parallelize(torch.nn.Linear(2, 2), plan)


def test_checkpoints_without_a_folder_of_the_users_are_refused():
    """Checkpoints would default into the generated module's temporary folder, which goes when
    the process ends: a checkpoint frequency without a checkpoint_dir is refused before anything
    else, naming both."""
    plan = run_plan(GPT, compose_config(SMALL)).plan
    with pytest.raises(UserError, match="checkpoint_every needs a checkpoint_dir.*removed when the process ends"):
        autopar.parallelize(torch.nn.Linear(2, 2), plan, options={"checkpoint_every": 2})


def test_a_batch_of_another_size_than_the_plans_is_refused():
    api.check_batch_size({"ids": torch.zeros(8, 4)}, 8)
    with pytest.raises(UserError, match=r"\[4\] samples .* global batches of 8"):
        api.check_batch_size({"ids": torch.zeros(4, 4), "labels": torch.zeros(4, 4)}, 8)


def test_importing_autopar_does_not_import_torch():
    """The command line starts without torch; the API loads on first use."""
    code = ("import sys, autopar; print('torch' in sys.modules); from autopar import api; "
            "print(autopar.parallelize is api.parallelize and callable(autopar.plan))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert done.stdout.split() == ["False", "True"]


def test_estimate_prices_the_pinned_plan():
    """autopar.estimate is `autopar estimate`: the pinned layout's price."""
    from autopar.driver import run_estimate

    priced = autopar.estimate(GPT, *SMALL, plan={"dp": 2})
    assert priced.step_time_s == pytest.approx(run_estimate(GPT, compose_config([*SMALL, "plan.dp=2"]))[2].step_time_s)
    assert priced.step_time_s > 0
