"""The trainer's parallel layout: how many ways each dimension splits the work, checked, and the named DeviceMesh
built from it.

Dimensions (their product is the world size):
- dp_replicate: data-parallel replicas (HSDP's outer dimension: whole copies of the sharded model).
- dp_shard: FSDP's shard dimension: data parallel, parameters / gradients / optimizer state sharded. -1 takes what
  the other degrees leave of the world size.
- cp: context parallel: each rank holds a slice of every sequence (ring attention).
- tp: tensor parallel (optional): attention heads and MLP columns split.
- pp: pipeline parallel: each rank holds a run of the layers.
- pipeline_schedule (not a degree): the pipeline's schedule under pp > 1, by name (parallel/pipeline.py SCHEDULES:
  gpipe, 1f1b, interleaved_1f1b, zbv; 1f1b by default; the engine refuses zbv, see parallelize.py); the
  interleaved ones run two stages per rank.
- ep: expert parallel: each rank holds num_experts / ep experts. It does not add ranks: its group is carved out of
  dp_shard x cp (torchtitan's layout), so ep must divide dp_shard * cp and be a multiple of cp.

A dense 8B uses only dp_shard; a 1T MoE at 256K context uses pp, dp_shard, cp and ep together.

Mesh dimensions (DeviceMesh names, outermost first): pp, dp_replicate, dp_shard, cp, tp; with ep > 1 the shard
dimension is split in two, dp_shard_mod_ep (outer) x dp_shard_in_ep (inner), so that ep = dp_shard_in_ep * cp is a
contiguous block of ranks. Flattened dimensions for the collectives:
- dp (dp_replicate x dp_shard): ranks that see different data (batch split, loss sum);
- dp_shard_cp (dp_shard x cp): FSDP's shard group of the dense parameters (cp ranks hold the same weights);
- dp_cp (dp_replicate x dp_shard x cp): every rank that holds the same pipeline stage and tensor slice (loss
  all-reduce, gradient norm);
- ep (dp_shard_in_ep x cp): the expert-parallel group (token all_to_all), with ep > 1 only;
- efsdp (dp_shard_mod_ep): FSDP's shard group of the expert weights (already split over ep), with ep > 1 only.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from services.common.errors import InvalidArgument

KNOBS = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each parallel dimension; see the module docstring. `resolved(world_size)` checks them and fills
    dp_shard = -1; model-dependent checks (heads, experts, layers) are `check_model`."""

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pipeline_schedule: str = "1f1b"  # with pp > 1: the schedule's name (parallel/pipeline.py SCHEDULES)
    world_size: int = 1
    field_prefix: str = ""  # how errors name a knob (e.g. "parallel." in a setting, "--" on the command line)

    def _field(self, knob: str) -> str:
        return f"{self.field_prefix}{knob}"

    def resolved(self, world_size: int | None = None) -> ParallelDims:
        """These degrees for world_size ranks (default: self.world_size), checked, with dp_shard = -1 filled in.
        InvalidArgument names the knob that does not fit."""
        world = self.world_size if world_size is None else world_size
        if world < 1:
            raise InvalidArgument(f"must be >= 1, got {world}", field=self._field("world_size"))
        for knob in KNOBS:
            value = getattr(self, knob)
            if value < 1 and not (knob == "dp_shard" and value == -1):
                allowed = ">= 1 (or -1: what the other degrees leave)" if knob == "dp_shard" else ">= 1"
                raise InvalidArgument(f"must be {allowed}, got {value}", field=self._field(knob))
        others = self.dp_replicate * self.cp * self.tp * self.pp
        dp_shard = self.dp_shard
        if dp_shard == -1:
            if world % others:
                raise InvalidArgument(
                    f"dp_replicate * cp * tp * pp = {others} does not divide the world size {world}",
                    field=self._field("dp_shard"))
            dp_shard = world // others
        if others * dp_shard != world:
            raise InvalidArgument(
                f"dp_replicate {self.dp_replicate} * dp_shard {dp_shard} * cp {self.cp} * tp {self.tp} * pp "
                f"{self.pp} = {others * dp_shard}, not the world size {world}", field=self._field("dp_shard"))
        if self.ep > 1:
            if (dp_shard * self.cp) % self.ep:
                raise InvalidArgument(
                    f"ep {self.ep} must divide dp_shard * cp = {dp_shard * self.cp} (its ranks are carved out of "
                    "them)", field=self._field("ep"))
            if self.ep % self.cp:
                raise InvalidArgument(f"ep {self.ep} must be a multiple of cp {self.cp}", field=self._field("ep"))
        from services.trainer.engine.parallel.pipeline import schedule_spec

        schedule_spec(self.pipeline_schedule, self._field("pipeline_schedule"))  # a known name
        return replace(self, dp_shard=dp_shard, world_size=world)

    # -- derived degrees -------------------------------------------------------------------------------------------
    @property
    def dp(self) -> int:
        """Ranks that see different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_shard_in_ep(self) -> int:
        return self.ep // self.cp if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.dp_shard * self.cp // self.ep if self.ep > 1 else self.dp_shard

    @property
    def fsdp(self) -> int:
        """The dense parameters' shard count."""
        return self.dp_shard * self.cp

    @property
    def enabled(self) -> dict[str, bool]:
        return {"dp_replicate": self.dp_replicate > 1, "fsdp": self.dp_shard * self.cp > 1, "cp": self.cp > 1,
                "tp": self.tp > 1, "pp": self.pp > 1, "ep": self.ep > 1}

    def describe(self) -> str:
        return " x ".join(f"{k} {getattr(self, k)}" for k in KNOBS if getattr(self, k) > 1) or "one rank"

    # -- model checks ----------------------------------------------------------------------------------------------
    def check_model(self, args, *, pp_stages: int | None = None) -> None:
        """What the model's shape allows: experts divisible by ep, heads by tp, layers at least the pipeline's
        stage count (pp_stages: stages in all, pp * stages per rank for the interleaved schedules)."""
        num_experts = args.moe_args().num_experts if hasattr(args, "moe_args") else 0
        if self.ep > 1:
            if not num_experts:
                raise InvalidArgument(f"ep {self.ep} needs a mixture-of-experts model; {args.architecture} has no "
                                      "experts", field=self._field("ep"))
            if num_experts % self.ep:
                raise InvalidArgument(f"the model's {num_experts} experts do not split evenly over ep {self.ep}",
                                      field=self._field("ep"))
        if self.tp > 1:
            for name, what in (("num_heads", "attention heads"), ("num_kv_heads", "key/value heads")):
                heads = getattr(args, name, None)
                if heads and heads % self.tp:
                    raise InvalidArgument(f"the model's {heads} {what} do not split evenly over tp {self.tp}",
                                          field=self._field("tp"))
        stages = pp_stages or self.pp
        if stages > args.num_layers:
            raise InvalidArgument(f"{stages} pipeline stages need at least that many layers; the model has "
                                  f"{args.num_layers}", field=self._field("pp"))


def from_mapping(values: dict, *, world_size: int, field_prefix: str = "") -> ParallelDims:
    """ParallelDims from a settings mapping (unknown keys are refused by name), resolved for world_size."""
    known = {f.name for f in fields(ParallelDims)} - {"world_size", "field_prefix"}
    for key in values:
        if key not in known:
            raise InvalidArgument(f"unknown parallel dimension {key!r} (known: {', '.join(KNOBS)})",
                                  field=f"{field_prefix}{key}")
    return ParallelDims(**values, world_size=world_size, field_prefix=field_prefix).resolved()


def join_torchrun_group(timeout_s: float | None = None):
    """Join the default process group from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...):
    NCCL on this rank's GPU where there is CUDA, gloo on the CPU otherwise; this rank's device. timeout_s: how long
    a collective waits for a silent rank (torch's default when None)."""
    import os
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
    return device


def build_mesh(dims: ParallelDims, device_type: str = "cpu"):
    """The named DeviceMesh of resolved dims over the default process group (see the module docstring for the
    names). A dimension of degree 1 is kept (size 1), so code may always ask for mesh["dp_shard_cp"] etc."""
    from torch.distributed.device_mesh import init_device_mesh

    if dims.ep > 1:
        shape = (dims.pp, dims.dp_replicate, dims.dp_shard_mod_ep, dims.dp_shard_in_ep, dims.cp, dims.tp)
        names = ("pp", "dp_replicate", "dp_shard_mod_ep", "dp_shard_in_ep", "cp", "tp")
    else:
        shape = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
        names = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    shard = ("dp_shard_mod_ep", "dp_shard_in_ep") if dims.ep > 1 else ("dp_shard",)
    mesh[("dp_replicate", *shard)]._flatten("dp")
    mesh[(*shard, "cp")]._flatten("dp_shard_cp")
    mesh[("dp_replicate", *shard, "cp")]._flatten("dp_cp")
    if dims.ep > 1:  # with ep 1 the experts are dense parameters like any other (sharded over dp_shard_cp)
        mesh[("dp_shard_in_ep", "cp")]._flatten("ep")
        mesh[("dp_shard_mod_ep",)]._flatten("efsdp")
    return mesh
