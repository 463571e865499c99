"""Models fake tensors cannot run (`.numpy()` in forward, a custom op without a fake kernel):
traced once with real tensors (autopar.model_file.build_real) when small enough, with the reason
kept in the profile and plan; refused as before when too large, or when the real run fails too."""
from __future__ import annotations

from pathlib import Path

import pytest

from autopar.errors import TraceError
from autopar.model_file import load_model_file
from autopar.profile import profile_model
from tests.unit.test_bad_input import fails

ZOO_MODEL = Path(__file__).resolve().parents[1] / "zoo" / "models" / "untraceable.py"
NUMPY_LINE = "lengths = attention_mask.sum(-1).cpu().numpy()"


def _twin(tmp_path: Path, positions: str, preamble: str = "") -> Path:
    """The zoo model with its positions computed by ``positions`` (an expression of ids and
    attention_mask) instead of NumPy."""
    source = ZOO_MODEL.read_text()
    start = source.index("        " + NUMPY_LINE)
    end = source.index("        h = self.embed(ids)")
    body = source[:start] + f"        positions = {positions}\n" + source[end:]
    body = body.replace("torch.from_numpy(positions).to(ids.device)", "positions")
    path = tmp_path / "twin.py"
    path.write_text(preamble + body)
    return path


def test_a_numpy_forward_is_traced_for_real_and_costs_what_its_torch_twin_does(tmp_path):
    """The same model with positions computed by torch ops traces on fake tensors; the NumPy one is
    traced with real tensors, its reason naming the line, and prices the same FLOPs, parameters
    and layers (NumPy's positions are a constant of the real trace, and position arithmetic
    costs no FLOPs)."""
    real = profile_model(load_model_file(ZOO_MODEL), {}, 2)
    assert real.real_values and NUMPY_LINE in real.real_values and ".numpy()" in real.real_values
    assert "traced with real tensors" in real.traced_words()
    twin = profile_model(load_model_file(_twin(
        tmp_path, "torch.minimum(torch.arange(ids.shape[1]), (attention_mask.sum(-1, keepdim=True) - 1)"
                  ".clamp(min=0))")), {}, 2)
    assert twin.real_values is None
    assert (real.flops_forward, real.flops_backward, real.param_count) == \
        (twin.flops_forward, twin.flops_backward, twin.param_count)
    assert [layer.name for layer in real.layers] == [layer.name for layer in twin.layers]
    assert real.block_containers == twin.block_containers == ["layers"]


def test_a_custom_op_without_a_fake_kernel_is_traced_for_real(tmp_path):
    """An op registered with torch.library and no fake kernel stops fake tensors; the real trace
    runs its real kernel and names it."""
    preamble = ("import torch\n"
                "@torch.library.custom_op('autopar_real_trace_test::positions', mutates_args=())\n"
                "def custom_positions(mask: torch.Tensor) -> torch.Tensor:\n"
                "    lengths = mask.sum(-1, keepdim=True)\n"
                "    return torch.minimum(torch.arange(mask.shape[1]).expand_as(mask), (lengths - 1).clamp(min=0))\n")
    profile = profile_model(load_model_file(_twin(tmp_path, "custom_positions(attention_mask)", preamble)), {}, 2)
    assert profile.real_values and "custom_positions(attention_mask)" in profile.real_values


def test_a_model_too_large_to_run_for_real_keeps_the_fake_error(monkeypatch):
    monkeypatch.setattr("autopar.model_file.REAL_TRACE_LIMIT_BYTES", 1000)
    with pytest.raises(TraceError) as raised:
        profile_model(load_model_file(ZOO_MODEL), {}, 2)
    message = str(raised.value)
    assert NUMPY_LINE in message and "too large to trace with real tensors" in message
    assert "register_fake" in raised.value.fix


def test_a_model_that_fails_for_real_too_reports_the_fake_error(tmp_path):
    """A bug of the model's own (a shape mismatch) fails on real tensors as well: the error is the
    first one, naming the line, not the real run's."""
    path = _twin(tmp_path, "torch.arange(ids.shape[1]) @ torch.ones(3, 3)")
    with pytest.raises(TraceError) as raised:
        profile_model(load_model_file(path), {}, 2)
    assert "torch.ones(3, 3)" in str(raised.value) and "real tensors" not in str(raised.value)


def test_compile_without_a_local_check_refuses_a_model_fake_tensors_cannot_run(capsys, tmp_path):
    """On a GPU cluster the small-scale check is off by default and no fake step can run this
    model: compile refuses before writing anything, and says how to prove it."""
    out = tmp_path / "out"
    fails(capsys, ["compile", str(ZOO_MODEL), "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=8",
                   "--out-dir", str(out)], "fake tensors cannot run this model", NUMPY_LINE, "check=on",
          unwritten=(out,))
