"""The model.py contract: what loads, and the message a user gets for each way it can break."""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from autopar.errors import ModelFileError
from autopar.model_file import build_fake, compute_loss, load_model_file
from tests.conftest import write_model_file

GOOD = """
import torch
def build_model(width=8):
    return torch.nn.Linear(width, 2)
def example_batch(batch_size, width=8):
    return (torch.randn(batch_size, width),)
"""


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ModelFileError, match="does not exist"):
        load_model_file(tmp_path / "absent.py")


def test_syntax_error_names_the_line(tmp_path):
    path = write_model_file(tmp_path, "def build_model(:\n    pass\n")
    with pytest.raises(ModelFileError, match=r"model.py:1: syntax error: .* \(`def build_model\(:`\)"):
        load_model_file(path)


def test_missing_function_is_named(tmp_path):
    path = write_model_file(tmp_path, "def build_model():\n    return None\n")
    with pytest.raises(ModelFileError, match=r"does not define example_batch\(\)"):
        load_model_file(path)


def test_raising_function_reports_call_and_line(tmp_path):
    source = GOOD.replace("return torch.nn.Linear(width, 2)", "raise ValueError('width too small')")
    path = write_model_file(tmp_path, source)
    with pytest.raises(ModelFileError,
                       match=r"build_model\(\) in model.py raised ValueError: width too small \(model.py:4\)"):
        build_fake(load_model_file(path), {}, 1)


def test_batch_that_is_not_tensors_is_refused(tmp_path):
    source = GOOD.replace("return (torch.randn(batch_size, width),)", "return [1, 2, 3]")
    with pytest.raises(ModelFileError, match=r"non-tensor values \(int\)"):
        build_fake(load_model_file(write_model_file(tmp_path, source)), {}, 1)


def test_batch_that_forward_cannot_take_names_the_keys_and_the_signature(tmp_path):
    """A dict batch is fed by keyword: keys that name none of forward's required arguments are
    refused before tracing, with both spelled out (inside the trace the TypeError read as an op
    fake tensors cannot run)."""
    from autopar.errors import UserError
    from autopar.profile import profile_model

    source = GOOD.replace("return (torch.randn(batch_size, width),)",
                          "return {'x': torch.randn(batch_size, width), 'y': torch.zeros(batch_size)}")
    with pytest.raises(UserError, match=r"returns a dict with keys 'x', 'y', which Linear.forward\(input: "
                                        r".*\) cannot take \(missing a required argument: 'input'\)"):
        profile_model(load_model_file(write_model_file(tmp_path, source)), {}, 2)


def test_loss_fn_that_calls_the_model_is_told_what_it_receives(tmp_path):
    """loss_fn(output, batch) gets what forward returned; one written as loss_fn(model, batch)
    that calls its first argument is told so, not that an op cannot run on fake tensors."""
    from autopar.errors import TraceError
    from autopar.profile import profile_model

    source = GOOD + "def loss_fn(model, batch):\n    return model(batch[0]).sum()\n"
    with pytest.raises(TraceError, match=r"loss_fn called its first argument .*not callable.*with what the "
                                         r"model's forward returned, not with the model") as raised:
        profile_model(load_model_file(write_model_file(tmp_path, source)), {}, 2)
    assert "fake kernel" not in str(raised.value)


def test_build_model_returning_non_module_is_refused(tmp_path):
    source = GOOD.replace("return torch.nn.Linear(width, 2)", "return 42")
    with pytest.raises(ModelFileError, match="returned int, not a torch.nn.Module"):
        build_fake(load_model_file(write_model_file(tmp_path, source)), {}, 1)


def test_unknown_model_override_lists_known_ones(tmp_path):
    path = write_model_file(tmp_path, GOOD)
    with pytest.raises(ModelFileError, match=r"model.widht is not a parameter.*model.width"):
        build_fake(load_model_file(path), {"widht": 4}, 1)


def test_real_tensors_made_outside_build_are_refused(tmp_path):
    source = textwrap.dedent("""
        import torch
        WEIGHTS = torch.zeros(4, 4)
        def build_model():
            layer = torch.nn.Linear(4, 4)
            layer.weight = torch.nn.Parameter(WEIGHTS)
            return layer
        def example_batch(batch_size):
            return torch.randn(batch_size, 4)
    """)
    with pytest.raises(ModelFileError, match="produced real tensors"):
        build_fake(load_model_file(write_model_file(tmp_path, source)), {}, 1)


def test_large_model_costs_no_real_memory(examples_dir):
    """A 7B-parameter build under FakeTensorMode allocates nothing (28 GB would not fit here)."""
    build = build_fake(load_model_file(examples_dir / "gpt.py"),
                       {"layers": 32, "hidden": 4096, "heads": 32, "seq_len": 2048, "vocab": 50257}, 1)
    params = list(build.model.parameters())
    assert sum(p.numel() for p in params) > 6e9
    assert all(isinstance(p, FakeTensor) for p in params)


def test_kwargs_reach_build_and_batch(examples_dir):
    build = build_fake(load_model_file(examples_dir / "gpt.py"), {"hidden": 64, "seq_len": 16, "heads": 2}, 3)
    assert build.model.wte.weight.shape[1] == 64
    assert build.batch["tokens"].shape == (3, 16)


def test_default_loss_uses_output_loss_then_mean(tmp_path):
    model_file = load_model_file(write_model_file(tmp_path, GOOD))

    class WithLoss:
        loss = torch.tensor(3.0)

    assert compute_loss(model_file, WithLoss(), None).item() == 3.0
    assert compute_loss(model_file, torch.tensor([1.0, 3.0]), None).item() == 2.0
