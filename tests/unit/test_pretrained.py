"""Pretrained weights in and model folders out (autopar/sections/pretrained.py), in one process.

Loading is checked against the tensors that were saved (exact: the same values, cast where the
file's dtype differs); a rank's shard of a DTensor against what ``distribute_tensor`` gives that
rank, on a fake process group of 4 ranks (no communication: every rank's part is computed
locally); the export against what ``transformers`` loads back.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from autopar.cli import main as autopar_main
from autopar.sections.pretrained import (EXPORT_MARKER, SAFETENSORS_INDEX, WeightsError, WeightSource,
                                                 expected_tensors, is_folder_export, load_pretrained, local_part,
                                                 persistent_buffers, write_folder)


class Small(nn.Module):
    """Two layers and a persistent buffer (saved) beside a non-persistent one (not saved)."""

    def __init__(self, width: int = 6):
        super().__init__()
        self.proj = nn.Linear(4, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("scale", torch.randn(width))
        self.register_buffer("cache", torch.zeros(3), persistent=False)


def small(seed: int, width: int = 6) -> Small:
    torch.manual_seed(seed)
    return Small(width)


def load_into(model: nn.Module, path, tied: list[list[str]] | None = None) -> int:
    held = list(model.named_parameters(remove_duplicate=False)) + persistent_buffers([model])
    return load_pretrained(path, expected_tensors(model), held, tied or [])


def tiny_llama(seed: int, tie: bool = True) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=64, max_position_embeddings=16, tie_word_embeddings=tie)
    return LlamaForCausalLM(config)


TIED = [["model.embed_tokens.weight", "lm_head.weight"]]


def assert_same_state(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name].to(state[name].dtype)) for name in state)


def test_safetensors_file_loads_every_parameter_and_persistent_buffer_cast_to_the_model_dtype(tmp_path):
    source = small(1)
    saved = {name: tensor.bfloat16() for name, tensor in source.state_dict().items()}
    assert "cache" not in saved  # non-persistent: never in a file, never asked for
    save_file(saved, tmp_path / "w.safetensors")
    target = small(2)
    assert load_into(target, tmp_path / "w.safetensors") == 5  # weight, bias, norm weight and bias, scale
    assert_same_state(target, saved)
    assert target.proj.weight.dtype == torch.float32


def test_torch_state_dict_file_and_bin_folders_load(tmp_path):
    source = small(1)
    torch.save(source.state_dict(), tmp_path / "state.pt")
    target = small(2)
    load_into(target, tmp_path / "state.pt")
    assert_same_state(target, source.state_dict())
    # A folder with pytorch_model.bin, and one sharded into two .bin files listed by their index.
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    single.mkdir(), sharded.mkdir()
    torch.save(source.state_dict(), single / "pytorch_model.bin")
    names = list(source.state_dict())
    weight_map = {}
    for index, part in enumerate((names[:2], names[2:])):
        file = f"pytorch_model-0000{index + 1}-of-00002.bin"
        torch.save({n: source.state_dict()[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for folder in (single, sharded):
        target = small(3)
        load_into(target, folder)
        assert_same_state(target, source.state_dict())


def test_sharded_hugging_face_folder_loads_a_tied_head_from_the_embedding(tmp_path):
    """save_pretrained with a small shard size writes several files and their index; a tied
    model's file holds the embedding alone, and lm_head (the same tensor) gets it."""
    source = tiny_llama(1)
    source.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / SAFETENSORS_INDEX).is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert "lm_head.weight" not in WeightSource(tmp_path / "hf").names()
    target = tiny_llama(2)
    assert not torch.equal(target.lm_head.weight, source.lm_head.weight)
    load_into(target, tmp_path / "hf", TIED)
    assert_same_state(target, source.state_dict())
    assert target.lm_head.weight is target.model.embed_tokens.weight


def test_mismatch_is_refused_listing_each_kind_before_any_weight_changes(tmp_path):
    source = small(1, width=6)
    state = dict(source.state_dict())
    del state["norm.bias"]  # missing
    state["extra.weight"] = torch.zeros(2)  # unexpected
    state["proj.weight"] = torch.zeros(5, 4)  # wrongly shaped (the model's is 6 x 4)
    save_file(state, tmp_path / "w.safetensors")
    target = small(2)
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    with pytest.raises(WeightsError) as error:
        load_into(target, tmp_path / "w.safetensors")
    message = str(error.value)
    assert "1 missing (in the model, not in the file): norm.bias" in message
    assert "1 unexpected (in the file, not in the model): extra.weight" in message
    assert "1 wrongly shaped: proj.weight (file [5, 4], model [6, 4])" in message
    assert "No weight was changed" in message and "Fix:" in message and "\n" not in message
    assert_same_state(target, before)


def test_mismatch_lists_the_first_few_names_and_counts_the_rest(tmp_path):
    save_file({f"layer{i}.weight": torch.zeros(1) for i in range(8)}, tmp_path / "w.safetensors")
    with pytest.raises(WeightsError, match=r"8 unexpected .*: layer0.weight, .*layer4.weight, \.\.\. 3 more"):
        load_into(small(2), tmp_path / "w.safetensors")


def test_missing_path_is_one_paragraph(tmp_path):
    with pytest.raises(WeightsError, match="no such file or folder. Fix:"):
        load_into(small(2), tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(WeightsError, match="holds none of model.safetensors"):
        load_into(small(2), tmp_path / "empty")


def test_autopar_run_refuses_a_missing_init_from_before_starting_ranks(tmp_path, capsys):
    assert autopar_main(["run", str(tmp_path), "--init-from", str(tmp_path / "nowhere")]) == 1
    assert "no such file or folder" in capsys.readouterr().err


@pytest.fixture
def fake_ranks():
    """Make `dist` a fake group of 4 ranks as rank r (call it again for another rank)."""
    def become(rank: int):
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    yield become
    if dist.is_initialized():
        dist.destroy_process_group()


PLACEMENTS = {
    "uneven rows over both axes": (Shard(0), Shard(0)),  # 7 rows over 4 ranks: 2, 2, 2, 1
    "rows by dp, columns by tp": (Shard(0), Shard(1)),
    "replicated over dp": (Replicate(), Shard(1)),
    "FSDP over TP's rows (strided)": (_StridedShard(0, split_factor=2), Shard(0)),
    "replicated": (Replicate(), Replicate()),
}


@pytest.mark.parametrize("placements", list(PLACEMENTS.values()), ids=list(PLACEMENTS))
def test_each_rank_reads_the_shard_distribute_tensor_gives_it(placements, fake_ranks, tmp_path):
    full = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5)
    save_file({"w": full}, tmp_path / "w.safetensors")
    source = WeightSource(tmp_path / "w.safetensors")
    for rank in range(4):
        mesh = fake_ranks(rank)
        target = distribute_tensor(torch.zeros_like(full), mesh, placements, src_data_rank=None)
        wanted = distribute_tensor(full, mesh, placements, src_data_rank=None).to_local()
        assert torch.equal(local_part(source, "w", target), wanted)
        load_pretrained(tmp_path / "w.safetensors", {"w": (7, 5)}, [("w", target)], [])
        assert torch.equal(target.to_local(), wanted)


def test_folder_export_is_a_path_without_suffix_or_a_folder(tmp_path):
    assert is_folder_export(tmp_path / "out") and is_folder_export(tmp_path)
    assert not is_folder_export(tmp_path / "model.safetensors") and not is_folder_export(tmp_path / "final.pt")


def test_hugging_face_export_loads_with_from_pretrained_and_drops_the_tied_head(tmp_path):
    trained = tiny_llama(3)
    state = {name: p.detach().clone() for name, p in trained.named_parameters(remove_duplicate=False)}
    assert "lm_head.weight" in state
    with torch.device("meta"):
        config_source = tiny_llama(0)  # only its config is read
    out = write_folder(state, tmp_path / "out_hf", TIED, config_source)
    assert sorted(p.name for p in out.iterdir()) == sorted([EXPORT_MARKER, "config.json", "generation_config.json",
                                                            "model.safetensors"])
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert type(loaded) is LlamaForCausalLM and loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert all(torch.equal(p, state[name]) for name, p in loaded.named_parameters())


def test_folder_export_replaces_its_own_folder_and_refuses_a_foreign_one(tmp_path):
    state = {name: t.clone() for name, t in small(1).state_dict().items()}
    out = write_folder(state, tmp_path / "out", [], Small())  # not a Hugging Face model: weights alone
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "model.safetensors"]
    state["scale"] += 1
    write_folder(state, out, [], None)
    assert torch.equal(load_file(out / "model.safetensors")["scale"], state["scale"])
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no staging or old folder left behind
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(WeightsError, match="holds files autopar did not write"):
        write_folder(state, foreign, [], None)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_an_export_folder_a_user_added_to_or_linked_is_never_replaced(tmp_path):
    state = {name: t.clone() for name, t in small(1).state_dict().items()}
    out = write_folder(state, tmp_path / "out", [], None)
    (out / "eval_notes.txt").write_text("mine")  # added after the export
    with pytest.raises(WeightsError, match="eval_notes.txt"):
        write_folder(state, out, [], None)
    assert (out / "eval_notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()
    link = tmp_path / "linked"
    link.symlink_to(tmp_path / "out", target_is_directory=True)
    with pytest.raises(WeightsError, match="symbolic link"):
        write_folder(state, link, [], None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["linked", "out"]
