"""Pipeline parallelism over mesh["pp"] with torch.distributed.pipelining: the model split into stages by layers,
each stage a PipelineStage, one call's datums run through a named schedule, the loss on the last stage.

Shapes: M micro-batches, N tokens per row (row_tokens), D hidden, L layers, S stages in all, V stages per rank.

Splitting. A schedule runs V stages per pp rank (V = 1 for gpipe and 1f1b; V = 2 for interleaved_1f1b and zbv), so
S = pp * V. layer_split(L, S) gives each stage a contiguous run of layers: L // S each, and the L % S layers left
over go one each to the middle stages first (1 .. S-2, in order), then to the first stage; the last stage never
gets one. The first stage also runs the embeddings and the last the final norm, lm_head and the loss, so they are
the ones that take fewer layers when the split is uneven (torchtitan's rule of thumb, without its per-module
weights). Stage s runs on pp rank stage_ranks(pp, S, style)[s]: "loop" (s % pp: gpipe, 1f1b, interleaved_1f1b) or
"v" (0, 1, .., pp-1, pp-1, .., 0: zbv, whose rank 0 holds both the first and the last stage).

A stage is the whole model built on the meta device, cut by models/common/pipeline.py pipeline_stage() (HF
state-dict keys kept, layers keep their numbers), then loaded by models.checkpoint.load_weights, which reads from the
safetensors files only the tensors the stage holds. Each is wrapped in a PipelineStage over mesh["pp"]'s group with
static shapes: every micro-batch is one packed row [1, N] (kernels.Packing: the datums back to back, attention
inside each, positions restarting at 0), padded at its end with a document of pad tokens (id 0) that no loss reads,
so stage s sends hidden states [1, N, D] to stage s + 1 and no shape inference runs.

A step (pipeline_step). The call's datums are packed greedily, in order, into rows of at most N tokens
(forward_backward.MicroBatcher, the engine's rule); when the schedule needs more micro-batches than that (1f1b: at
least pp; interleaved_1f1b: a multiple of its rounds), empty rows (pad only, loss 0 times one token's logprob:
gradients of exactly zero) are added at the end. The schedule's step() splits [M, N] token rows and the micro-batch
index along dim 0; a stage looks up its micro-batch's Packing by that index, and the last stage's loss_fn looks up
its datums: the engine's logprob head
(logprobs.token_logprobs, chunked, never [N, V] logits) on the final hidden states of the real tokens, then
losses.datum_loss of each datum, summed (forward_backward.micro_batch_loss): every built-in loss of losses.LOSS_FNS,
not only cross_entropy. Gradients are the engine's sums: the schedule runs with scale_grads=False (never divided by
M), and the call's gradients are multiplied by c = losses.batch_scale at the end, as forward_backward.LossCall does,
with the gradients of earlier calls set aside and added back. The loss, c * sum_i datum_loss_i, is broadcast from the
last stage to every pp rank; the last stage also returns each datum's logprobs and the call's metrics.

Tied embeddings (tie_word_embeddings): the first stage's embed_tokens.weight and the last stage's lm_head.weight are
two copies of one weight; after the backward their gradients are summed over the pp group (both copies then hold the
single model's gradient, so the same optimizer step keeps them equal).

Training mode is the caller's: set_trainable(model, "full") on each of pipe.models, or apply_stage_lora(pipe.models,
pipe.whole, cfg, seed), which gives the stages together the very adapter apply_lora draws on the whole model with
that seed (a stage keeps the whole model's parameter names, so a saved adapter or checkpoint also loads by name).

In the training engine (engine.py, parallelize.build_parallel_model): each stage is also sharded over the rest of
the mesh (FSDP, experts over ep, ring attention over cp) and loaded by parallelize.load_hf_weights; pipeline_of
builds the stages over them for a row size, and PipelineLossCall runs a call's share of datums as the engine's
LossCall does (data-parallel ranks agreeing on the row count, loss and metrics summed over them, logprobs and
metrics broadcast to every pp rank). Under context parallelism every row is laid out with the zigzag ContextLayout
(its length rounded up to a multiple of 2 cp, Pipeline.seq_tokens): stages send this rank's [1, N / cp, D] and the
last stage's loss is forward_backward.context_parallel_loss on the gathered logprobs. docs/pipeline.md.

Exactness (float32 on CPU): the loss and every gradient equal the single-process LossCall's over the same datums and
micro_batch_tokens = N up to float32 rounding (tests/services/trainer/parallel/test_parallel_pipeline.py states the
tolerances): the padded rows run matmuls of another shape, the tied gradient is summed in another order, and
micro-batch gradients accumulate in the schedule's order. Deterministic (batch-invariant) mode is not supported here.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from kernels import Packing
from models.checkpoint import build_on_meta, load_weights
from models.common.pipeline import pipeline_stage
from services.common.errors import InvalidArgument
from services.trainer.engine import losses
from services.trainer.engine.forward_backward import (
    Datum, LossRequest, MicroBatcher, context_parallel_loss, micro_batch_loss, micro_batch_metrics,
    summed_over_ranks,
)
from services.trainer.engine.logprobs import token_logprobs

PAD_TOKEN = 0


@dataclass(frozen=True)
class ScheduleSpec:
    class_name: str  # in torch.distributed.pipelining (imported on first use: it takes seconds, pulling in export)
    stages_per_rank: int  # V
    style: str  # stage placement: "loop" or "v"

    @property
    def schedule(self) -> type:
        import torch.distributed.pipelining as pipelining

        return getattr(pipelining, self.class_name)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", 1, "loop"),
    "1f1b": ScheduleSpec("Schedule1F1B", 1, "loop"),
    "interleaved_1f1b": ScheduleSpec("ScheduleInterleaved1F1B", 2, "loop"),
    "zbv": ScheduleSpec("ScheduleZBVZeroBubble", 2, "v"),
}


def schedule_spec(name: str, field_name: str = "pipeline.schedule") -> ScheduleSpec:
    spec = SCHEDULES.get(name)
    if spec is None:
        raise InvalidArgument(f"unknown pipeline schedule {name!r} (known: {', '.join(SCHEDULES)})", field=field_name)
    return spec


# -- splitting -------------------------------------------------------------------------------------------------------
def layer_split(num_layers: int, num_stages: int) -> list[list[int]]:
    """The layers of each stage, in stage order (see the module docstring for the rule)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"{num_stages} pipeline stages need 1 to {num_layers} (the model's layers)")
    base, extra = divmod(num_layers, num_stages)
    takers = [*range(1, num_stages - 1), 0][:extra]  # the middle stages first, then the first one
    sizes = [base + (s in takers) for s in range(num_stages)]
    starts = [sum(sizes[:s]) for s in range(num_stages)]
    return [list(range(start, start + n)) for start, n in zip(starts, sizes)]


def stage_ranks(pp: int, num_stages: int, style: str) -> list[int]:
    """The pp rank of each stage: "loop" s % pp; "v" down and back up (stages s and S-1-s on one rank)."""
    if style == "loop":
        return [s % pp for s in range(num_stages)]
    assert num_stages == 2 * pp, "the V placement holds two stages per rank"
    return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]


# -- building --------------------------------------------------------------------------------------------------------
class StageModule(nn.Module):
    """What a PipelineStage runs: a stage of the CausalLM (model) on a packed row; forward(inputs [1, N] ids or
    [1, N, D] hidden, mb_index [1]) -> [1, N, D] (the last stage's are final-normed). packings: the current call's
    Packing of each micro-batch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.packings: list = []  # kernels.Packing, or under context parallelism the row's ContextLayout

    def forward(self, inputs: torch.Tensor, mb_index: torch.Tensor) -> torch.Tensor:
        return self.model(inputs, packing=self.packings[int(mb_index)], return_hidden=True)  # a host tensor


@dataclass
class Pipeline:
    """This rank's stages of a pipeline: models[i] (a CausalLM stage, HF names) is run by stages[i]."""

    schedule: str
    row_tokens: int
    group: dist.ProcessGroup
    stages: list  # torch.distributed.pipelining.PipelineStage
    models: list[nn.Module]
    num_stages: int
    last_rank: int  # the global rank holding the last stage (in this rank's pp group)
    tie_word_embeddings: bool
    dtype: torch.dtype
    whole: nn.Module  # the whole model on the meta device (no memory): what the stages were cut from
    modules: list[StageModule] = field(repr=False, default_factory=list)
    tied_shape: tuple[int, ...] | None = None  # this rank's part of the tied gradient, sharded stages (None: whole)
    cp: object = None  # the stages' ContextParallel (parallel/context.py) under cp > 1, else None

    @property
    def seq_tokens(self) -> int:
        """A row's length as it runs: row_tokens, under context parallelism rounded up to a multiple of 2 cp."""
        return self.row_tokens if self.cp is None else self.row_tokens + -self.row_tokens % (2 * self.cp.size)

    @property
    def is_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def named_parameters(self):
        """(name, parameter) of every stage on this rank (names are the whole model's)."""
        for model in self.models:
            yield from model.named_parameters()


def split_model(model: nn.Module, pp_rank: int, pp: int, schedule: str) -> list[tuple[int, nn.Module]]:
    """(stage index, stage CausalLM) of this pp rank's stages, in stage order, cut from model (build it on the meta
    device: the stages are deep copies)."""
    spec = schedule_spec(schedule)
    num_stages = pp * spec.stages_per_rank
    ranks = stage_ranks(pp, num_stages, spec.style)
    split = layer_split(model.args.num_layers, num_stages)
    return [(s, pipeline_stage(model, split[s], first=s == 0, last=s == num_stages - 1))
            for s in range(num_stages) if ranks[s] == pp_rank]


def build_pipeline(model_dir: str | Path, pp_mesh, *, schedule: str, row_tokens: int,
                   dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> Pipeline:
    """This rank's stages of the model in model_dir for a pipeline over pp_mesh (the 1-D mesh["pp"]), with every
    micro-batch a row of row_tokens tokens. Each stage's weights are read from model_dir (its tensors only)."""
    device = torch.device(device)
    group = pp_mesh.get_group()
    meta = build_on_meta(model_dir)
    stages = [(index, load_weights(stage_model, model_dir, dtype=dtype, device=device).train())
              for index, stage_model in split_model(meta, dist.get_rank(group), dist.get_world_size(group), schedule)]
    return pipeline_of(stages, group, meta, schedule=schedule, row_tokens=row_tokens, dtype=dtype, device=device)


def pipeline_of(stages: list[tuple[int, nn.Module]], group: dist.ProcessGroup, whole: nn.Module, *, schedule: str,
                row_tokens: int, dtype: torch.dtype, device: torch.device,
                tied_shape: tuple[int, ...] | None = None, cp=None,
                modules: list[StageModule] | None = None) -> Pipeline:
    """A Pipeline over this rank's loaded stage models ((stage index, CausalLM stage), split_model's), for rows of
    row_tokens tokens: a PipelineStage each (no communication; the engine builds one per row size it is asked for).
    whole: the whole model on the meta device; tied_shape: this rank's part of the tied embeddings' gradient when
    the stages are sharded (see _sum_tied_gradients; None: the whole [V, D]); cp: the stages' ContextParallel
    under context parallelism (each stage then sends this rank's [1, seq_tokens / cp, D] of the row); modules: the
    StageModule of each stage when the caller keeps them (stage_modules: FSDP-sharded stages), else new ones."""
    from torch.distributed.pipelining import PipelineStage

    spec = schedule_spec(schedule)
    num_stages = dist.get_world_size(group) * spec.stages_per_rank
    last_rank = dist.get_global_rank(group, stage_ranks(dist.get_world_size(group), num_stages, spec.style)[-1])
    pipe = Pipeline(schedule, row_tokens, group, [], [], num_stages, last_rank, bool(whole.args.tie_word_embeddings),
                    dtype, whole, tied_shape=tied_shape, cp=cp)
    local = pipe.seq_tokens // (1 if cp is None else cp.size)
    hidden = torch.empty(1, local, whole.args.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    tokens = torch.empty(1, local, dtype=torch.int64, device="meta")
    for i, (index, stage_model) in enumerate(stages):
        module = StageModule(stage_model) if modules is None else modules[i]
        pipe.models.append(stage_model)
        pipe.modules.append(module)
        pipe.stages.append(PipelineStage(module, index, num_stages, device, output_args=hidden, group=group,
                                         input_args=tokens if index == 0 else hidden))
    return pipe


def stage_modules(stages: list[tuple[int, nn.Module]], fsdp_mesh, mp_policy) -> list[StageModule]:
    """A StageModule per FSDP-sharded stage model, itself made an FSDP module (fully_shard, holding no parameters of
    its own: its stage's units hold them all), so that torch.distributed.pipelining recognizes the stage as sharded:
    the schedule then keeps each micro-batch's gradients unreduced and the parameters gathered between micro-batches,
    reduce-scatters once per step after the last backward (REDUCE_GRAD), and its split backward (zbv: input, then
    weight gradients) finds the gathered parameters the forward used. Build them once per engine: a stage model has
    one FSDP parent."""
    from torch.distributed.fsdp import fully_shard

    out = []
    for _, stage_model in stages:
        module = StageModule(stage_model)
        fully_shard(module, mesh=fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=False)
        out.append(module)
    return out


def lora_skeleton(whole: nn.Module, cfg, adapter_name: str = "default") -> tuple[nn.Module, list[nn.Parameter]]:
    """(a deep copy of the whole meta model with the adapter added, the adapter's parameters in apply_lora's order):
    the whole adapter's names and shapes without memory (the targets checked as apply_lora checks them)."""
    import copy

    from models.lora import apply_lora

    skeleton = copy.deepcopy(whole)
    return skeleton, apply_lora(skeleton, cfg, adapter_name, seed=0)  # seed: the global RNG untouched


def apply_stage_lora(models: list[nn.Module], whole: nn.Module, cfg, seed: int, adapter_name: str = "default", *,
                     device: torch.device | str | None = None) -> list[nn.Parameter]:
    """models.lora.apply_lora on each stage model (this rank's pipe.models) with exactly the values
    apply_lora(whole model, cfg, seed=seed) gives, so a fresh adapter is the single-process engine's; returns the
    stages' adapter parameters. whole: the whole model on the meta device (pipe.whole; lora_skeleton checks the
    targets on it). Each stage takes the adapter non-strictly (it may lack some targeted modules); then the A
    matrices are drawn from one generator in apply_lora's drawing order (the order of the parameters it returns,
    each A by the init of models.lora_layers on its shape), and each stage keeps those it holds. B starts at zero,
    as apply_lora's. device: where the adapter tensors are made (apply_lora's; "cpu" on stages still on the meta
    device, whose values the engine copies in once the stages are sharded and materialized)."""
    from models.lora import apply_lora
    from models.lora_layers import _init_A

    skeleton, order = lora_skeleton(whole, cfg, adapter_name)
    names = {id(p): n for n, p in skeleton.named_parameters()}
    params = [p for m in models for p in apply_lora(m, cfg, adapter_name, seed=0, device=device, strict=False)]
    held = {n: p for m in models for n, p in m.named_parameters() if p.requires_grad}
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in order:
            if ".lora_A." in names[id(p)]:
                a = _init_A(*p.shape, cfg, generator)
                if names[id(p)] in held:
                    held[names[id(p)]].copy_(a)
    return params


# -- a step ----------------------------------------------------------------------------------------------------------
def min_microbatches(schedule: str, pp: int, count: int) -> int:
    """The fewest micro-batches >= count the schedule runs: 1f1b needs one per stage; interleaved_1f1b runs
    max(1, M // pp) rounds and needs M to be a multiple of them."""
    if schedule == "1f1b":
        return max(count, pp)
    if schedule == "interleaved_1f1b":
        while count % max(1, count // pp):
            count += 1
    return count


@dataclass
class PipelineResult:
    loss: float  # c * sum_i datum_loss_i over the call's datums, on every pp rank
    logprobs: list[torch.Tensor] | None  # per datum (detached; [T] or [T, K]), on the last stage's rank only
    metrics: dict[str, float] | None  # losses.batch_metrics, on the last stage's rank only


@dataclass
class _Call:
    datums: list[list[Datum]]  # per micro-batch (empty for a padding row)
    req: LossRequest
    device: torch.device
    model: nn.Module | None  # the last stage's CausalLM (None on a rank without it)
    layouts: list | None  # each row's ContextLayout under context parallelism (hidden states: this rank's tokens)
    totals: dict[int, torch.Tensor] = field(default_factory=dict)
    logprobs: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    inputs: dict[int, list[dict[str, torch.Tensor]]] = field(default_factory=dict)

    def loss_fn(self, hidden_1ND: torch.Tensor, mb_index: torch.Tensor) -> torch.Tensor:
        """The last stage's loss of one micro-batch: its datums' summed, unscaled losses."""
        i, datums = int(mb_index), self.datums[int(mb_index)]
        if not datums:  # a padding row: 0 times one token's logprob, a graph through the whole stage (lm_head
            # included) whose gradients are exactly zero: sharded stages' FSDP reduce-scatters the same gradients on
            # every data-parallel rank (forward_backward.run_padding_micro_batch's rule)
            first = hidden_1ND[0, :1]
            target = torch.full((1,), PAD_TOKEN, dtype=torch.int64, device=first.device)
            total = 0.0 * token_logprobs(self.model, first, target).sum()
        elif self.layouts is not None:  # every datum's whole logprobs (gathered over cp), as LossCall under cp
            total, self.logprobs[i], self.inputs[i] = context_parallel_loss(
                self.model, hidden_1ND[0], self.layouts[i], datums, self.req, device=self.device)
        else:
            n = sum(d.length for d in datums)
            total, self.logprobs[i], self.inputs[i] = micro_batch_loss(
                self.model, hidden_1ND[0, :n], datums, self.req, deterministic=False, device=self.device)
        self.totals[i] = total.detach()
        return total


def _micro_batches(datums: list[Datum], row_tokens: int) -> list[list[Datum]]:
    batcher, mbs = MicroBatcher(row_tokens), []
    for d in datums:
        mbs += batcher.add(d)
    return mbs + batcher.finish()


def _too_long(datums: list[Datum], row_tokens: int) -> InvalidArgument | None:
    """The refusal of the first datum longer than the pipeline's rows (None: every datum fits)."""
    for i, d in enumerate(datums):
        if d.length > row_tokens:
            return InvalidArgument(f"{d.length} tokens do not fit the pipeline's rows of {row_tokens} tokens",
                                   field=f"data[{i}]")
    return None


def pipeline_step(pipe: Pipeline, datums: list[Datum], req: LossRequest, *, backward: bool = True,
                  batch_scale: float | None = None, dp_group: dist.ProcessGroup | None = None) -> PipelineResult:
    """One Forward (backward=False) or ForwardBackward call over this rank's stages; every pp rank calls it with the
    same datums. With backward, the call's gradients (c times the summed datum losses') are added to the stages'
    parameters' .grad (the engine's accumulation until the optimizer step).

    Data parallel (stages sharded over the rest of the mesh, dp_group: this stage's data-parallel ranks): each dp
    rank passes its own share of the call's datums and batch_scale, the c over ALL of them (the engine's rule,
    forward_backward.py). Every forward / backward of a sharded stage is a collective of its shard group, so the dp
    ranks agree on the most rows any of them has (one all-reduce) and the others run empty rows; the loss and the
    metrics' sums are all-reduced over dp_group, so they are the whole call's; the logprobs are this rank's datums'."""
    pp = dist.get_world_size(pipe.group)
    mbs = _micro_batches(datums, pipe.row_tokens)
    rows, refusal = len(mbs), _too_long(datums, pipe.row_tokens)
    if dp_group is not None:  # agreed before anything runs, so that every dp rank refuses a call alike
        counts = torch.tensor([rows, len(datums), refusal is not None], dtype=torch.int64)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=dp_group)
        rows, most_datums = int(counts[0]), int(counts[1])  # a rank without datums runs empty rows only
        if most_datums == 0:
            raise InvalidArgument("at least one datum is required", field="data")
        if refusal is None and counts[2]:
            raise InvalidArgument(f"a datum of another data-parallel rank's share does not fit the pipeline's rows "
                                  f"of {pipe.row_tokens} tokens", field="data")
    if refusal is not None:
        raise refusal
    if not datums and dp_group is None:
        raise InvalidArgument("at least one datum is required", field="data")
    mbs += [[] for _ in range(min_microbatches(pipe.schedule, pp, rows) - len(mbs))]
    device = pipe.stages[0].device
    tokens_MN = torch.full((len(mbs), pipe.seq_tokens), PAD_TOKEN, dtype=torch.int64)
    packings = []
    for i, mb in enumerate(mbs):
        lengths = [d.length for d in mb]
        if mb:
            tokens_MN[i, :sum(lengths)] = torch.cat([d.tokens for d in mb])
        pad = pipe.seq_tokens - sum(lengths)
        packings.append(Packing.from_lengths(lengths + [pad] if pad else lengths, device))
    if pipe.cp is not None:  # each row laid out over the cp ranks: this rank's [M, N / cp] tokens
        packings = [pipe.cp.layout(packing=packing) for packing in packings]
        tokens_MN = torch.cat([layout.shard(tokens_MN[i:i + 1]) for i, layout in enumerate(packings)])
    for module in pipe.modules:
        module.packings = packings
    c = batch_scale
    if c is None:
        c = losses.batch_scale(req.loss_fn, req.config, [d.inputs for d in datums])
    if not math.isfinite(c):
        raise InvalidArgument(f"the batch factor of loss '{req.loss_fn}' is {c}", field="loss_fn_config")

    call = _Call(mbs, req, device, next((m for m, s in zip(pipe.models, pipe.stages) if s.is_last), None),
                 packings if pipe.cp is not None else None)
    params = [p for m in pipe.models for p in m.parameters() if p.requires_grad] if backward else []
    held = [p.grad for p in params]
    for p in params:
        p.grad = None
    spec = schedule_spec(pipe.schedule)
    stages = pipe.stages if spec.stages_per_rank > 1 else pipe.stages[0]
    schedule = spec.schedule(stages, n_microbatches=len(mbs), loss_fn=call.loss_fn, scale_grads=False)
    index_M = torch.arange(len(mbs))
    try:
        if backward:
            schedule.step(tokens_MN.to(device), mb_index=index_M, target=index_M)
            _sum_tied_gradients(pipe)
            with torch.no_grad():
                for p, h in zip(params, held):
                    if p.grad is not None and c != 1.0:
                        p.grad.mul_(c)
                    if h is not None:
                        p.grad = h if p.grad is None else h.add_(p.grad)
        else:
            with torch.no_grad():
                schedule.eval(tokens_MN.to(device), mb_index=index_M, target=index_M)
    except BaseException:
        for p, h in zip(params, held):
            p.grad = h
        raise
    finally:
        for module in pipe.modules:
            module.packings = []

    loss = torch.zeros((), dtype=torch.float64, device=device)
    logprobs = metrics = None
    if pipe.is_last:
        loss = c * torch.stack([call.totals[i].double() for i in range(len(mbs))]).sum()
        order = [i for i in range(len(mbs)) if mbs[i]]
        logprobs = [lp for i in order for lp in call.logprobs[i]]
        sums = micro_batch_metrics(req, logprobs, [x for i in order for x in call.inputs[i]])
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            sums = [summed_over_ranks(sums, dp_group, req.loss_fn, device)]
        metrics = {k: float(v) for k, v in losses.batch_metrics(req.loss_fn, c, sums).items()}
    dist.broadcast(loss, src=pipe.last_rank, group=pipe.group)
    return PipelineResult(float(loss), logprobs, metrics)  # float() syncs, once per call


class PipelineLossCall:
    """forward_backward.LossCall's interface (run_call drives it) for an engine over a pipeline: begin(), the
    rank's datums in order (collected), finish() runs pipeline_step over them (lock held around it) and gives every
    pp rank the last stage's logprobs and metrics (broadcast_object_list over the pp group, so every rank of the
    mesh returns what LossCall returns: its datums' logprobs, the whole call's metrics); abort() changes nothing
    (pipeline_step itself restores the earlier gradients when it fails). Deterministic mode is refused."""

    def __init__(self, pipe: Pipeline, req: LossRequest, *, backward: bool, deterministic: bool, lock,
                 dp_group: dist.ProcessGroup | None = None, batch_scale: float | None = None):
        if deterministic:
            raise InvalidArgument("deterministic (batch-invariant) mode is not available with pipeline parallelism "
                                  "(pp > 1): the pipeline runs packed rows of a fixed length", field="deterministic")
        self.pipe, self.req, self.backward, self.lock = pipe, req, backward, lock
        self.dp_group, self.batch_scale = dp_group, batch_scale
        self.datums: list[Datum] = []

    def begin(self) -> None:
        self.datums = []

    def add(self, datum: Datum) -> None:
        self.datums.append(datum)

    def finish(self) -> tuple[list[torch.Tensor], dict[str, float]]:
        with self.lock():
            result = pipeline_step(self.pipe, self.datums, self.req, backward=self.backward,
                                   batch_scale=self.batch_scale, dp_group=self.dp_group)
        payload = [(result.logprobs, result.metrics)]
        dist.broadcast_object_list(payload, src=self.pipe.last_rank, group=self.pipe.group,
                                  device=self.pipe.stages[0].device)
        logprobs, metrics = payload[0]
        return [lp.to(self.pipe.stages[0].device) for lp in logprobs], metrics

    def abort(self) -> None:
        self.datums = []


def _sum_tied_gradients(pipe: Pipeline) -> None:
    """Sum the gradients of the tied embeddings' two copies (first stage's embed_tokens, last stage's lm_head) over
    the pp group; every pp rank takes part (a rank holding neither adds zeros). Sharded stages (FSDP over the rest
    of the mesh) hold the same rows of either copy at the same data-parallel coordinate, so the local shards are
    summed (a rank holding neither copy adds zeros of pipe.tied_shape)."""
    if not pipe.tie_word_embeddings:
        return
    copies = [m.model.embed_tokens.weight for m in pipe.models if m.model.embed_tokens is not None]
    copies += [m.lm_head.weight for m in pipe.models if m.lm_head is not None]
    grads = [_local(p.grad) for p in copies if p.grad is not None]
    have = torch.tensor([len(grads)], dtype=torch.int64, device=pipe.stages[0].device)
    dist.all_reduce(have, group=pipe.group)
    if not int(have):  # .item() syncs: a frozen (LoRA) base has no tied gradient to sum
        return
    args = pipe.models[0].args
    shape = grads[0].shape if grads else pipe.tied_shape or (args.vocab_size, args.hidden_size)
    total = torch.zeros(shape, dtype=grads[0].dtype if grads else pipe.dtype, device=pipe.stages[0].device)
    for g in grads:
        total += g
    dist.all_reduce(total, group=pipe.group)
    for g in grads:
        g.copy_(total)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of t (a DTensor's local shard, sharing its storage), t itself otherwise."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t
