"""What a CreateSession request asks for: its LoRA settings with the proto's defaults, and, for a session started from a
saved state (or a state loaded into a session), whether the state fits. Every problem is INVALID_ARGUMENT naming the
request field."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from models.checkpoint import build_on_meta
from models.lora import DEFAULT_TARGETS, EXPERTS_TARGET, LoraConfig, check_targets
from services.common.errors import InvalidArgument
from services.trainer.engine.checkpoint import EngineCheckpoint
from trainyard.methods.lora import LORA_DEFAULTS

LORA_RANK, LORA_ALPHA = LORA_DEFAULTS.lora_rank, LORA_DEFAULTS.lora_alpha  # the platform's one LoRA default
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", EXPERTS_TARGET)
assert set(ATTN_TARGETS + MLP_TARGETS) == set(DEFAULT_TARGETS)
UNEMBED_TARGET = "lm_head"


@dataclass
class LoraSpec:
    """A request's LoRA settings; None = not set (the documented default applies)."""

    rank: int | None = None
    alpha: float | None = None
    target_modules: tuple[str, ...] = ()
    train_attn: bool | None = None
    train_mlp: bool | None = None
    train_unembed: bool | None = None


@dataclass
class CreateSpec:
    base_model: str = ""
    lora: LoraSpec | None = None  # None: the request had no lora message
    seed: int = 0
    full_parameter: bool = False
    from_state: str = ""
    with_optimizer: bool = False


def resolve_lora(spec: LoraSpec, model_path: str) -> LoraConfig:
    """The LoRA config of a request with the proto's defaults: rank 32, alpha 32, every attention and MLP projection
    the model has (explicit target_modules win over the train_* switches). Checked against the model's
    architecture on the meta device, so a bad request loads no weights."""
    rank = LORA_RANK if spec.rank is None else spec.rank
    if not 1 <= rank <= 1024:
        raise InvalidArgument(f"must be between 1 and 1024, got {rank}", field="lora.rank")
    alpha = LORA_ALPHA if spec.alpha is None else float(spec.alpha)
    if not (math.isfinite(alpha) and alpha > 0):
        raise InvalidArgument(f"must be > 0, got {alpha}", field="lora.alpha")
    meta = build_on_meta(model_path)
    if spec.target_modules:
        targets = tuple(spec.target_modules)
        malformed = [t for t in targets if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", t)]
        if malformed:
            raise InvalidArgument(f"not module names: {malformed}", field="lora.target_modules")
        try:
            check_targets(meta, targets)
        except ValueError as exc:
            raise InvalidArgument(str(exc), field="lora.target_modules") from None
        return LoraConfig(rank=rank, alpha=alpha, target_modules=targets)
    switches = (("train_attn", spec.train_attn, True, ATTN_TARGETS), ("train_mlp", spec.train_mlp, True, MLP_TARGETS),
                ("train_unembed", spec.train_unembed, False, (UNEMBED_TARGET,)))
    targets: list[str] = []
    for name, given, default, menu in switches:
        if not (default if given is None else given):
            continue
        present = []
        for t in menu:  # the menu names every family's layers; keep this model's
            try:
                check_targets(meta, (t,))
                present.append(t)
            except ValueError as exc:
                if t == UNEMBED_TARGET:  # e.g. tied to the input embeddings
                    raise InvalidArgument(str(exc), field=f"lora.{name}") from None
        if not present:
            raise InvalidArgument(f"this model has none of the layers it names ({', '.join(menu)})",
                                  field=f"lora.{name}")
        targets += present
    if not targets:
        raise InvalidArgument("nothing to train: train_attn, train_mlp and train_unembed are all false", field="lora")
    return LoraConfig(rank=rank, alpha=alpha, target_modules=tuple(targets))


def check_create_matches_state(spec: CreateSpec, saved: EngineCheckpoint, model_path: str) -> None:
    """CreateSession(from_state): base_model, full_parameter and lora come from the state; what the request sets
    must equal it."""
    if spec.base_model and spec.base_model != saved.base_model:
        raise InvalidArgument(f"the state is of base model '{saved.base_model}'; leave base_model unset or equal",
                              field="base_model")
    if spec.full_parameter and not saved.full_parameter:
        raise InvalidArgument("the state is of a LoRA session", field="full_parameter")
    if spec.lora is None:
        return
    if saved.full_parameter:
        raise InvalidArgument("the state is of a full-parameter session; leave lora unset", field="lora")
    given, have = spec.lora, saved.lora
    if given.rank is not None and given.rank != have.rank:
        raise InvalidArgument(f"the state's rank is {have.rank}, got {given.rank}", field="lora.rank")
    if given.alpha is not None and float(given.alpha) != have.alpha:
        raise InvalidArgument(f"the state's alpha is {have.alpha:g}, got {given.alpha:g}", field="lora.alpha")
    if given.target_modules or any(x is not None for x in (given.train_attn, given.train_mlp, given.train_unembed)):
        targets = resolve_lora(LoraSpec(target_modules=given.target_modules, train_attn=given.train_attn,
                                        train_mlp=given.train_mlp, train_unembed=given.train_unembed),
                               model_path).target_modules
        if set(targets) != set(have.target_modules):
            raise InvalidArgument(f"the state's target_modules are {list(have.target_modules)}, the request "
                                  f"selects {list(targets)}", field="lora.target_modules")


def state_mismatch(full_parameter: bool, base_model: str, lora: LoraConfig | None, saved: EngineCheckpoint) -> str:
    """Why a saved state cannot be loaded into a session of these settings ('' when it can)."""
    if saved.full_parameter != full_parameter:
        kinds = {True: "a full-parameter", False: "a LoRA"}
        return f"the state is of {kinds[saved.full_parameter]} session, this is {kinds[full_parameter]} one"
    if saved.base_model != base_model:
        return f"base_model: the state's is '{saved.base_model}', the session's '{base_model}'"
    if lora is not None:
        for key in ("rank", "alpha"):
            mine, theirs = getattr(lora, key), getattr(saved.lora, key)
            if mine != theirs:
                return f"lora.{key}: the state's is {theirs:g}, the session's {mine:g}"
        if set(saved.lora.target_modules) != set(lora.target_modules):
            return (f"lora.target_modules: the state's are {list(saved.lora.target_modules)}, the session's "
                    f"{list(lora.target_modules)}")
    return ""
