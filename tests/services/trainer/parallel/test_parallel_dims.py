"""ParallelDims: degrees checked with errors naming the knob, and the named DeviceMesh built from them on a real
gloo group (tests/services/trainer/parallel/ranks.py)."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from services.common.errors import InvalidArgument
from services.trainer.engine.parallel import ParallelDims, build_mesh, from_mapping
from tests.services.trainer.parallel.ranks import RankFailed, run_ranks


def test_dp_shard_takes_what_the_other_degrees_leave():
    d = ParallelDims(pp=2, cp=2, world_size=8).resolved()
    assert (d.pp, d.dp_shard, d.cp, d.fsdp, d.dp) == (2, 2, 2, 4, 2)
    assert ParallelDims(world_size=1).resolved().describe() == "one rank"
    assert ParallelDims(dp_shard=2, ep=2, world_size=2).resolved().describe() == "dp_shard 2 x ep 2"


@pytest.mark.parametrize("kw, knob, words", [
    (dict(dp_shard=3, world_size=8), "dp_shard", "not the world size 8"),
    (dict(pp=3, world_size=8), "dp_shard", "does not divide the world size 8"),
    (dict(cp=0, world_size=8), "cp", "must be >= 1"),
    (dict(dp_shard=-2, world_size=8), "dp_shard", "or -1"),
    (dict(dp_shard=2, ep=4, world_size=2), "ep", "must divide dp_shard * cp = 2"),
    (dict(dp_shard=2, cp=2, ep=2, world_size=4), "ep", ""),  # fine: ep 2 = cp 2
    (dict(dp_shard=4, cp=2, ep=3, world_size=8), "ep", "must divide"),
    (dict(dp_shard=2, cp=4, ep=2, world_size=8), "ep", "multiple of cp 4"),
    (dict(world_size=0), "world_size", ">= 1"),
])
def test_bad_degrees_name_the_knob(kw, knob, words):
    dims = ParallelDims(field_prefix="parallel.", **kw)
    if not words:
        dims.resolved()
        return
    with pytest.raises(InvalidArgument) as exc:
        dims.resolved()
    assert exc.value.violations[0].field == f"parallel.{knob}" and words in str(exc.value)


def test_settings_mapping_refuses_unknown_dimensions():
    assert from_mapping({"dp_shard": 2, "pp": 2}, world_size=4).dp_shard == 2
    with pytest.raises(InvalidArgument) as exc:
        from_mapping({"fsdp": 2}, world_size=2, field_prefix="parallel.")
    assert exc.value.violations[0].field == "parallel.fsdp"


class _Args:
    architecture = "Qwen3MoeForCausalLM"
    num_heads = 4
    num_kv_heads = 2
    num_layers = 2

    def moe_args(self):
        return type("MoEArgs", (), {"num_experts": 6})()


@pytest.mark.parametrize("kw, knob", [
    (dict(dp_shard=4, ep=4, world_size=4), "ep"),
    (dict(dp_shard=1, tp=4, world_size=4), "tp"),
    (dict(dp_shard=1, pp=4, world_size=4), "pp"),
])
def test_the_model_must_split_evenly(kw, knob):
    with pytest.raises(InvalidArgument) as exc:
        ParallelDims(**kw).resolved().check_model(_Args())
    assert exc.value.violations[0].field == knob
    ParallelDims(dp_shard=2, ep=2, world_size=2).resolved().check_model(_Args())


def _mesh_groups(kw: dict) -> dict:
    dims = ParallelDims(world_size=dist.get_world_size(), **kw).resolved()
    mesh = build_mesh(dims)
    names = ["pp", "dp", "dp_shard_cp", "dp_cp", "cp"] + (["ep", "efsdp"] if dims.ep > 1 else [])
    return {n: sorted(dist.get_process_group_ranks(mesh[n].get_group())) for n in names}


def test_the_mesh_groups_the_ranks_as_documented():
    # 8 ranks, pp 2 x dp_shard 2 x cp 2, ep 4 = dp_shard_in_ep 2 x cp 2: ranks 0-3 are stage 0, 4-7 stage 1.
    groups = run_ranks(_mesh_groups, 8, dict(pp=2, cp=2, ep=4))
    assert groups[0] == {"pp": [0, 4], "dp": [0, 2], "dp_shard_cp": [0, 1, 2, 3], "dp_cp": [0, 1, 2, 3],
                         "cp": [0, 1], "ep": [0, 1, 2, 3], "efsdp": [0]}
    assert groups[5]["dp_shard_cp"] == [4, 5, 6, 7] and groups[5]["cp"] == [4, 5] and groups[5]["pp"] == [1, 5]


def _fails_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("rank one says no")
    dist.barrier()  # rank 0 would wait forever: the harness kills it
    return 0


def test_a_failing_rank_fails_the_group_with_its_traceback():
    with pytest.raises(RankFailed, match="rank one says no"):
        run_ranks(_fails_on_rank_one, 2, timeout_s=120)
