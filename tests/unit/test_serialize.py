"""autopar/serialize.py: the compact JSON the profile cache writes is the text `to_jsonable` gives,
for the profiles and plans autopar writes (dataclasses, enums, tuples, dicts keyed by strings)."""
from __future__ import annotations

import json
from enum import Enum

from autopar.model_profile import ModelProfile
from autopar.serialize import compact_json, to_jsonable
from tests.profiles import traced


def _old(obj) -> str:
    return json.dumps(to_jsonable(obj), separators=(",", ":"))


def test_a_profile_is_written_as_to_jsonable_writes_it_and_reads_back_whole():
    for profile in (traced("gpt.py", "bf16", 2), traced("llama_hf.py", "fp32", 1)):
        text = compact_json(profile)
        assert text == _old(profile)
        assert ModelProfile.from_json(text) == ModelProfile.from_json(_old(profile))


def test_a_plan_is_written_as_to_jsonable_writes_it():
    from autopar.config import PlanPins, SolverConfig
    from autopar.solver.planner import Planner
    from cost_models.step import TrainSpec
    from cost_models.topology import ClusterConfig, ClusterSpec

    cluster = ClusterSpec.from_config(ClusterConfig(name="t", gpu="A100-80GB", nodes=1, gpus_per_node=8))
    plan = Planner(traced("gpt.py", "bf16", 2), cluster, TrainSpec(global_batch_size=16), SolverConfig(),
                   PlanPins(tp=2)).run().plan
    assert compact_json(plan) == _old(plan)


class _Colour(Enum):
    RED = "red"


def test_keys_json_cannot_write_are_converted_as_to_jsonable_does():
    """A dict keyed by tuples or enums falls back to `to_jsonable`'s str(key)."""
    for value in ({(1, 2): "a"}, {_Colour.RED: [1.5, None, (True, "x")]}):
        assert compact_json(value) == _old(value)


def test_values_read_as_they_are_only_where_their_json_type_is_the_fields():
    """Fields whose JSON value already is the field's value are taken as read (the fast path for a
    profile's ops); any other value still goes through the checked conversion: an int for a float
    becomes a float, a boolean for a count or a fraction in a list of sizes is refused, naming it."""
    from dataclasses import dataclass, field

    import pytest

    from autopar.serialize import FieldError, from_jsonable

    @dataclass
    class Op:
        name: str
        flops: int
        share: float
        shapes: list[list[int]] = field(default_factory=list)

    read = from_jsonable(Op, {"name": "mm", "flops": 4, "share": 1, "shapes": [[2, 3], [3]]})
    assert read == Op("mm", 4, 1.0, [[2, 3], [3]]) and type(read.share) is float
    with pytest.raises(FieldError, match="flops"):
        from_jsonable(Op, {"name": "mm", "flops": True, "share": 0.5})
    with pytest.raises(FieldError, match=r"shapes\.0\.1"):
        from_jsonable(Op, {"name": "mm", "flops": 4, "share": 0.5, "shapes": [[2, 2.5]]})
