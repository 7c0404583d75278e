"""LoRA for the trainer and the rollout, stored in PEFT's on-disk format (docs/lora.md).

Numerics follow peft's `lora.Linear` exactly (y = W x + b + B(A(dropout(x))) * alpha / r, A kaiming-uniform with
a=sqrt(5) or gaussian std 1/r, B zeros, LoRA weights kept in float32 even on a bf16 base, as peft's
autocast_adapter_dtype does), so an adapter trained here gives the same logits when loaded with
`peft.PeftModel.from_pretrained` and vice versa.

Routed experts (models.moe.Experts, fused [E, F, D] tensors) take a per-expert adapter on each fused tensor:
W_e + scaling * B_e A_e, with A [E, r, D] and B [E, F, r] computed as two grouped GEMMs next to the base one
(ExpertsLoRA). Its tensors are stored in peft's `target_parameters` (lora.ParamWrapper) layout, so the same file
loads in peft on transformers' MoE models.

Several named adapters can live in one model (the rollout serves several deployments on one base); one or none is
active at a time, model-wide. A merged adapter is part of the base weights until unmerged, so while one is merged it
is the only adapter that may be active, and no other may be merged or added.

The base Parameters are kept under the same names (`q_proj.weight`, not peft's `q_proj.base_layer.weight`;
`experts.gate_up_proj`), so base checkpoints, optimizers and tied weights are untouched by adding LoRA.
"""

import itertools
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from models.lora_layers import INITS, ExpertsLoRA, LoraConfig, LoRALinear, RowAdapters, per_row_adapters
from models.lora_targets import (
    DEFAULT_TARGETS, EXPERTS_TARGET, ModuleNames, is_strict, matches, matches_expert_weight, resolve_targets,
)
from models.moe import Experts, require_whole_experts

__all__ = [
    "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "DEFAULT_TARGETS", "EXPERTS_TARGET", "INITS", "TRAIN_MODES", "ExpertsLoRA",
    "LoRALinear", "LoraConfig", "RowAdapters", "adapter_names", "apply_lora", "check_targets", "load_peft_adapter",
    "lora_state_dict", "merge_adapter", "per_row_adapters", "remove_adapter", "save_peft_adapter",
    "set_active_adapter", "set_trainable", "unmerge_adapter",
]

TRAIN_MODES = ("full", "lora")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_ADD_ORDER = itertools.count()
# peft options that change the math; an adapter that sets any of them would load here but compute something else.
_UNSUPPORTED_IF_SET = (
    "use_rslora", "use_dora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save",
    "layers_to_transform", "layer_replication", "trainable_token_indices", "use_qalora",
    "use_bdlora", "alora_invocation_tokens", "exclude_modules", "arrow_config", "velora_config",
    "monteclora_config", "kasa_config",
)


def _lora_layers(model: nn.Module) -> list[tuple[str, LoRALinear | ExpertsLoRA]]:
    """Every layer holding adapters, by the path of the module whose weights it adapts (an Experts for
    ExpertsLoRA), which is also the path in peft's keys."""
    layers = []
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            layers.append((name, module))
        elif isinstance(module, Experts) and module.lora is not None:
            layers.append((name, module.lora))
    return layers


def adapter_names(model: nn.Module) -> list[str]:
    """Every adapter present in the model, in the order they were added."""
    added_at = {name: at for _, layer in _lora_layers(model) for name, at in layer.added_at.items()}
    return sorted(added_at, key=added_at.__getitem__)


def _merged_adapter(model: nn.Module) -> str | None:
    return next((m.merged_adapter for _, m in _lora_layers(model) if m.merged_adapter is not None), None)


def _require_adapter(model: nn.Module, name: str) -> None:
    if name not in adapter_names(model):
        raise ValueError(f"No LoRA adapter named {name!r}; loaded adapters: {adapter_names(model)}")


def _linears(model: nn.Module) -> tuple[dict[str, nn.Module], list[str]]:
    """(Linear layers by path, the paths of the Linear layers that share their weight with an embedding: a tied
    lm_head, which LoRA may wrap too, its adapter running next to the shared frozen weight, but whose adapter cannot be
    merged, which would change the input embeddings too). A last pipeline stage holds a tied lm_head without the
    embedding; its config still says they are tied."""
    embedding_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tied_head = "lm_head" if getattr(getattr(model, "args", None), "tie_word_embeddings", False) else None
    inside_lora = tuple(f"{name}." for name, m in _lora_layers(model) if isinstance(m, LoRALinear))
    linears, tied = {}, []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Linear, LoRALinear)) or (inside_lora and name.startswith(inside_lora)):
            continue
        if id(m.weight) in embedding_weights or name == tied_head:
            tied.append(name)
        else:
            linears[name] = m
    return linears, tied


def _resolve_targets(
    model: nn.Module, targets: tuple[str, ...], strict: bool
) -> tuple[dict[str, nn.Module], dict[str, list[str]]]:
    """(Linear modules to adapt by path, Experts paths -> fused tensor names to adapt): models.lora_targets' rule
    on this model's module names."""
    linears, tied = _linears(model)
    experts = [name for name, m in model.named_modules() if isinstance(m, Experts)]
    chosen, expert_weights = resolve_targets(ModuleNames(list(linears), tied, experts), targets, strict)
    return {n: linears[n] if n in linears else model.get_submodule(n) for n in chosen}, expert_weights


def apply_lora(
    model: nn.Module, cfg: LoraConfig, adapter_name: str = "default", seed: int | None = None,
    device: torch.device | str | None = None, *, strict: bool | None = None,
) -> list[nn.Parameter]:
    """Add adapter `adapter_name` to every targeted Linear and routed-expert block, freeze every non-LoRA
    parameter, make the new adapter the active one, and return its (trainable) parameters. Adapters added earlier
    keep their requires_grad.

    Targets (docs/lora.md): nn.Linear module names by peft's dotted-suffix rule ("q_proj", "lm_head", ...),
    "experts" for both fused tensors of every models.moe.Experts, "experts.gate_up_proj" / "experts.down_proj" for
    one. With the default targets (DEFAULT_TARGETS, in any order) the names a model lacks are skipped; any other
    target list must match with every name (strict=False skips them too: a pipeline stage, which holds only some of
    the layers, once the targets are checked on the whole model).

    device: where the adapter tensors are created (default: each adapted weight's device). A model built on the
    meta device for a distributed engine passes "cpu", so the adapter holds the seed's initial values (the same
    as on a loaded model) until they are copied into the sharded parameters.

    The returned parameters are in the order they are drawn (A then B of each adapted module)."""
    strict = is_strict(tuple(cfg.target_modules)) if strict is None else strict
    return _add_adapter(model, cfg, adapter_name, seed, strict, device)


def check_targets(model: nn.Module, target_modules: tuple[str, ...]) -> None:
    """Raise the ValueError apply_lora would raise for these targets on this model (works on a meta-device model,
    so a service can check a request against a model's architecture without loading its weights)."""
    _resolve_targets(model, tuple(target_modules), strict=is_strict(tuple(target_modules)))


def _add_adapter(
    model: nn.Module, cfg: LoraConfig, adapter_name: str, seed: int | None, strict: bool,
    device: torch.device | str | None = None,
) -> list[nn.Parameter]:
    if not adapter_name or "." in adapter_name:
        raise ValueError(f"adapter_name must be a non-empty string without dots, got {adapter_name!r}")
    if adapter_name in adapter_names(model):
        raise ValueError(f"A LoRA adapter named {adapter_name!r} already exists; remove_adapter it first")
    merged = _merged_adapter(model)
    if merged is not None:
        raise ValueError(f"Adapter {merged!r} is merged into the weights; unmerge_adapter it before adding another")
    linears, expert_weights = _resolve_targets(model, cfg.target_modules, strict)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    params: list[nn.Parameter] = []
    added_at = next(_ADD_ORDER)
    for name, module in linears.items():
        if isinstance(module, nn.Linear):
            parent_name, _, leaf = name.rpartition(".")
            module_lora = LoRALinear(module)
            setattr(model.get_submodule(parent_name), leaf, module_lora)
            module = module_lora
        params += module.add_adapter(adapter_name, cfg, generator, device)
        module.added_at[adapter_name] = added_at
    for path, weights in expert_weights.items():
        experts = model.get_submodule(path)
        if experts.lora is None:
            experts.lora = ExpertsLoRA(experts)
        params += experts.lora.add_adapter(adapter_name, cfg, weights, device or experts.gate_up_proj.device,
                                           generator)
        experts.lora.added_at[adapter_name] = added_at
    _train_only(model, _adapter_params(model, None))
    set_active_adapter(model, adapter_name)
    return params


def _adapter_params(model: nn.Module, name: str | None) -> list[nn.Parameter]:
    """The Parameters of adapter `name`, or of every adapter when None."""
    return [
        p
        for _, layer in _lora_layers(model)
        for adapter in ([name] if name is not None else list(layer.lora_A))
        if adapter in layer.lora_A
        for p in [*layer.lora_A[adapter].parameters(), *layer.lora_B[adapter].parameters()]
    ]


def _train_only(model: nn.Module, params: list[nn.Parameter]) -> None:
    keep = {id(p) for p in params}
    for p in model.parameters():
        if id(p) not in keep:
            p.requires_grad_(False)


def set_trainable(model: nn.Module, mode: str) -> list[nn.Parameter]:
    """Choose what trains and return those Parameters (for the optimizer).

    "lora": only the active adapter's tensors (everything else frozen). "full": every base parameter (full
    fine-tuning); the model must hold no adapter and no 4-bit experts."""
    if mode not in TRAIN_MODES:
        raise ValueError(f"training mode must be one of {TRAIN_MODES}, got {mode!r}")
    if mode == "lora":
        active = next((layer.active_adapter for _, layer in _lora_layers(model)), None)
        if active is None:
            raise ValueError("mode='lora' needs an active LoRA adapter: apply_lora (or set_active_adapter) first")
        params = _adapter_params(model, active)
        _train_only(model, params)
        for p in params:
            p.requires_grad_(True)
        return params
    if adapter_names(model):
        raise ValueError(
            f"mode='full' trains the base weights, but the model holds LoRA adapters {adapter_names(model)}; "
            "remove_adapter them first or use mode='lora'"
        )
    if any(isinstance(m, Experts) and m.is_quantized for m in model.modules()):
        raise ValueError("mode='full' cannot train 4-bit experts (frozen packed buffers); load the model without "
                         "quantize_experts_ or use mode='lora'")
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def set_active_adapter(model: nn.Module, name: str | None) -> None:
    """Make `name` the adapter every LoRA layer applies; None runs the base model only."""
    if name is not None:
        _require_adapter(model, name)
    merged = _merged_adapter(model)
    if merged is not None and name != merged:
        raise ValueError(f"Adapter {merged!r} is merged into the weights; unmerge_adapter it before switching")
    for _, layer in _lora_layers(model):
        layer.active_adapter = name


def remove_adapter(model: nn.Module, name: str) -> None:
    """Delete an adapter (unmerging it first if merged). A layer left with no adapter becomes a plain nn.Linear
    holding the same weight/bias Parameters (experts drop their `lora` hook)."""
    _require_adapter(model, name)
    if _merged_adapter(model) == name:
        unmerge_adapter(model, name)
    for path, layer in _lora_layers(model):
        if name not in layer.lora_A:
            continue
        layer.delete_adapter(name)
        if len(layer.lora_A):
            continue
        if isinstance(layer, ExpertsLoRA):
            model.get_submodule(path).lora = None
            continue
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        linear.weight, linear.bias = layer.weight, layer.bias
        parent_name, _, leaf = path.rpartition(".")
        setattr(model.get_submodule(parent_name), leaf, linear)


def merge_adapter(model: nn.Module, name: str) -> None:
    """Fold W += B A * scaling (per expert for routed experts) into the base weights and make it active."""
    _require_adapter(model, name)
    merged = _merged_adapter(model)
    if merged is not None:
        raise ValueError(f"Adapter {merged!r} is already merged; unmerge_adapter it first")
    layers = _lora_layers(model)
    adapted = {p for p, layer in layers if name in layer.lora_A}
    tied = [p for p in _linears(model)[1] if p in adapted]
    if tied:
        raise ValueError(f"Cannot merge adapter {name!r}: it adapts {tied}, whose weight is the input embeddings' "
                         "(tie_word_embeddings), so merging would change the embeddings too; serve it unmerged "
                         "(set_active_adapter)")
    quantized = [p for p, layer in layers if isinstance(layer, ExpertsLoRA) and model.get_submodule(p).is_quantized]
    if quantized:
        raise ValueError(f"Cannot merge into 4-bit experts ({quantized[0]}, ...): the sum is not representable in the "
                         "packed format; serve the adapter unmerged (set_active_adapter)")
    for path, layer in layers:
        if name in layer.lora_A and isinstance(layer, ExpertsLoRA):
            layer.merge(name, model.get_submodule(path))
        elif name in layer.lora_A:
            layer.merge(name)
        layer.active_adapter = name


def unmerge_adapter(model: nn.Module, name: str) -> None:
    """Subtract a merged adapter from the base weights again; it stays the active (now unmerged) adapter."""
    if _merged_adapter(model) != name:
        raise ValueError(f"Adapter {name!r} is not merged (merged: {_merged_adapter(model)!r})")
    for path, layer in _lora_layers(model):
        if layer.merged_adapter == name and isinstance(layer, ExpertsLoRA):
            layer.unmerge(model.get_submodule(path))
        elif layer.merged_adapter == name:
            layer.unmerge()


def lora_parameters(model: nn.Module, adapter_name: str = "default") -> dict[str, nn.Parameter]:
    """The adapter's Parameters themselves under peft's file key names (lora_state_dict's keys, in its order)."""
    _require_adapter(model, adapter_name)
    return {
        f"{_PEFT_PREFIX}{path}.{suffix}": tensor
        for path, layer in _lora_layers(model)
        if adapter_name in layer.lora_A
        for suffix, tensor in layer.peft_tensors(adapter_name).items()
    }


def lora_state_dict(model: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's file key names (detached views of the Parameters, not copies, so
    copying into them loads an adapter)."""
    return {key: p.detach() for key, p in lora_parameters(model, adapter_name).items()}


def _format_alpha(alpha: float) -> int | float:
    return int(alpha) if float(alpha).is_integer() else float(alpha)


def _saved_targets(model: nn.Module, cfg: LoraConfig, adapter_name: str) -> tuple[list[str] | None, list[str] | None]:
    """peft's (target_modules, target_parameters) for what the adapter really holds: the config's Linear names that
    matched, and the expert tensors as "<target>.gate_up_proj" / "<target>.down_proj"."""
    layers = [(p, layer) for p, layer in _lora_layers(model) if adapter_name in layer.lora_A]
    linear_paths = [p for p, layer in layers if isinstance(layer, LoRALinear)]
    modules = sorted({t for t in cfg.target_modules if any(matches(p, t) for p in linear_paths)})
    parameters = set()
    for path, layer in layers:
        for weight in layer.lora_A[adapter_name] if isinstance(layer, ExpertsLoRA) else ():
            for t in cfg.target_modules:
                if matches(path, t):
                    parameters.add(f"{t}.{weight}")
                elif matches_expert_weight(path, weight, t):
                    parameters.add(t)
    return modules or None, sorted(parameters) or None


def save_peft_adapter(
    model: nn.Module, cfg: LoraConfig, out_dir: str | Path, base_model_name_or_path: str, adapter_name: str = "default",
    *, tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write adapter_config.json + adapter_model.safetensors in the layout peft's save_pretrained produces.

    tensors: the adapter's whole tensors under lora_state_dict's keys, given by a caller that gathered them from a
    sharded or expert-parallel model (services/trainer/engine/parallel/sharded_checkpoint.py); model then only
    names the layers and ranks. None: the model's own tensors, which must hold every expert."""
    if tensors is None:
        require_whole_experts(model, "save a PEFT adapter")
    state = lora_state_dict(model, adapter_name) if tensors is None else tensors
    ranks = {layer.rank(adapter_name) for _, layer in _lora_layers(model) if adapter_name in layer.lora_A}
    if ranks != {cfg.rank}:
        raise ValueError(f"cfg.rank={cfg.rank} does not match the rank(s) {sorted(ranks)} of adapter {adapter_name!r}")
    target_modules, target_parameters = _saved_targets(model, cfg, adapter_name)
    config = {
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True if cfg.init == "kaiming" else cfg.init,
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
        "target_modules": target_modules,
        "target_parameters": target_parameters,
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
    targets, parameters = raw.get("target_modules"), raw.get("target_parameters")
    if isinstance(targets, str) or isinstance(parameters, str):
        raise ValueError(
            f"{config_path}: a regex target_modules/target_parameters ({targets!r}, {parameters!r}) is not supported; "
            "list the names"
        )
    # peft matches target_parameters against parameter names, so a bare "down_proj" there is the experts' tensor.
    parameters = tuple(p if "." in p else f"{EXPERTS_TARGET}.{p}" for p in parameters or ())
    try:
        return LoraConfig(
            rank=int(raw["r"]),
            alpha=float(raw["lora_alpha"]),
            dropout=float(raw.get("lora_dropout", 0.0)),
            target_modules=tuple(targets or ()) + parameters,
            init="gaussian" if raw.get("init_lora_weights") == "gaussian" else "kaiming",
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
    previous_active = next((m.active_adapter for _, m in _lora_layers(model)), None)
    # The file decides which layers hold tensors (checked key by key below), so absent config names are skipped.
    _add_adapter(model, cfg, adapter_name, seed=0, strict=False)  # the seed only keeps the global RNG untouched
    try:
        _copy_adapter_tensors(model, adapter_name, tensors, weights_path)
    except ValueError:
        remove_adapter(model, adapter_name)
        set_active_adapter(model, previous_active)
        raise
    return cfg


def _drop_unchanged_base_copies(model: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """peft saves `<layer>.base_layer.weight` for embedding-like targets (lm_head); accept it only if it is the
    model's own weight, since LoRA here never changes base weights."""
    suffix = ".base_layer.weight"
    for key in [k for k in tensors if k.startswith(_PEFT_PREFIX) and k.endswith(suffix)]:
        name = key[len(_PEFT_PREFIX) : -len(suffix)] + ".weight"
        try:
            base = model.get_parameter(name)
        except AttributeError:
            continue  # reported as an unexpected key
        if base.shape != tensors[key].shape or not torch.equal(tensors[key].to(base.device, base.dtype), base):
            raise ValueError(f"{path} carries a base weight {name} that differs from the model's; only LoRA tensors "
                             "are supported (was the adapter trained with modules_to_save or a resized vocabulary?)")
        del tensors[key]


def _copy_adapter_tensors(model: nn.Module, adapter_name: str, tensors: dict[str, torch.Tensor], path: Path) -> None:
    _drop_unchanged_base_copies(model, tensors, path)
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
