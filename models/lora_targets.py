"""Which modules a LoRA target list names, without torch: the rule apply_lora follows (models/lora.py) applied to
module names, so a service can check a request against a model directory's config.json alone.

Targets (docs/lora.md): nn.Linear module names by peft's dotted-suffix rule ("q_proj", "lm_head", ...), "experts"
for both fused tensors of every routed-expert block, "experts.gate_up_proj" / "experts.down_proj" for one. With the
default targets (DEFAULT_TARGETS, in any order) the names a model lacks are skipped; any other list must match with
every name. The module names come from the model itself (models/lora.py) or from each family's
ModelArgs.lora_module_names() (the same names, derived from the config; tests compare the two).
"""

from dataclasses import dataclass, field

EXPERTS_TARGET = "experts"
EXPERT_WEIGHT_NAMES = ("gate_up_proj", "down_proj")  # the fused tensors of a routed-expert block (models.moe.Experts)
# A menu, not a list that must all exist: an all-MoE model has no gate_proj, a dense one no experts, DeepSeek's MLA
# has no q_proj/k_proj/v_proj (see apply_lora).
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")  # grouped-query attention
MLA_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")  # DeepSeek's latent attention (+ o_proj)
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = (*ATTENTION_PROJECTIONS, *MLP_PROJECTIONS, *MLA_PROJECTIONS, EXPERTS_TARGET)


@dataclass
class ModuleNames:
    """A model's module names as LoRA sees them."""

    linears: list[str] = field(default_factory=list)  # nn.Linear modules LoRA may wrap
    # Linear layers sharing their weight with an embedding (a tied lm_head): LoRA may wrap them (the shared weight
    # stays frozen and unchanged), but an adapter on one cannot be merged (models/lora.py's merge_adapter).
    tied: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)  # routed-expert blocks


def matches(name: str, target: str) -> bool:
    # peft's rule for a list of targets: the target is the full name or a dotted suffix of it.
    return name == target or name.endswith("." + target)


def matches_expert_weight(experts_path: str, weight: str, target: str) -> bool:
    """A target names the Experts module ("experts": both fused tensors) or one tensor with its module qualifier
    ("experts.down_proj"); a bare "down_proj" names nn.Linear modules only, as in peft's target_modules."""
    return matches(experts_path, target) or ("." in target and matches(f"{experts_path}.{weight}", target))


def is_strict(targets: tuple[str, ...]) -> bool:
    """Every target must match unless the list is the default menu."""
    return set(targets) != set(DEFAULT_TARGETS)


def resolve_targets(names: ModuleNames, targets: tuple[str, ...],
                    strict: bool) -> tuple[list[str], dict[str, list[str]]]:
    """(Linear module names to adapt, expert block path -> fused tensor names to adapt). strict: every target must
    match something; otherwise (the DEFAULT_TARGETS menu, adapters read from files) only at least one. ValueError
    naming the targets that do not fit, and the valid names."""
    linears = names.linears + names.tied
    hits = {
        t: [n for n in linears if matches(n, t)]
        + [(p, w) for p in names.experts for w in EXPERT_WEIGHT_NAMES if matches_expert_weight(p, w, t)]
        for t in targets
    }
    unmatched = [t for t in targets if not hits[t]]
    if unmatched and (strict or len(unmatched) == len(targets)):
        valid = {n.rsplit(".", 1)[-1] for n in linears}
        if names.experts:
            valid |= {EXPERTS_TARGET, *(f"{EXPERTS_TARGET}.{w}" for w in EXPERT_WEIGHT_NAMES)}
        raise ValueError(f"Unknown LoRA target_modules {unmatched}; valid module names are {sorted(valid)}")
    chosen = {hit for t in targets for hit in hits[t]}
    expert_weights: dict[str, list[str]] = {}
    for p in names.experts:
        weights = [w for w in EXPERT_WEIGHT_NAMES if (p, w) in chosen]
        if weights:
            expert_weights[p] = weights
    return [n for n in linears if n in chosen], expert_weights


def check_targets_for_config(config: dict, targets: tuple[str, ...]) -> None:
    """The ValueError apply_lora would raise for these targets on the model of this config.json (None if they fit)."""
    from models.families import family_for_config

    args = family_for_config(config).ModelArgs.from_hf_config(config)
    resolve_targets(args.lora_module_names(), tuple(targets), is_strict(tuple(targets)))


def decoder_module_names(num_layers: int, attention: tuple[str, ...], *, tie_word_embeddings: bool,
                         is_moe_layer=lambda i: False, shared_experts: bool = False) -> ModuleNames:
    """The module names of a decoder stack: per layer its attention projections, then a dense MLP or (where
    is_moe_layer) a routed-expert block and, with shared_experts, a shared dense MLP; then lm_head, tied to the
    embeddings or a Linear of its own."""
    names = ModuleNames()
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names.linears += [f"{layer}.self_attn.{p}" for p in attention]
        if not is_moe_layer(i):
            names.linears += [f"{layer}.mlp.{p}" for p in MLP_PROJECTIONS]
            continue
        names.experts.append(f"{layer}.mlp.experts")
        if shared_experts:
            names.linears += [f"{layer}.mlp.shared_experts.{p}" for p in MLP_PROJECTIONS]
    (names.tied if tie_word_embeddings else names.linears).append("lm_head")
    return names
