"""The Training API's built-in losses: config and input checks, per-datum losses, batch factor and metrics.

Shapes: T = a datum's model input tokens (position t predicts target_tokens[t]); K = candidate targets per position
([T, K] cross_entropy). lp = the model's logprob of the target (with grad), q = the sampling logprob
(loss_fn_inputs['logprobs']), A = advantages, m = mask (0/1, default all ones), r = exp(lp - q), G = datums in the
call, n_i = sum(m) of datum i, clip(x) = clamp(x, lo, hi) with lo = clip_low_threshold, hi = clip_high_threshold
(bounds on the ratio itself, as in Tinker, not offsets from 1). No temperature anywhere.

A call's loss is c * sum_i datum_loss_i: datum_loss depends on one datum alone and c (batch_scale) on the loss inputs
alone, never on logprobs, so the trainer can sum datum losses per micro-batch in datum order, backpropagate each, and
multiply the call's gradients by c at the end, and get the same numbers however the datums were split or streamed.

loss_fn              datum_loss_i                                    c                   defaults
cross_entropy        -sum_{t,k} w * lp                               1                   (weights: ones)
importance_sampling  -sum_t r * A                                    1
ppo                  -sum_t min(r * A, clip(r) * A)                  1                   lo 0.8, hi 1.2
cispo                -sum_t sg(clip(r)) * lp * A                     1                   lo 0.0, hi 4.0
dro                  -sum_t m * (lp * A - beta / 2 * (lp - q)^2)     1                   beta 0.05
gspo                 -(1/n_i) sum_t m * min(s_t * A, clip(s_t) * A)  1/G                 lo 1 - 3e-4, hi 1 + 4e-4
grpo                 -(1/n_i) sum_t m * min(r * A, clip(r) * A)      1/G                 lo 0.8, hi 1.2
dr_grpo              -sum_t m * min(r * A, clip(r) * A)              1/(G * max_tokens)  lo 0.8, hi 1.2, max_tokens 1024
dapo                 -sum_t m * min(r * A, clip(r) * A)              1/(sum_i n_i)       lo 0.8, hi 1.28

The first five are the Tinker API's definitions (plain sums; dro's beta has no documented default, 0.05 is the value
its docs use; its optional mask, ones by default, keeps the quadratic term off positions that are not the policy's,
such as an RL sample's prompt and observations, where A = 0 alone would not). gspo is GSPO's token-level form: s_t = sg(s) * exp(lp_t - sg(lp_t)) with the sequence ratio
s = exp((1/n_i) sum_t m * (lp - q)), so s_t's value is s and its gradient w.r.t. lp_t is s. A datum with n_i = 0
contributes 0 (and 1/n_i is taken as 1). The values and gradients are computed in float64 (they are O(T) elementwise
ops) so long sequences lose no precision in the sums; gradients flow back to the float32 logprobs.

Metrics ("name:sum" / "name:mean"): loss:sum = c * sum_i datum_loss_i; loss:mean = loss:sum / sum of weights for
cross_entropy, / the batch's loss tokens for the other Tinker losses, and = loss:sum where c already normalizes
(gspo, grpo, dr_grpo, dapo). The RL losses also report tokens:sum (loss tokens: T, or n_i where there is a mask) and,
over those tokens, ratio:mean (r, or s for gspo), kl_sample_train:mean (q - lp) and, where there is clipping,
clip_fraction:mean: tokens whose gradient the clip removes (clip(r) * A < r * A) for the min losses, tokens whose
coefficient is clamped (r outside [lo, hi]) for cispo.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from services.common.errors import InvalidArgument

DEFAULT_LOSS = "cross_entropy"
RL_INPUTS = ("target_tokens", "logprobs", "advantages")


@dataclass(frozen=True)
class LossSpec:
    name: str
    required_inputs: tuple[str, ...]
    optional_inputs: tuple[str, ...]
    config_defaults: dict[str, float]


def _clip(lo: float, hi: float) -> dict[str, float]:
    return {"clip_low_threshold": lo, "clip_high_threshold": hi}


LOSS_FNS: dict[str, LossSpec] = {s.name: s for s in (
    LossSpec("cross_entropy", ("target_tokens",), ("weights",), {}),
    LossSpec("importance_sampling", RL_INPUTS, (), {}),
    LossSpec("ppo", RL_INPUTS, (), _clip(0.8, 1.2)),
    LossSpec("cispo", RL_INPUTS, (), _clip(0.0, 4.0)),
    LossSpec("dro", RL_INPUTS, ("mask",), {"beta": 0.05}),
    LossSpec("gspo", RL_INPUTS, ("mask",), _clip(1 - 3e-4, 1 + 4e-4)),
    LossSpec("grpo", RL_INPUTS, ("mask",), _clip(0.8, 1.2)),
    LossSpec("dr_grpo", RL_INPUTS, ("mask",), {**_clip(0.8, 1.2), "max_tokens": 1024.0}),
    LossSpec("dapo", RL_INPUTS, ("mask",), _clip(0.8, 1.28)),
)}
# Losses whose batch factor already turns the sum into a mean (their loss:mean is loss:sum).
NORMALIZED = ("gspo", "grpo", "dr_grpo", "dapo")


def _spec(loss_fn: str) -> LossSpec:
    spec = LOSS_FNS.get(loss_fn)
    if spec is None:
        raise InvalidArgument(f"unknown loss {loss_fn!r}; available: {', '.join(LOSS_FNS)}", field="loss_fn")
    return spec


# -- config ----------------------------------------------------------------------------------------------------------
def resolve_config(loss_fn: str, config: Mapping[str, float]) -> dict[str, float]:
    """The loss's settings with defaults filled in; every rejected setting names its key."""
    spec = _spec(loss_fn)
    for key in sorted(config):
        if key not in spec.config_defaults:
            accepted = ", ".join(spec.config_defaults) or "none"
            raise InvalidArgument(f"not a setting of loss '{loss_fn}' (accepted: {accepted})",
                                  field=f"loss_fn_config['{key}']")
        if not math.isfinite(config[key]):
            raise InvalidArgument(f"must be finite, got {config[key]}", field=f"loss_fn_config['{key}']")
    cfg = {**spec.config_defaults, **{k: float(v) for k, v in config.items()}}
    checks = (("clip_low_threshold", lambda v: 0.0 <= v <= 1.0, "in [0, 1] (a bound on the ratio, not an offset)"),
              ("clip_high_threshold", lambda v: v >= 1.0, ">= 1 (a bound on the ratio, not an offset)"),
              ("beta", lambda v: v >= 0.0, ">= 0"),
              ("max_tokens", lambda v: v >= 1.0 and v == int(v), "a whole number >= 1"))
    for key, ok, rule in checks:
        if key in cfg and not ok(cfg[key]):
            raise InvalidArgument(f"must be {rule}, got {cfg[key]}", field=f"loss_fn_config['{key}']")
    return cfg


# -- inputs ----------------------------------------------------------------------------------------------------------
def check_datum(loss_fn: str, inputs: Mapping[str, torch.Tensor], length: int, vocab_size: int,
                where: str) -> dict[str, torch.Tensor]:
    """One datum's loss inputs, checked, with the optional ones filled in (weights: ones; mask: ones).

    target_tokens is int64 [T] (cross_entropy: [T] or [T, K]) with ids in [0, vocab_size); every other input is float32
    of target_tokens' shape ([T] unless cross_entropy's weights), finite; a mask holds only 0 and 1."""
    spec = _spec(loss_fn)
    accepted = spec.required_inputs + spec.optional_inputs

    def fail(key: str, reason: str):
        raise InvalidArgument(reason, field=f"{where}.loss_fn_inputs['{key}']")

    for key in spec.required_inputs:
        if key not in inputs:
            fail(key, f"required by loss '{loss_fn}' (it takes {', '.join(accepted)})")
    for key in sorted(inputs):
        if key not in accepted:
            fail(key, f"not an input of loss '{loss_fn}' (it takes {', '.join(accepted)})")

    targets = inputs["target_tokens"]
    shape = tuple(targets.shape)
    top_k = loss_fn == "cross_entropy" and len(shape) == 2 and shape[0] == length and shape[1] >= 1
    if targets.dtype != torch.int64:
        fail("target_tokens", f"must be int64, got {_dtype(targets)}")
    if shape != (length,) and not top_k:
        want = f"[{length}] or [{length}, K]" if loss_fn == "cross_entropy" else f"[{length}]"
        fail("target_tokens", f"must have shape {want} (one target per model input token), got {list(targets.shape)}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        fail("target_tokens", f"token ids must be in [0, {vocab_size})")

    out = {"target_tokens": targets}
    for key in accepted[1:]:
        x = inputs.get(key)
        if x is None:
            if key in spec.optional_inputs:
                out[key] = torch.ones(targets.shape, dtype=torch.float32, device=targets.device)
            continue
        if x.dtype != torch.float32:
            fail(key, f"must be float32, got {_dtype(x)}")
        if x.shape != targets.shape:
            fail(key, f"must have target_tokens' shape {list(targets.shape)}, got {list(x.shape)}")
        if not torch.isfinite(x).all():
            fail(key, "contains NaN or infinity")
        if key == "mask" and not ((x == 0) | (x == 1)).all():
            fail(key, "must hold only 0 and 1")
        out[key] = x
    return out


def _dtype(x: torch.Tensor) -> str:
    return str(x.dtype).removeprefix("torch.")


# -- per-datum losses ------------------------------------------------------------------------------------------------
def datum_loss(loss_fn: str, config: dict[str, float], logprobs: torch.Tensor,
               inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metric_sums) of one datum, before the batch factor c. loss is a float64 0-dim tensor with grad w.r.t.
    logprobs ([T], or [T, K] for cross_entropy); metric_sums are detached 0-dim sums over the datum, on logprobs'
    device. inputs (from check_datum) may stay on the CPU: they are copied to logprobs' device here."""
    _spec(loss_fn)
    loss, sums = _LOSSES[loss_fn](config, logprobs.double(), inputs)
    return loss, {k: v.detach() for k, v in {"loss": loss, **sums}.items()}


def _cross_entropy(cfg, lp, inputs):
    """-sum_{t,k} weights * lp. Weights are signed (weights = -dL/dlp makes this any loss L's linear surrogate)."""
    w = inputs["weights"].to(lp.device, torch.float64)
    return -(w * lp).sum(), {"weights": w.sum()}


def _rl(lp, inputs, mask: bool):
    q, adv = (inputs[k].to(lp.device, torch.float64) for k in ("logprobs", "advantages"))
    m = inputs["mask"].to(lp.device, torch.float64) if mask else torch.ones_like(lp)
    return q, adv, m, torch.exp(lp - q)


def _rl_sums(lp, q, m, ratio, clipped=None) -> dict[str, torch.Tensor]:
    sums = {"tokens": m.sum(), "ratio": (m * ratio).sum(), "kl_sample_train": (m * (q - lp)).sum()}
    if clipped is not None:
        sums["clip_fraction"] = (m * clipped).sum()
    return sums


def _min_objective(ratio, adv, lo: float, hi: float):
    """Per token min(ratio * A, clip(ratio) * A), and where the clipped branch is strictly smaller (its gradient is
    0 there). Written as a select on that mask: the same values as min, without relying on how min splits ties."""
    clipped = ((ratio > hi) & (adv > 0)) | ((ratio < lo) & (adv < 0))
    return torch.where(clipped, ratio.clamp(lo, hi) * adv, ratio * adv), clipped.double()


def _importance_sampling(cfg, lp, inputs):
    """-sum_t exp(lp - q) * A (Tinker's importance_sampling)."""
    q, adv, m, ratio = _rl(lp, inputs, mask=False)
    return -(ratio * adv).sum(), _rl_sums(lp, q, m, ratio)


def _ppo(cfg, lp, inputs):
    """-sum_t min(r * A, clamp(r, lo, hi) * A), r = exp(lp - q) (Tinker's ppo; lo 0.8, hi 1.2)."""
    q, adv, m, ratio = _rl(lp, inputs, mask=False)
    obj, clipped = _min_objective(ratio, adv, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -obj.sum(), _rl_sums(lp, q, m, ratio, clipped)


def _cispo(cfg, lp, inputs):
    """-sum_t sg(clamp(r, lo, hi)) * lp * A (Tinker's cispo; lo 0.0, hi 4.0: only large ratios are capped)."""
    q, adv, m, ratio = _rl(lp, inputs, mask=False)
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    coef = ratio.detach().clamp(lo, hi)
    clamped = ((ratio < lo) | (ratio > hi)).double()
    return -(coef * lp * adv).sum(), _rl_sums(lp, q, m, ratio, clamped)


def _dro(cfg, lp, inputs):
    """-sum_t m * (lp * A - beta / 2 * (lp - q)^2) (Tinker's dro; beta 0.05; mask ones by default)."""
    q, adv, m, ratio = _rl(lp, inputs, mask=True)
    return -(m * (lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2)).sum(), _rl_sums(lp, q, m, ratio)


def _gspo(cfg, lp, inputs):
    """GSPO-token (Zheng et al., 2025), per datum: -(1/n) sum_t m * min(s_t * A, clamp(s_t, lo, hi) * A), with
    s = exp((1/n) sum_t m * (lp - q)) and s_t = sg(s) * exp(lp_t - sg(lp_t)) (value s, d s_t / d lp_t = s);
    n = sum(m). With c = 1/G. For a constant advantage per datum, value and gradient are those of sequence-level GSPO
    -min(s * A, clamp(s, lo, hi) * A). Defaults are the paper's: lo = 1 - 3e-4, hi = 1 + 4e-4."""
    q, adv, m, ratio = _rl(lp, inputs, mask=True)
    n = m.sum().clamp(min=1.0)
    s = torch.exp((m * (lp - q)).sum() / n).detach()
    s_t = s * torch.exp(lp - lp.detach())
    obj, clipped = _min_objective(s_t, adv, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(m * obj).sum() / n, _rl_sums(lp, q, m, s.expand_as(lp), clipped)


def _grpo(cfg, lp, inputs):
    """GRPO, per datum: -(1/n) sum_t m * min(r * A, clamp(r, lo, hi) * A), n = sum(m); with c = 1/G (the mean over
    the group of per-sequence means). lo 0.8, hi 1.2."""
    loss, sums = _dapo(cfg, lp, inputs)
    return loss / sums["tokens"].clamp(min=1.0), sums


def _dr_grpo(cfg, lp, inputs):
    """Dr. GRPO, per datum: -sum_t m * min(r * A, clamp(r, lo, hi) * A), no length normalization; with
    c = 1/(G * max_tokens). lo 0.8, hi 1.2, max_tokens 1024."""
    return _dapo(cfg, lp, inputs)


def _dapo(cfg, lp, inputs):
    """DAPO, per datum: -sum_t m * min(r * A, clamp(r, lo, hi) * A) with clip-higher (lo 0.8, hi 1.28); with
    c = 1/sum(m over the batch) (token-level normalization)."""
    q, adv, m, ratio = _rl(lp, inputs, mask=True)
    obj, clipped = _min_objective(ratio, adv, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -(m * obj).sum(), _rl_sums(lp, q, m, ratio, clipped)


_LOSSES = {"cross_entropy": _cross_entropy, "importance_sampling": _importance_sampling, "ppo": _ppo,
           "cispo": _cispo, "dro": _dro, "gspo": _gspo, "grpo": _grpo, "dr_grpo": _dr_grpo, "dapo": _dapo}
assert _LOSSES.keys() == LOSS_FNS.keys()


# -- batch -----------------------------------------------------------------------------------------------------------
def batch_scale(loss_fn: str, config: dict[str, float], datums: list[dict[str, torch.Tensor]]) -> float:
    """c, from the loss inputs of all the call's datums (checked ones, from check_datum): see the module table."""
    _spec(loss_fn)
    if loss_fn in ("gspo", "grpo"):
        return 1.0 / len(datums)
    if loss_fn == "dr_grpo":
        return 1.0 / (len(datums) * config["max_tokens"])
    if loss_fn == "dapo":
        tokens = sum(float(d["mask"].double().sum()) for d in datums)  # .item() syncs (inputs normally on CPU)
        return 1.0 / max(tokens, 1.0)
    return 1.0


def metric_keys(loss_fn: str) -> list[str]:
    """The keys of datum_loss's metric sums for loss_fn (the same for every datum): what a data-parallel rank
    without datums contributes zeros for."""
    _spec(loss_fn)
    if loss_fn == "cross_entropy":
        return ["loss", "weights"]
    keys = ["loss", "tokens", "ratio", "kl_sample_train"]
    return keys if loss_fn in ("importance_sampling", "dro") else [*keys, "clip_fraction"]


def batch_metrics(loss_fn: str, scale: float, metric_sums: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """The call's metrics from its datums' metric sums (in datum order) and c."""
    _spec(loss_fn)
    totals = {k: float(torch.stack([s[k].double() for s in metric_sums]).sum())  # .item() syncs, once per metric
              for k in metric_sums[0]}
    loss = scale * totals["loss"]
    if loss_fn == "cross_entropy":
        return {"loss:sum": loss, "loss:mean": loss / totals["weights"] if totals["weights"] else 0.0}
    tokens = totals["tokens"]

    def mean(x: float) -> float:
        return x / tokens if tokens else 0.0

    out = {"loss:sum": loss, "loss:mean": loss if loss_fn in NORMALIZED else mean(loss), "tokens:sum": tokens,
           "ratio:mean": mean(totals["ratio"]), "kl_sample_train:mean": mean(totals["kl_sample_train"])}
    if "clip_fraction" in totals:
        out["clip_fraction:mean"] = mean(totals["clip_fraction"])
    return out
