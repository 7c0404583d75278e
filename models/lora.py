"""LoRA for the trainer and the rollout, stored in PEFT's on-disk format.

Numerics follow peft's `lora.Linear` exactly (y = W x + b + B(A(dropout(x))) * alpha / r, A kaiming-uniform with
a=sqrt(5), B zeros, LoRA weights kept in float32 even on a bf16 base, as peft's autocast_adapter_dtype does), so an
adapter trained here gives the same logits when loaded with `peft.PeftModel.from_pretrained` and vice versa.

Several named adapters can live in one model (the rollout serves several deployments on one base); one or none is
active at a time, model-wide. A merged adapter is part of the base weights until unmerged, so while one is merged it
is the only adapter that may be active, and no other may be merged or added.

The base Parameters are kept by the wrapper under the same names (`q_proj.weight`, not peft's
`q_proj.base_layer.weight`), so base checkpoints, optimizers and tied weights are untouched by adding LoRA.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
# peft options that change the math; an adapter that sets any of them would load here but compute something else.
_UNSUPPORTED_IF_SET = (
    "use_rslora", "use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save",
    "layers_to_transform", "layer_replication", "target_parameters", "trainable_token_indices", "use_qalora",
    "use_bdlora", "alora_invocation_tokens", "exclude_modules", "arrow_config", "velora_config",
    "monteclora_config", "kasa_config",
)


@dataclass
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise ValueError(f"target_modules must be a non-empty tuple of module names, got {self.target_modules!r}")
        self.target_modules = tuple(self.target_modules)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class LoRALinear(nn.Module):
    """An nn.Linear's weight/bias plus any number of named low-rank adapters."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.lora_A = nn.ModuleDict()
        self.lora_B = nn.ModuleDict()
        self.lora_dropout = nn.ModuleDict()
        self.scaling: dict[str, float] = {}
        self.active_adapter: str | None = None
        self.merged_adapter: str | None = None

    def add_adapter(self, name: str, cfg: LoraConfig, generator: torch.Generator | None) -> list[nn.Parameter]:
        device = self.weight.device
        lora_A = nn.Linear(self.in_features, cfg.rank, bias=False, device=device, dtype=torch.float32)
        lora_B = nn.Linear(cfg.rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        # Initialise on the CPU so a seed gives the same adapter on every device.
        a_init = torch.empty(cfg.rank, self.in_features, dtype=torch.float32)
        nn.init.kaiming_uniform_(a_init, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            lora_A.weight.copy_(a_init)
            lora_B.weight.zero_()
        self.lora_A[name], self.lora_B[name] = lora_A, lora_B
        self.lora_dropout[name] = nn.Dropout(cfg.dropout) if cfg.dropout > 0 else nn.Identity()
        self.scaling[name] = cfg.scaling
        return [lora_A.weight, lora_B.weight]

    def delete_adapter(self, name: str) -> None:
        if self.merged_adapter == name:
            self.unmerge()
        for container in (self.lora_A, self.lora_B, self.lora_dropout):
            del container[name]
        del self.scaling[name]
        if self.active_adapter == name:
            self.active_adapter = None

    def delta_weight(self, name: str) -> torch.Tensor:
        return (self.lora_B[name].weight @ self.lora_A[name].weight) * self.scaling[name]

    @torch.no_grad()
    def merge(self, name: str) -> None:
        self.weight.data += self.delta_weight(name).to(self.weight.dtype)
        self.merged_adapter = name

    @torch.no_grad()
    def unmerge(self) -> None:
        self.weight.data -= self.delta_weight(self.merged_adapter).to(self.weight.dtype)
        self.merged_adapter = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = F.linear(x, self.weight, self.bias)
        name = self.active_adapter
        if name is None or name == self.merged_adapter or name not in self.lora_A:
            return result
        result_dtype = result.dtype
        lora_A = self.lora_A[name]
        x = x.to(lora_A.weight.dtype)
        result = result + self.lora_B[name](lora_A(self.lora_dropout[name](x))) * self.scaling[name]
        return result.to(result_dtype)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, adapters={list(self.lora_A)}, "
            f"active={self.active_adapter!r}, merged={self.merged_adapter!r}"
        )


def _lora_modules(model: nn.Module) -> list[tuple[str, LoRALinear]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LoRALinear)]


def adapter_names(model: nn.Module) -> list[str]:
    """Every adapter present in the model, in the order they were added."""
    names: dict[str, None] = {}
    for _, module in _lora_modules(model):
        names.update(dict.fromkeys(module.lora_A))
    return list(names)


def _merged_adapter(model: nn.Module) -> str | None:
    return next((m.merged_adapter for _, m in _lora_modules(model) if m.merged_adapter is not None), None)


def _require_adapter(model: nn.Module, name: str) -> None:
    if name not in adapter_names(model):
        raise ValueError(f"No LoRA adapter named {name!r}; loaded adapters: {adapter_names(model)}")


def _targetable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Linear layers LoRA may wrap. A Linear sharing its weight with an embedding (tied lm_head) is left out:
    merging into it would silently change the input embeddings too."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    inside_lora = tuple(f"{name}." for name, _ in _lora_modules(model))  # the adapters' own lora_A/lora_B
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, LoRALinear))
        and id(m.weight) not in embedding_weights
        and not (inside_lora and name.startswith(inside_lora))
    }


def _matches(module_name: str, target: str) -> bool:
    # peft's rule for a list of targets: the target is the full module name or a dotted suffix of it.
    return module_name == target or module_name.endswith("." + target)


def apply_lora(
    model: nn.Module, cfg: LoraConfig, adapter_name: str = "default", seed: int | None = None
) -> list[nn.Parameter]:
    """Add adapter `adapter_name` to every targeted Linear, freeze every non-LoRA parameter, make the new adapter
    the active one, and return its (trainable) parameters. Adapters added earlier keep their requires_grad."""
    if not adapter_name or "." in adapter_name:
        raise ValueError(f"adapter_name must be a non-empty string without dots, got {adapter_name!r}")
    if adapter_name in adapter_names(model):
        raise ValueError(f"A LoRA adapter named {adapter_name!r} already exists; remove_adapter it first")
    merged = _merged_adapter(model)
    if merged is not None:
        raise ValueError(f"Adapter {merged!r} is merged into the weights; unmerge_adapter it before adding another")
    linears = _targetable_linears(model)
    valid = sorted({name.rsplit(".", 1)[-1] for name in linears})
    unknown = [t for t in cfg.target_modules if not any(_matches(name, t) for name in linears)]
    if unknown:
        raise ValueError(f"Unknown LoRA target_modules {unknown}; valid module names are {valid}")
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    params: list[nn.Parameter] = []
    for name, module in linears.items():
        if not any(_matches(name, t) for t in cfg.target_modules):
            continue
        if isinstance(module, nn.Linear):
            parent_name, _, leaf = name.rpartition(".")
            module_lora = LoRALinear(module)
            setattr(model.get_submodule(parent_name), leaf, module_lora)
            module = module_lora
        params += module.add_adapter(adapter_name, cfg, generator)
    lora_ids = {id(p) for _, m in _lora_modules(model) for p in [*m.lora_A.parameters(), *m.lora_B.parameters()]}
    for p in model.parameters():
        if id(p) not in lora_ids:
            p.requires_grad_(False)
    set_active_adapter(model, adapter_name)
    return params


def set_active_adapter(model: nn.Module, name: str | None) -> None:
    """Make `name` the adapter every LoRA layer applies; None runs the base model only."""
    if name is not None:
        _require_adapter(model, name)
    merged = _merged_adapter(model)
    if merged is not None and name != merged:
        raise ValueError(f"Adapter {merged!r} is merged into the weights; unmerge_adapter it before switching")
    for _, module in _lora_modules(model):
        module.active_adapter = name


def remove_adapter(model: nn.Module, name: str) -> None:
    """Delete an adapter (unmerging it first if merged). A layer left with no adapter becomes a plain nn.Linear
    holding the same weight/bias Parameters."""
    _require_adapter(model, name)
    for module_name, module in _lora_modules(model):
        if name not in module.lora_A:
            continue
        module.delete_adapter(name)
        if len(module.lora_A) == 0:
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            linear.weight, linear.bias = module.weight, module.bias
            parent_name, _, leaf = module_name.rpartition(".")
            setattr(model.get_submodule(parent_name), leaf, linear)


def merge_adapter(model: nn.Module, name: str) -> None:
    """Fold W += B A * scaling into the base weights (faster serving of a single adapter) and make it active."""
    _require_adapter(model, name)
    merged = _merged_adapter(model)
    if merged is not None:
        raise ValueError(f"Adapter {merged!r} is already merged; unmerge_adapter it first")
    for _, module in _lora_modules(model):
        if name in module.lora_A:
            module.merge(name)
        module.active_adapter = name


def unmerge_adapter(model: nn.Module, name: str) -> None:
    """Subtract a merged adapter from the base weights again; it stays the active (now unmerged) adapter."""
    if _merged_adapter(model) != name:
        raise ValueError(f"Adapter {name!r} is not merged (merged: {_merged_adapter(model)!r})")
    for _, module in _lora_modules(model):
        if module.merged_adapter == name:
            module.unmerge()


def lora_state_dict(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's file key names (detached views, not copies)."""
    _require_adapter(model, adapter_name)
    state = {}
    for name, module in _lora_modules(model):
        if adapter_name in module.lora_A:
            state[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = module.lora_A[adapter_name].weight.detach()
            state[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = module.lora_B[adapter_name].weight.detach()
    return state


def _format_alpha(alpha: float) -> int | float:
    return int(alpha) if float(alpha).is_integer() else float(alpha)


def save_peft_adapter(
    model: nn.Module, cfg: LoraConfig, out_dir: str | Path, base_model_name_or_path: str, adapter_name: str = "default"
) -> None:
    """Write adapter_config.json + adapter_model.safetensors in the layout peft's save_pretrained produces."""
    state = lora_state_dict(model, adapter_name)
    ranks = {tuple(t.shape)[0] for k, t in state.items() if k.endswith(".lora_A.weight")}
    if ranks != {cfg.rank}:
        raise ValueError(f"cfg.rank={cfg.rank} does not match the rank(s) {sorted(ranks)} of adapter {adapter_name!r}")
    config = {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layer_replication": None,
        "layers_pattern": None,
        "layers_to_transform": None,
        "loftq_config": {},
        "lora_alpha": _format_alpha(cfg.alpha),
        "lora_dropout": cfg.dropout,
        "megatron_config": None,
        "megatron_core": "megatron.core",
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": cfg.rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": sorted(cfg.target_modules),
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tensors = {k: v.to("cpu").contiguous() for k, v in state.items()}
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def _read_peft_config(adapter_dir: Path) -> LoraConfig:
    config_path = adapter_dir / ADAPTER_CONFIG
    if not config_path.is_file():
        raise ValueError(f"No {ADAPTER_CONFIG} in adapter directory {str(adapter_dir)!r}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"Cannot read {config_path}: {e}") from None
    if not isinstance(raw, dict) or raw.get("peft_type") != "LORA":
        peft_type = raw.get("peft_type") if isinstance(raw, dict) else None
        raise ValueError(f"{config_path}: only peft_type 'LORA' adapters are supported, got {peft_type!r}")
    unsupported = [key for key in _UNSUPPORTED_IF_SET if raw.get(key)]
    if raw.get("bias", "none") != "none":
        unsupported.append(f"bias={raw['bias']!r}")
    if unsupported:
        raise ValueError(f"{config_path}: unsupported LoRA options are set: {', '.join(unsupported)}")
    targets = raw.get("target_modules")
    if isinstance(targets, str):
        raise ValueError(f"{config_path}: a regex target_modules ({targets!r}) is not supported; list the module names")
    try:
        return LoraConfig(
            rank=int(raw["r"]),
            alpha=float(raw["lora_alpha"]),
            dropout=float(raw.get("lora_dropout", 0.0)),
            target_modules=tuple(targets or ()),
        )
    except KeyError as e:
        raise ValueError(f"{config_path}: missing field {e.args[0]!r}") from None


def load_peft_adapter(model: nn.Module, adapter_dir: str | Path, adapter_name: str = "default") -> LoraConfig:
    """Add a peft-written LoRA adapter to the model under `adapter_name` and make it active. On any mismatch the
    model is left as it was and a ValueError says which keys or shapes are wrong."""
    adapter_dir = Path(adapter_dir)
    cfg = _read_peft_config(adapter_dir)
    weights_path = adapter_dir / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise ValueError(f"No {ADAPTER_WEIGHTS} in adapter directory {str(adapter_dir)!r}")
    try:
        tensors = load_file(str(weights_path))
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"Cannot read {weights_path}: {e}") from None
    previous_active = next((m.active_adapter for _, m in _lora_modules(model)), None)
    apply_lora(model, cfg, adapter_name, seed=0)  # the seed only keeps the global RNG untouched; weights follow
    try:
        _copy_adapter_tensors(model, adapter_name, tensors, weights_path)
    except ValueError:
        remove_adapter(model, adapter_name)
        set_active_adapter(model, previous_active)
        raise
    return cfg


def _copy_adapter_tensors(model: nn.Module, adapter_name: str, tensors: dict[str, torch.Tensor], path: Path) -> None:
    targets = lora_state_dict(model, adapter_name)
    missing, unexpected = sorted(targets.keys() - tensors.keys()), sorted(tensors.keys() - targets.keys())
    if missing or unexpected:
        raise ValueError(
            f"{path} does not fit this model: missing keys {missing[:20]}; unexpected keys {unexpected[:20]}"
        )
    bad = [
        f"{k}: file {tuple(tensors[k].shape)} vs model {tuple(v.shape)}"
        for k, v in targets.items()
        if tensors[k].shape != v.shape
    ]
    if bad:
        raise ValueError(f"{path} has shapes that do not fit this model: {'; '.join(bad[:20])}")
    with torch.no_grad():
        for key, param in targets.items():
            param.copy_(tensors[key])
