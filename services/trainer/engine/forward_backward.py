"""The engine's micro-batched forward / backward of datums under a built-in loss: one Training API Forward /
ForwardBackward call (checked datums in, per-datum logprobs, metrics and gradients out).

Shapes: T tokens of a datum, N tokens of a micro-batch (its datums back to back), K targets per position ([T, K]
targets), D hidden, V vocab, C tokens per logprob chunk.

Micro-batches: the call's datums, in order, are packed greedily into micro-batches of at most micro_batch_tokens
tokens (a datum longer than that is a micro-batch alone). The rule looks only at the datums' lengths, so a stream
that receives the same datums builds the same micro-batches, and it can close a micro-batch as soon as the next datum
does not fit (or the micro-batch is exactly full).

A micro-batch is one packed forward to the final hidden states (models' Packing: attention stays inside each datum,
positions restart at 0 in each; in deterministic mode right-padded rows instead, see _hidden_states), then the
logprobs of its targets (token_logprobs: never [N, V] logits), then each datum's losses.datum_loss summed in datum
order, then one backward. The call's loss is c * sum_i datum_loss_i with
c = losses.batch_scale over all the call's datums; c is known only when the last datum is in, so the micro-batches
backpropagate the unscaled sum and the call's gradients are multiplied by c at the end. Gradients of earlier calls
since the last OptimStep are set aside at the start and added back at the end (grads accumulate across calls until
OptimStep, as in Tinker), so a call that fails part-way restores them exactly and leaves no partial gradients.

Data parallel (an engine over a mesh, services/trainer/engine/parallel/): each data-parallel rank runs the call on
its own share of the datums (split_for_ranks: contiguous, in order) with the call's c over ALL the datums passed in
(batch_scale), and every rank applies that same c. Every forward / backward of the sharded model is a collective of
its shard group, so the ranks must run as many micro-batches each: a rank holds its micro-batches until finish(),
the ranks agree on the largest count (one all-reduce), and a rank with fewer runs padding micro-batches (one token,
0 * its logprob: gradients of exactly zero) after its own. FSDP sums the gradients over the ranks, so the call's
gradients are c * sum over all datums, as on one process; the metrics' sums are all-reduced, so every rank reports
the whole call's metrics; the logprobs are the rank's own datums'. (Streaming, one micro-batch as soon as it is
full, is the single-process behaviour; the held micro-batches are tokens only.)

Context parallel (cp > 1, parallel/context.py; LossCall's cp is the model's ContextParallel): the cp ranks of a
group get the same datums (split_for_ranks over dp only). A micro-batch's packed row of N tokens is padded to P, a
multiple of 2 cp, with a trailing padding document (IGNORE_INDEX targets: logprob 0, no gradient), laid out with
cp.layout(packing=...), and this rank's L = P / cp tokens go through the model and the logprob head. The whole
row's [N] logprobs are then gathered over the cp group, the rank's own positions keeping their graph
(context_parallel_loss), so every rank computes every datum's loss exactly as one process does and its
backward reaches the model through the rank's own tokens only; FSDP sums the weights' gradients over dp_shard_cp.
Every built-in loss works this way (gspo, nonlinear in the whole datum's logprobs, included); the logprobs returned
are the whole datums'. Padding micro-batches are 2 cp tokens. Deterministic mode is refused under cp.

Exactness (float32 on CPU with a fixed thread count): the result depends only on the datums, their order, the loss
and micro_batch_tokens, so the unary and the streamed call give bitwise the same gradients, logprobs and metrics.
With deterministic=True the forward and the logprobs run under kernels.batch_invariant and the logprobs are the
rollout's formula (log_softmax of the logits, gathered) on batch-invariant logits: each datum's logprobs are bitwise
those of services.trainer.engine.logprobs.target_logprobs(deterministic=True), and so of a deterministic rollout,
whatever micro-batch it shared (tested). Without it, logprobs agree with target_logprobs to float32 rounding (~1e-6).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels import Packing
from kernels.batch_invariant import batch_invariant_mode
from kernels.logprobs import IGNORE_INDEX
from services.common.errors import InvalidArgument
from services.trainer.engine import losses
from services.trainer.engine.logprobs import token_logprobs


@dataclass
class Datum:
    """One checked datum: its model input tokens and its loss inputs as losses.check_datum normalized them."""

    tokens: torch.Tensor  # int64 [T]
    inputs: dict[str, torch.Tensor]
    # Router replay (MoE): [T, L, K] expert ids of each position at each MoE layer (in layer order), e.g. the
    # rollout's router_ids; the forward routes the datum's tokens to exactly these experts (models.moe.RouterReplay).
    routes: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    @property
    def targets(self) -> torch.Tensor:
        return self.inputs["target_tokens"]


@dataclass(frozen=True)
class LossRequest:
    loss_fn: str
    config: dict[str, float]
    micro_batch_tokens: int


def check_loss_request(loss_fn: str, config, micro_batch_tokens: int, default_micro_batch_tokens: int,
                       prefix: str = "") -> LossRequest:
    """The call's loss settings, checked (prefix: "header." for a stream's header)."""
    loss_fn = loss_fn or losses.DEFAULT_LOSS
    try:
        resolved = losses.resolve_config(loss_fn, dict(config))
    except InvalidArgument as exc:
        raise _prefixed(exc, prefix) from None
    if micro_batch_tokens < 0:
        raise InvalidArgument(f"must be >= 0 (0 takes the trainer's default, {default_micro_batch_tokens}), got "
                              f"{micro_batch_tokens}", field=f"{prefix}micro_batch_tokens")
    return LossRequest(loss_fn, resolved, micro_batch_tokens or default_micro_batch_tokens)


def _prefixed(exc: InvalidArgument, prefix: str) -> InvalidArgument:
    if not prefix:
        return exc
    return InvalidArgument(violations=[type(v)(field=prefix + v.field, reason=v.reason, row=v.row)
                                       for v in exc.violations])


class MicroBatcher:
    """Greedy packing of datums, in order, into micro-batches of at most max_tokens tokens."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._open: list[Datum] = []
        self._tokens = 0

    def add(self, datum: Datum) -> list[list[Datum]]:
        """Micro-batches this datum completes (0, 1 or 2 of them), in order."""
        done = []
        if self._open and self._tokens + datum.length > self.max_tokens:
            done.append(self._close())
        self._open.append(datum)
        self._tokens += datum.length
        if self._tokens >= self.max_tokens:  # full: no later datum (>= 1 token) can join it
            done.append(self._close())
        return done

    def finish(self) -> list[list[Datum]]:
        return [self._close()] if self._open else []

    def _close(self) -> list[Datum]:
        mb, self._open, self._tokens = self._open, [], 0
        return mb


def _hidden_states(model: nn.Module, datums: list[Datum], *, deterministic: bool,
                   device: torch.device) -> torch.Tensor:
    """[N, D] final hidden states of the datums' tokens, back to back: one packed forward. In deterministic mode,
    one forward of the datums as right-padded rows instead: the batch-invariant attention sums over key blocks
    counted from a row's first key, which a datum packed after another does not start on, so packing would change
    its bits (padding never does: causal attention, and rows are independent under the mode)."""
    lengths = [d.length for d in datums]
    if not deterministic:
        tokens_1N = torch.cat([d.tokens for d in datums])[None].to(device)
        routing = _replay(model, [d.routes for d in datums], device)
        return model(tokens_1N, packing=Packing.from_lengths(lengths, device), return_hidden=True,
                     routing=routing)[0]
    tokens_BT = torch.zeros(len(datums), max(lengths), dtype=torch.int64)
    for b, d in enumerate(datums):
        tokens_BT[b, :d.length] = d.tokens
    routing = None
    if datums[0].routes is not None:  # right-padded like the tokens (the padding's routes are never used)
        routes = [F.pad(d.routes, (0, 0, 0, 0, 0, max(lengths) - d.length)) if d.routes is not None else None
                  for d in datums]
        routing = _replay(model, routes, device, rows=True)
    with batch_invariant_mode():  # the backward runs outside the mode, as torch computes it
        hidden_BTD = model(tokens_BT.to(device), return_hidden=True, routing=routing)
    return torch.cat([hidden_BTD[b, :n] for b, n in enumerate(lengths)])


def moe_layers(model: nn.Module) -> list[int]:
    """The decoder layer indices of the model's MoE layers, in order (router ids are stacked in this order)."""
    from models.moe import MoE

    return sorted(m.layer_idx for m in model.modules() if isinstance(m, MoE))


def _replay(model: nn.Module, routes: list[torch.Tensor | None], device: torch.device, rows: bool = False):
    """A RouterReplay of the datums' routes back to back ([1, N, L, K]; rows: one row each, [B, T, L, K]), None
    when no datum has routes. A micro-batch mixes no datum with routes and one without (InvalidArgument)."""
    if all(r is None for r in routes):
        return None
    if any(r is None for r in routes):
        raise InvalidArgument("router replay needs routes for every datum of a call, or for none", field="routes")
    from models.moe import RouterReplay

    stacked = torch.stack(routes) if rows else torch.cat(routes)[None]
    return RouterReplay.from_stacked(moe_layers(model), stacked.to(device))


@dataclass
class MicroBatchResult:
    logprobs: list[torch.Tensor]  # per datum, detached: [T] or [T, K]
    metric_sums: list[dict[str, torch.Tensor]]


def _context_parallel_hidden(model: nn.Module, cp, datums: list[Datum], *, device: torch.device):
    """(this rank's [L, D] final hidden states, the row's ContextLayout) of the micro-batch's packed row over a
    context-parallel model (module docstring): the row padded to P tokens (a multiple of 2 cp; a trailing padding
    document), laid out by cp.layout(packing=...), this rank's L = P / cp tokens run through the model."""
    from services.trainer.engine.parallel.context import padded_packing

    N = sum(d.length for d in datums)
    layout = cp.layout(packing=padded_packing([d.length for d in datums], cp, device))
    tokens_1P = F.pad(torch.cat([d.tokens for d in datums]), (0, layout.seq_len - N))[None].to(device)
    return model(layout.shard(tokens_1P), packing=layout, return_hidden=True)[0], layout


def context_parallel_loss(model: nn.Module, hidden_LD: torch.Tensor, layout, datums: list[Datum], req: LossRequest,
                          *, device: torch.device
                          ) -> tuple[torch.Tensor, list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """micro_batch_loss's result under context parallelism, from this rank's final hidden states [L, D] of the
    datums' packed row laid out by layout (its padding, if any, a trailing document): the local tokens' logprobs
    (the targets padded with IGNORE_INDEX: logprob 0, no gradient), the whole row's gathered over the cp group with
    the graph kept on this rank's own positions (context.with_local_graph), then every datum's loss as on one
    process. model holds lm_head (a whole model or a last pipeline stage)."""
    from services.trainer.engine.parallel.context import with_local_graph

    targets = _packed_targets(datums).to(device)
    N, P = targets.shape[0], layout.seq_len
    targets_P = torch.cat([targets, targets.new_full((P - N, *targets.shape[1:]), IGNORE_INDEX)])
    logprobs_L = token_logprobs(model, hidden_LD, layout.shard(targets_P, dim=0))
    logprobs = with_local_graph(layout.gather(logprobs_L.detach(), dim=0), logprobs_L, layout)[:N]
    return _datum_losses(logprobs, datums, req, device)


def run_micro_batch(model: nn.Module, datums: list[Datum], req: LossRequest, *, backward: bool,
                    deterministic: bool, device: torch.device, cp=None) -> MicroBatchResult:
    """One packed forward (+ backward of the summed, unscaled datum losses) over the datums; cp: the model's
    ContextParallel (context-parallel engine), None on one process or without cp."""
    with torch.set_grad_enabled(backward):
        if cp is None:
            hidden_ND = _hidden_states(model, datums, deterministic=deterministic, device=device)
            total, per_datum, inputs = micro_batch_loss(model, hidden_ND, datums, req, deterministic=deterministic,
                                                        device=device)
        else:
            hidden_LD, layout = _context_parallel_hidden(model, cp, datums, device=device)
            total, per_datum, inputs = context_parallel_loss(model, hidden_LD, layout, datums, req, device=device)
        if backward:
            total.backward()
        del total
    return MicroBatchResult(per_datum, micro_batch_metrics(req, per_datum, inputs))


def _packed_targets(datums: list[Datum]) -> torch.Tensor:
    """The datums' targets back to back: [N], or [N, K] when any datum has K targets per position (the narrower
    ones padded with IGNORE_INDEX)."""
    k_max = max((d.targets.shape[1] for d in datums if d.targets.dim() == 2), default=0)
    if k_max:  # [T] and [T, K] datums together: K-wide targets, the extra slots ignored
        return torch.cat([F.pad(d.targets if d.targets.dim() == 2 else d.targets[:, None],
                                (0, k_max - (d.targets.shape[1] if d.targets.dim() == 2 else 1)),
                                value=IGNORE_INDEX) for d in datums])
    return torch.cat([d.targets for d in datums])


def micro_batch_loss(model: nn.Module, hidden_ND: torch.Tensor, datums: list[Datum], req: LossRequest, *,
                     deterministic: bool, device: torch.device
                     ) -> tuple[torch.Tensor, list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """(the datums' summed, unscaled losses, each datum's detached logprobs, each datum's loss inputs on device)
    from the final hidden states [N, D] of the datums' tokens back to back: the logprob head (token_logprobs), then
    losses.datum_loss of each datum, summed in datum order. model holds lm_head (a whole model or a last pipeline
    stage)."""
    logprobs = token_logprobs(model, hidden_ND, _packed_targets(datums).to(device), deterministic=deterministic)
    return _datum_losses(logprobs, datums, req, device)


def _datum_losses(logprobs: torch.Tensor, datums: list[Datum], req: LossRequest, device: torch.device
                  ) -> tuple[torch.Tensor, list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """micro_batch_loss's result from the micro-batch's logprobs ([N] or [N, K], _packed_targets' layout)."""
    wide = logprobs.dim() == 2
    per_datum, total, inputs = [], None, []
    for d, lp in zip(datums, torch.split(logprobs, [d.length for d in datums])):
        if wide:
            lp = lp[:, :d.targets.shape[1]] if d.targets.dim() == 2 else lp[:, 0]
        inputs.append({k: v.to(device) for k, v in d.inputs.items()})
        loss = losses.datum_loss(req.loss_fn, req.config, lp, inputs[-1])[0]
        total = loss if total is None else total + loss
        per_datum.append(lp.detach())
    return total, per_datum, inputs


def micro_batch_metrics(req: LossRequest, per_datum: list[torch.Tensor],
                        inputs: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Each datum's metric sums, from its detached logprobs (micro_batch_loss). Computed once the backward has freed
    the graph, so the per-datum metric tensors never add to the call's peak memory (the same values: the same ops on
    the same inputs)."""
    with torch.no_grad():
        return [losses.datum_loss(req.loss_fn, req.config, lp, x)[1] for lp, x in zip(per_datum, inputs)]


def run_padding_micro_batch(model: nn.Module, *, backward: bool, device: torch.device, cp=None) -> None:
    """A micro-batch that changes nothing: a forward of one token (2 cp under context parallelism, cp's layout)
    and the backward of 0 * its logprob (gradients of exactly zero), run by a data-parallel rank that has fewer
    micro-batches than another (LossCall)."""
    tokens_1T = torch.zeros(1, 1 if cp is None else 2 * cp.size, dtype=torch.int64, device=device)
    with torch.set_grad_enabled(backward):
        if cp is None:
            hidden_LD = model(tokens_1T, return_hidden=True)[0]
        else:
            layout = cp.layout(tokens_1T.shape[1])
            tokens_1T = layout.shard(tokens_1T)
            hidden_LD = model(tokens_1T, packing=layout, return_hidden=True)[0]
        logprob = token_logprobs(model, hidden_LD, tokens_1T[0]).sum()
        if backward:
            (logprob * 0.0).backward()


class LossCall:
    """The computation of one call (driven by run_call): begin(), then checked datums in order (micro-batches run
    as they complete), then finish() for (per-datum logprobs, metrics). With backward, the call's gradients land on
    params at finish(); abort() puts back exactly the gradients held at begin()."""

    def __init__(self, model: nn.Module, params: list[nn.Parameter], req: LossRequest, *, backward: bool,
                 deterministic: bool, device: torch.device, lock, dp_group=None, batch_scale: float | None = None,
                 cp=None):
        if cp is not None and deterministic:
            raise InvalidArgument("deterministic (batch-invariant) mode is not available with context parallelism "
                                  "(cp > 1): the ring attention sums blocks in another order", field="deterministic")
        self.model, self.params, self.req = model, params, req
        self.backward, self.deterministic, self.device, self.lock = backward, deterministic, device, lock
        self.dp_group, self.batch_scale, self.cp = dp_group, batch_scale, cp
        self.queued: list[list[Datum]] = []  # data parallel: micro-batches held until finish()
        self.batcher = MicroBatcher(req.micro_batch_tokens)
        self.inputs: list[dict[str, torch.Tensor]] = []
        self.logprobs: list[torch.Tensor] = []
        self.metric_sums: list[dict[str, torch.Tensor]] = []
        self.held: list[torch.Tensor | None] = []

    def begin(self) -> None:
        """Set aside the gradients of earlier calls since the last OptimStep; this call's accumulate alone."""
        if self.backward:
            self.held = [p.grad for p in self.params]
            for p in self.params:
                p.grad = None

    def add(self, datum: Datum) -> None:
        self.inputs.append(datum.inputs)
        for mb in self.batcher.add(datum):
            if self.dp_group is None:
                self._run(mb)
            else:
                self.queued.append(mb)

    def finish(self) -> tuple[list[torch.Tensor], dict[str, float]]:
        if self.dp_group is not None:
            self._run_data_parallel()
        elif not self.inputs:
            raise InvalidArgument("at least one datum is required", field="data")
        for mb in self.batcher.finish():
            self._run(mb)
        c = self.batch_scale
        if c is None:
            c = losses.batch_scale(self.req.loss_fn, self.req.config, self.inputs)
        if not math.isfinite(c):
            raise InvalidArgument(f"the batch factor of loss '{self.req.loss_fn}' is {c}", field="loss_fn_config")
        metric_sums = (self.metric_sums if self.dp_group is None
                       else [summed_over_ranks(self.metric_sums, self.dp_group, self.req.loss_fn, self.device)])
        metrics = losses.batch_metrics(self.req.loss_fn, c, metric_sums)
        if self.backward:
            with torch.no_grad():
                for p, held in zip(self.params, self.held):
                    if p.grad is not None and c != 1.0:
                        p.grad.mul_(c)
                    if held is not None:
                        p.grad = held if p.grad is None else held.add_(p.grad)
            self.held = []
        return self.logprobs, {k: float(v) for k, v in metrics.items()}

    def abort(self) -> None:
        """Drop this call's gradients and restore the ones held before it."""
        if self.backward and self.held:
            for p, held in zip(self.params, self.held):
                p.grad = held
        self.held = []

    def _run(self, mb: list[Datum]) -> None:
        with self.lock():
            out = run_micro_batch(self.model, mb, self.req, backward=self.backward,
                                  deterministic=self.deterministic, device=self.device, cp=self.cp)
        self.logprobs.extend(out.logprobs)
        self.metric_sums.extend(out.metric_sums)

    def _run_data_parallel(self) -> None:
        """This rank's micro-batches, then padding ones up to the most any rank of the group runs: every forward
        and backward of a sharded model is a collective of its shard group, so every rank must run as many. The
        count is agreed before the first forward (one all-reduce). A rank may have no datum of the call (fewer
        datums than data-parallel ranks): it runs padding micro-batches only, and adds no logprobs and zero metric
        sums; a call with no datum on any rank is refused on every rank alike."""
        queued, self.queued = self.queued + self.batcher.finish(), []
        counts = torch.tensor([len(queued), len(self.inputs)], dtype=torch.int64, device=self.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=self.dp_group)
        most, most_datums = int(counts[0]), int(counts[1])  # .item() syncs, once per call
        if most_datums == 0:
            raise InvalidArgument("at least one datum is required", field="data")
        for mb in queued:
            self._run(mb)
        for _ in range(most - len(queued)):
            with self.lock():
                run_padding_micro_batch(self.model, backward=self.backward, device=self.device, cp=self.cp)


def summed_over_ranks(metric_sums: list[dict[str, torch.Tensor]], group, loss_fn: str,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """The metric sums of every rank's datums (float64; the loss's keys, losses.metric_keys): a rank without
    datums (metric_sums empty) adds zeros."""
    keys = losses.metric_keys(loss_fn)
    totals = torch.zeros(len(keys), dtype=torch.float64, device=device)
    if metric_sums:
        totals += torch.stack([torch.stack([s[k].double() for s in metric_sums]).sum() for k in keys])
    dist.all_reduce(totals, group=group)
    return dict(zip(keys, totals))


def split_for_ranks(items: list, ranks: int) -> list[list]:
    """items in `ranks` contiguous shares, in order, sizes differing by at most one (the first ones larger): the
    datums each data-parallel rank of an engine over a mesh receives (TrainingEngine.loss_call)."""
    size, extra = divmod(len(items), ranks)
    bounds = [r * size + min(r, extra) for r in range(ranks + 1)]
    return [items[bounds[r]:bounds[r + 1]] for r in range(ranks)]


def run_call(call: LossCall, datums: Iterable[Datum]) -> tuple[list[torch.Tensor], dict[str, float]]:
    """Feed every datum and finish; on any failure the gradients held before the call are restored."""
    try:
        call.begin()
        for d in datums:
            call.add(d)
        return call.finish()
    except BaseException:
        call.abort()
        raise
