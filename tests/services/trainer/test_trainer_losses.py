"""The built-in losses (services/trainer/engine/losses.py) against naive float64 references written out here as plain
loops.

Tolerance: values, gradients and metrics within 1e-6 (absolute, or relative for magnitudes above 1). The library is
run the way the trainer runs it: datum losses summed per micro-batch in datum order, each micro-batch backpropagated,
the gradients multiplied by the batch factor c at the end.
"""

import math

import pytest
import torch

from services.common.errors import InvalidArgument
from services.trainer.engine.losses import (LOSS_FNS, batch_metrics, batch_scale, check_datum, datum_loss,
                                     metric_keys, resolve_config)

V = 50
TOL = dict(rtol=1e-6, atol=1e-6)
MASKED = ("gspo", "grpo", "dr_grpo", "dapo")


# -- random inputs ---------------------------------------------------------------------------------------------------
def make_batch(loss_fn: str, seed: int, G: int = 5):
    """G datums of 4..12 tokens: (loss inputs, float32 logprobs). Log-ratios lp - q reach +-2 on every fifth token
    (so cispo's default cap of 4 is hit) and +-0.5 elsewhere; advantages of both signs. For gspo each datum gets a
    sequence log-ratio below, inside or above its narrow band (lo = 1 - 3e-4, hi = 1 + 4e-4)."""
    g = torch.Generator().manual_seed(seed)
    datums, lps = [], []
    for i in range(G):
        T = int(torch.randint(4, 13, (1,), generator=g))
        q = -3 * torch.rand(T, generator=g) - 0.05
        delta = torch.rand(T, generator=g) - 0.5
        delta[::5] *= 4
        if loss_fn == "gspo":
            delta = (-1e-3, 0.0, 1e-3, 1e-4, -2e-3)[i % 5] + 1e-4 * (torch.rand(T, generator=g) - 0.5)
        inputs = {"target_tokens": torch.randint(0, V, (T,), generator=g), "logprobs": q,
                  "advantages": torch.randn(T, generator=g)}
        if loss_fn in (*MASKED, "dro"):  # dro: its optional mask
            mask = (torch.rand(T, generator=g) < 0.7).float()
            mask[1] = 1.0
            inputs["mask"] = mask
        datums.append(inputs)
        lps.append((q + delta).float())
    return datums, lps


def run_library(loss_fn: str, config: dict, raw: list[dict], lps: list[torch.Tensor], splits=(2,)):
    """(c * sum of datum losses, gradients w.r.t. each datum's logprobs, metrics), computed in micro-batches."""
    cfg = resolve_config(loss_fn, config)
    datums = [check_datum(loss_fn, d, d["target_tokens"].shape[0], V, f"data[{i}]") for i, d in enumerate(raw)]
    leaves = [lp.clone().requires_grad_(True) for lp in lps]
    losses, sums = [], []
    bounds = [0, *[b for b in splits if 0 < b < len(datums)], len(datums)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        micro = []
        for d, lp in zip(datums[a:b], leaves[a:b]):
            loss, s = datum_loss(loss_fn, cfg, lp, d)
            assert loss.dim() == 0 and all(v.dim() == 0 and not v.requires_grad for v in s.values())
            micro.append(loss)
            sums.append(s)
        sum(micro).backward()
        losses += [x.detach() for x in micro]
    c = batch_scale(loss_fn, cfg, datums)
    grads = [lp.grad * c for lp in leaves]
    return c * float(sum(float(x) for x in losses)), grads, batch_metrics(loss_fn, c, sums)


# -- naive references ------------------------------------------------------------------------------------------------
def naive_rl(loss_fn: str, cfg: dict, raw: list[dict], lps: list[torch.Tensor]):
    """The whole-batch formula token by token: (loss, gradients, metrics)."""
    data = [{k: v.double().tolist() for k, v in d.items() if k != "target_tokens"} for d in raw]
    lps = [lp.double().tolist() for lp in lps]
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    G = len(data)
    masks = [d.get("mask", [1.0] * len(lp)) for d, lp in zip(data, lps)]
    batch_tokens = sum(sum(m) for m in masks)
    total, grads = 0.0, []
    n_tok = ratio_sum = kl_sum = clipped_sum = 0.0
    for d, lp, m in zip(data, lps, masks):
        q, A, T, n = d["logprobs"], d["advantages"], len(lp), sum(m)
        s = math.exp(sum(m[t] * (lp[t] - q[t]) for t in range(T)) / max(n, 1.0))
        grad = [0.0] * T
        for t in range(T):
            r = math.exp(lp[t] - q[t])
            clipped = 0.0
            if loss_fn == "importance_sampling":
                obj, dobj = r * A[t], r * A[t]
            elif loss_fn == "dro":
                obj = lp[t] * A[t] - 0.5 * cfg["beta"] * (lp[t] - q[t]) ** 2
                dobj = A[t] - cfg["beta"] * (lp[t] - q[t])
            elif loss_fn == "cispo":
                coef = min(max(r, lo), hi)
                obj, dobj, clipped = coef * lp[t] * A[t], coef * A[t], float(r < lo or r > hi)
            else:  # ppo and its masked variants; gspo uses the sequence ratio at every token
                x = s if loss_fn == "gspo" else r
                plain, clip = x * A[t], min(max(x, lo), hi) * A[t]
                obj, dobj, clipped = (clip, 0.0, 1.0) if clip < plain else (plain, x * A[t], 0.0)
            if loss_fn in ("gspo", "grpo"):
                weight = m[t] / (G * max(n, 1.0))
            elif loss_fn == "dr_grpo":
                weight = m[t] / (G * cfg["max_tokens"])
            elif loss_fn == "dapo":
                weight = m[t] / batch_tokens
            elif loss_fn == "dro":  # its optional mask keeps both terms off masked positions
                weight = m[t]
            else:
                weight = 1.0
            total -= weight * obj
            grad[t] = -weight * dobj
            n_tok += m[t]
            ratio_sum += m[t] * (s if loss_fn == "gspo" else r)
            kl_sum += m[t] * (q[t] - lp[t])
            clipped_sum += m[t] * clipped
        grads.append(torch.tensor(grad, dtype=torch.float64))
    metrics = {"loss:sum": total, "loss:mean": total if loss_fn in MASKED else total / n_tok, "tokens:sum": n_tok,
               "ratio:mean": ratio_sum / n_tok, "kl_sample_train:mean": kl_sum / n_tok}
    if loss_fn in ("ppo", "cispo", *MASKED):
        metrics["clip_fraction:mean"] = clipped_sum / n_tok
    return total, grads, metrics


def naive_cross_entropy(raw: list[dict], lps: list[torch.Tensor]):
    total, weight_sum, grads = 0.0, 0.0, []
    for d, lp in zip(raw, lps):
        w, x = d["weights"].double().reshape(-1).tolist(), lp.double().reshape(-1).tolist()
        total -= sum(wi * xi for wi, xi in zip(w, x))
        weight_sum += sum(w)
        grads.append(-torch.tensor(w, dtype=torch.float64).reshape(lp.shape))
    return total, grads, {"loss:sum": total, "loss:mean": total / weight_sum}


def assert_matches(got, want):
    (loss, grads, metrics), (ref_loss, ref_grads, ref_metrics) = got, want
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), ref, **TOL)
    assert metrics.keys() == ref_metrics.keys()
    for k in ref_metrics:
        assert metrics[k] == pytest.approx(ref_metrics[k], rel=1e-6, abs=1e-6), k


# -- values and gradients --------------------------------------------------------------------------------------------
CASES = [("importance_sampling", {}), ("ppo", {}), ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.3}),
         ("cispo", {}), ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}), ("dro", {}),
         ("dro", {"beta": 0.7}), ("gspo", {}), ("grpo", {}), ("dr_grpo", {}), ("dr_grpo", {"max_tokens": 16}),
         ("dapo", {})]


@pytest.mark.parametrize("loss_fn,config", CASES)
def test_rl_losses_match_the_naive_whole_batch_formula(loss_fn, config):
    for seed in (0, 1):
        raw, lps = make_batch(loss_fn, seed)
        assert_matches(run_library(loss_fn, config, raw, lps),
                       naive_rl(loss_fn, resolve_config(loss_fn, config), raw, lps))


@pytest.mark.parametrize("top_k", [None, 3])
def test_cross_entropy_matches_the_naive_sum_for_T_and_T_by_K_targets(top_k):
    g = torch.Generator().manual_seed(3)
    raw, lps = [], []
    for T in (5, 9, 3):
        shape = (T,) if top_k is None else (T, top_k)
        raw.append({"target_tokens": torch.randint(0, V, shape, generator=g),
                    "weights": torch.randn(shape, generator=g)})  # signed weights
        lps.append(-3 * torch.rand(shape, generator=g))
    assert_matches(run_library("cross_entropy", {}, raw, lps), naive_cross_entropy(raw, lps))


def test_cross_entropy_weights_default_to_ones():
    raw = [{"target_tokens": torch.tensor([[1, 2], [3, 4], [5, 6]])}]
    lps = [-torch.rand(3, 2)]
    loss, grads, metrics = run_library("cross_entropy", {}, raw, lps)
    assert loss == pytest.approx(-float(lps[0].double().sum()), abs=1e-12)
    assert torch.equal(grads[0], -torch.ones(3, 2))
    assert metrics["loss:mean"] == pytest.approx(loss / 6, abs=1e-12)


@pytest.mark.parametrize("loss_fn,config", [c for c in CASES if c[0] not in ("importance_sampling", "dro")])
def test_every_clipping_region_is_exercised(loss_fn, config):
    """Tokens (or, for gspo, sequences) with ratios below, inside and above [lo, hi], under both signs of advantage;
    and clip_fraction strictly between 0 and 1 (its value is checked against the reference above)."""
    cfg = resolve_config(loss_fn, config)
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    regions = set()
    for seed in (0, 1):
        raw, lps = make_batch(loss_fn, seed)
        for d, lp in zip(raw, lps):
            m = d.get("mask", torch.ones_like(lp)).bool()
            ratio = torch.exp(lp.double() - d["logprobs"].double())[m]
            if loss_fn == "gspo":
                ratio = torch.exp((lp.double() - d["logprobs"].double())[m].mean()).expand(int(m.sum()))
            for r, a in zip(ratio.tolist(), d["advantages"][m].tolist()):
                regions.add(("below" if r < lo else "above" if r > hi else "inside", a > 0))
        clip_fraction = run_library(loss_fn, config, raw, lps)[2]["clip_fraction:mean"]
        assert 0.0 < clip_fraction < 1.0
    wanted = {(where, sign) for where in ("below", "inside", "above") for sign in (True, False)}
    if lo == 0.0:  # cispo's default has no lower bound
        wanted -= {("below", True), ("below", False)}
    assert wanted <= regions


def test_gspo_token_form_has_the_sequence_level_gradient_for_a_constant_advantage():
    raw, lps = make_batch("gspo", seed=5)
    for d in raw:
        d["advantages"] = torch.full_like(d["advantages"], float(d["advantages"][0]))
    cfg = resolve_config("gspo", {})
    lo, hi = cfg["clip_low_threshold"], cfg["clip_high_threshold"]
    loss, grads, _ = run_library("gspo", {}, raw, lps)
    ref_loss, ref_grads = 0.0, []
    for d, lp in zip(raw, lps):  # -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean over masked tokens)
        x = lp.double().requires_grad_(True)
        m, A = d["mask"].double(), float(d["advantages"][0])
        s = torch.exp((m * (x - d["logprobs"].double())).sum() / m.sum())
        seq = -torch.minimum(s * A, s.clamp(lo, hi) * A) / len(raw)
        seq.backward()
        ref_loss += float(seq.detach())
        ref_grads.append(x.grad)
    assert loss == pytest.approx(ref_loss, abs=1e-9)
    for g, ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g.double(), ref, **TOL)


# -- batch factor and micro-batches ----------------------------------------------------------------------------------
def test_batch_scale_comes_from_the_inputs_alone():
    raw, _ = make_batch("dapo", seed=2, G=4)
    datums = [check_datum("dapo", d, len(d["advantages"]), V, f"data[{i}]") for i, d in enumerate(raw)]
    tokens = sum(float(d["mask"].sum()) for d in raw)
    assert batch_scale("dapo", resolve_config("dapo", {}), datums) == 1.0 / tokens
    assert batch_scale("grpo", resolve_config("grpo", {}), datums) == 1.0 / 4
    assert batch_scale("gspo", resolve_config("gspo", {}), datums) == 1.0 / 4
    assert batch_scale("dr_grpo", resolve_config("dr_grpo", {"max_tokens": 64}), datums) == 1.0 / (4 * 64)
    for name in ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro"):
        assert batch_scale(name, resolve_config(name, {}), datums) == 1.0


@pytest.mark.parametrize("loss_fn", ["grpo", "dapo", "ppo"])
def test_micro_batch_split_changes_nothing(loss_fn):
    raw, lps = make_batch(loss_fn, seed=4)
    whole = run_library(loss_fn, {}, raw, lps, splits=())
    for splits in [(1, 2, 3, 4), (3,)]:
        loss, grads, metrics = run_library(loss_fn, {}, raw, lps, splits=splits)
        assert loss == whole[0] and metrics == whole[2]
        assert all(torch.equal(a, b) for a, b in zip(grads, whole[1], strict=True))


def test_a_cross_entropy_surrogate_with_weights_minus_dL_dlogprobs_has_the_gradient_of_L():
    """forward_backward_custom's identity: for any L(logprobs), cross_entropy with weights = -dL/dlogprobs has
    gradient dL/dlogprobs. Checked for a nonlinear custom loss and for the whole grpo batch loss."""
    raw, lps = make_batch("grpo", seed=6)
    leaves = [lp.clone().requires_grad_(True) for lp in lps]
    custom = sum((x ** 2).sum() * 0.3 + torch.logsumexp(x, 0) for x in leaves)
    for L_grads in (torch.autograd.grad(custom, leaves), run_library("grpo", {}, raw, lps)[1]):
        surrogate = [{"target_tokens": d["target_tokens"], "weights": (-g).float()} for d, g in zip(raw, L_grads)]
        _, grads, _ = run_library("cross_entropy", {}, surrogate, lps)
        for g, ref in zip(grads, L_grads, strict=True):
            torch.testing.assert_close(g, ref.float(), **TOL)


# -- specs and validation --------------------------------------------------------------------------------------------
def test_specs_and_defaults():
    assert list(LOSS_FNS) == ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "grpo",
                              "dr_grpo", "dapo"]
    assert LOSS_FNS["cross_entropy"].required_inputs == ("target_tokens",)
    assert LOSS_FNS["cross_entropy"].optional_inputs == ("weights",)
    for name in ("gspo", "grpo", "dr_grpo", "dapo"):
        assert LOSS_FNS[name].optional_inputs == ("mask",)
    assert resolve_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_config("dro", {"beta": 0.2}) == {"beta": 0.2}
    assert resolve_config("dapo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}
    assert resolve_config("gspo", {}) == {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}
    assert resolve_config("dr_grpo", {})["max_tokens"] == 1024
    assert resolve_config("importance_sampling", {}) == {} == resolve_config("cross_entropy", {})


@pytest.mark.parametrize("loss_fn,config,field", [
    ("mse", {}, "loss_fn"),
    ("cross_entropy", {"clip_low_threshold": 0.8}, "loss_fn_config['clip_low_threshold']"),
    ("ppo", {"beta": 0.1}, "loss_fn_config['beta']"),
    ("ppo", {"clip_low_threshold": 1.3}, "loss_fn_config['clip_low_threshold']"),
    ("ppo", {"clip_high_threshold": 0.9}, "loss_fn_config['clip_high_threshold']"),
    ("ppo", {"clip_low_threshold": -0.1}, "loss_fn_config['clip_low_threshold']"),
    ("dapo", {"clip_high_threshold": 0.28}, "loss_fn_config['clip_high_threshold']"),
    ("ppo", {"clip_high_threshold": math.inf}, "loss_fn_config['clip_high_threshold']"),
    ("dro", {"beta": -0.1}, "loss_fn_config['beta']"),
    ("dro", {"beta": math.nan}, "loss_fn_config['beta']"),
    ("dr_grpo", {"max_tokens": 0.0}, "loss_fn_config['max_tokens']"),
    ("dr_grpo", {"max_tokens": 10.5}, "loss_fn_config['max_tokens']"),
])
def test_bad_config_names_its_field(loss_fn, config, field):
    with pytest.raises(InvalidArgument) as exc:
        resolve_config(loss_fn, config)
    assert [v.field for v in exc.value.violations] == [field]
    if field == "loss_fn":
        assert all(name in exc.value.message for name in LOSS_FNS)


T = 6


def rl_inputs(**change):
    inputs = {"target_tokens": torch.arange(T), "logprobs": -torch.rand(T), "advantages": torch.randn(T)}
    inputs.update(change)
    return {k: v for k, v in inputs.items() if v is not None}


def nan_at(x: torch.Tensor, value: float) -> torch.Tensor:
    x = x.clone()
    x[2] = value
    return x


@pytest.mark.parametrize("loss_fn,inputs,key", [
    ("ppo", rl_inputs(advantages=None), "advantages"),
    ("ppo", rl_inputs(target_tokens=None), "target_tokens"),
    ("ppo", rl_inputs(weights=torch.ones(T)), "weights"),
    ("ppo", rl_inputs(mask=torch.ones(T)), "mask"),
    ("ppo", rl_inputs(target_tokens=torch.arange(T).float()), "target_tokens"),
    ("ppo", rl_inputs(target_tokens=torch.arange(T + 1)), "target_tokens"),
    ("ppo", rl_inputs(target_tokens=torch.zeros(T, 2, dtype=torch.int64)), "target_tokens"),
    ("ppo", rl_inputs(target_tokens=torch.full((T,), V)), "target_tokens"),
    ("ppo", rl_inputs(target_tokens=torch.full((T,), -1)), "target_tokens"),
    ("ppo", rl_inputs(logprobs=-torch.rand(T, dtype=torch.float64)), "logprobs"),
    ("ppo", rl_inputs(advantages=torch.randn(T - 1)), "advantages"),
    ("ppo", rl_inputs(advantages=nan_at(torch.randn(T), math.nan)), "advantages"),
    ("dro", rl_inputs(logprobs=nan_at(-torch.rand(T), -math.inf)), "logprobs"),
    ("grpo", rl_inputs(mask=nan_at(torch.ones(T), 0.5)), "mask"),
    ("grpo", rl_inputs(mask=torch.ones(T, 1)), "mask"),
    ("cross_entropy", {"target_tokens": torch.arange(T), "logprobs": -torch.rand(T)}, "logprobs"),
    ("cross_entropy", {"target_tokens": torch.zeros(T, 3, dtype=torch.int64), "weights": torch.ones(T)}, "weights"),
    ("cross_entropy", {"target_tokens": torch.zeros(T, 0, dtype=torch.int64)}, "target_tokens"),
    ("cross_entropy", {"target_tokens": torch.arange(T), "weights": nan_at(torch.ones(T), math.inf)}, "weights"),
])
def test_bad_inputs_name_their_field(loss_fn, inputs, key):
    with pytest.raises(InvalidArgument) as exc:
        check_datum(loss_fn, inputs, T, V, "data[3]")
    assert [v.field for v in exc.value.violations] == [f"data[3].loss_fn_inputs['{key}']"]


def test_unknown_loss_in_check_datum_names_loss_fn():
    with pytest.raises(InvalidArgument) as exc:
        check_datum("sft", rl_inputs(), T, V, "data[0]")
    assert exc.value.violations[0].field == "loss_fn"


def test_check_datum_fills_defaults_and_keeps_given_inputs():
    inputs = rl_inputs()
    out = check_datum("grpo", inputs, T, V, "data[0]")
    assert out.keys() == {"target_tokens", "logprobs", "advantages", "mask"}
    assert torch.equal(out["mask"], torch.ones(T)) and out["mask"].dtype == torch.float32
    assert all(out[k] is inputs[k] for k in inputs)
    assert check_datum("ppo", inputs, T, V, "data[0]").keys() == inputs.keys()
    ce = check_datum("cross_entropy", {"target_tokens": torch.zeros(T, 4, dtype=torch.int64)}, T, V, "data[0]")
    assert torch.equal(ce["weights"], torch.ones(T, 4))


@pytest.mark.parametrize("loss_fn", sorted(LOSS_FNS))
def test_metric_keys_are_the_datum_losses(loss_fn):
    """metric_keys (what a data-parallel rank without datums adds zeros for) names exactly datum_loss's sums."""
    raw, lps = make_batch(loss_fn, seed=0, G=1)
    if loss_fn == "cross_entropy":
        raw = [{"target_tokens": raw[0]["target_tokens"]}]
    datum = check_datum(loss_fn, raw[0], lps[0].shape[0], V, "data[0]")
    _, sums = datum_loss(loss_fn, resolve_config(loss_fn, {}), lps[0], datum)
    assert sorted(sums) == sorted(metric_keys(loss_fn))
