"""RoPE settings from a config.json, without torch: what a model family's args (and a torch-free service inspecting
a model directory) need. The tensors are kernels/rope.py's."""

import math

SUPPORTED_ROPE_TYPES = ("default", "llama3")
ROPE_TYPES_WITH_ATTENTION_FACTOR = ("default", "llama3", "yarn")


def rope_type_of(rope_scaling: dict | None) -> str:
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


DEFAULT_ROPE_THETA = 10000.0


def parse_rope_config(config: dict, supported: tuple[str, ...], family: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a config.json dict in either format (transformers 4.x rope_theta +
    rope_scaling, or 5.x rope_parameters). Unsupported settings raise ValueError naming them."""
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"Per-layer-type rope_parameters are not supported by {family}")
        scaling = dict(params)
        theta = float(scaling.pop("rope_theta", config.get("rope_theta", DEFAULT_ROPE_THETA)))
    else:
        theta = float(config.get("rope_theta", DEFAULT_ROPE_THETA))
        scaling = dict(config.get("rope_scaling") or {})
    partial = scaling.pop("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise ValueError(f"partial_rotary_factor={partial} is not supported (only full rotary embeddings)")
    rope_type = rope_type_of(scaling)
    scaling.pop("type", None)
    scaling.pop("rope_type", None)
    if rope_type not in supported:
        raise ValueError(f"Unsupported rope type {rope_type!r}; supported types are {', '.join(supported)}")
    if rope_type == "default":
        return theta, None
    # As transformers' standardize_rope_params: a top-level original_max_position_embeddings wins.
    if "original_max_position_embeddings" in config:
        scaling["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    scaling.setdefault("original_max_position_embeddings", config.get("max_position_embeddings", 4096))
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool):  # a config.json value: ValueError
        raise ValueError(f"rope_scaling of type {rope_type!r} needs a numeric 'factor', got {factor!r}")  # noqa: TRY004
    return theta, {"rope_type": rope_type, **scaling}


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when the context is not extended)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
