"""Hugging Face-format model directories: inspect, load, save.

A model directory is what transformers' save_pretrained writes: config.json, one model.safetensors or several shards
listed in model.safetensors.index.json, and tokenizer files. Users point the platform at their own directory (no hub
access at run time), so every problem with one is reported as a ModelDirError that says what is wrong and where.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.families import family_for_architecture, family_for_config
from models.model_dir import INDEX_FILE, read_config, weight_files
from models.moe import require_whole_experts

_MAX_NAMES_IN_ERROR = 20

def _names(keys) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - _MAX_NAMES_IN_ERROR} more" if len(keys) > _MAX_NAMES_IN_ERROR else ""
    return ", ".join(keys[:_MAX_NAMES_IN_ERROR]) + more


def load_pretrained(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> torch.nn.Module:
    """Build the model on the meta device and assign the checkpoint tensors, so no memory is spent on a random
    init that would be overwritten. Returns the model (its family's CausalLM) in eval mode, like transformers'
    from_pretrained."""
    return load_weights(build_on_meta(model_dir), model_dir, dtype=dtype, device=device)


_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def _stage_holds(stage: torch.nn.Module, name: str, tied_head: bool) -> bool:
    """Whether checkpoint tensor `name` belongs to a pipeline stage: one of its layers (by number in the whole
    model), or a top-level module it kept (embed_tokens, norm, lm_head); with tied_head, the embeddings its lm_head
    shares."""
    layer = _LAYER_KEY.match(name)
    if layer:
        return layer.group(1) in stage.model.layers
    if tied_head and name == "model.embed_tokens.weight":
        return True
    try:
        stage.get_submodule(name.rsplit(".", 1)[0])
    except AttributeError:  # a module the stage dropped (None), or none of this model's
        return False
    return True


def load_weights(
    model: torch.nn.Module, model_dir: str | Path, dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> torch.nn.Module:
    """Assign a checkpoint's tensors to a CausalLM built on the meta device: the whole model, or a pipeline stage
    (models/common/pipeline.py) that holds some of the layers and maybe the embeddings / final norm / lm_head.
    Only the tensors the model holds are read from the safetensors files (a stage reads its own layers, never the
    rest of the checkpoint); every tensor it holds must be there. A last stage whose lm_head is tied to embeddings it
    does not hold reads model.embed_tokens.weight into its own lm_head. The whole model reads every tensor, so a
    surplus one is reported. Returns the model in eval mode."""
    args = model.args
    state_dict_adapter = family_for_architecture(args.architecture).state_dict_adapter
    tied_head = bool(args.tie_word_embeddings) and model.lm_head is not None and model.model.embed_tokens is None
    whole = (len(model.model.layers) == args.num_layers and None not in
             (model.model.embed_tokens, model.model.norm, model.lm_head))
    device_str = str(torch.device(device))
    # Tensors the family keeps in float32 whatever the load dtype (e.g. DeepSeek's router and its selection bias:
    # rounding them to bf16 changes which experts win near ties, as transformers also avoids).
    keep_fp32 = re.compile("|".join(getattr(state_dict_adapter, "FLOAT32_PARAMETERS", ())) or r"(?!)")
    hf_state: dict[str, torch.Tensor] = {}
    for file in weight_files(model_dir):
        with safe_open(file, framework="pt", device=device_str) as f:
            for name in f.keys():
                if not whole and not _stage_holds(model, name, tied_head):
                    continue
                tensor = f.get_tensor(name)
                if tensor.is_floating_point():
                    tensor = tensor.to(torch.float32 if keep_fp32.search(name) else dtype)
                hf_state[name] = tensor
    state = state_dict_adapter.from_hf(hf_state, args)
    model_state = model.state_dict()
    expected = state_dict_adapter.expected_keys(list(model_state), args)
    if tied_head and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state.pop("model.embed_tokens.weight")
    if tied_head:
        expected.add("lm_head.weight")
    missing, unexpected = expected - state.keys(), state.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"Checkpoint in {str(model_dir)!r} does not match {args.architecture}: "
            f"missing keys [{_names(missing)}]; unexpected keys [{_names(unexpected)}]"
        )
    bad_shapes = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(model_state[k].shape)}"
        for k, v in state.items()
        if v.shape != model_state[k].shape
    ]
    if bad_shapes:
        raise ValueError(f"Checkpoint in {str(model_dir)!r} has wrong shapes: {'; '.join(bad_shapes)}")
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    args.torch_dtype = str(dtype).removeprefix("torch.")
    return model.eval()


MAX_SHARD_BYTES = 5 * 1024**3  # as transformers' default max_shard_size


def save_pretrained(model: torch.nn.Module, out_dir: str | Path, max_shard_bytes: int = MAX_SHARD_BYTES, *,
                    state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """Write config.json + safetensors weights that transformers' AutoModelForCausalLM.from_pretrained loads: one
    model.safetensors, or shards of at most max_shard_bytes with model.safetensors.index.json. Each shard is copied
    to the CPU and written before the next is gathered, so host memory holds one shard (plus, for MoE families, the
    per-expert split).

    The weights are saved as they currently are: LoRA tensors are left out (they go to a PEFT adapter), but an
    adapter merged with merge_adapter is part of the weights, which is how a merged model is exported. 4-bit frozen
    experts have no Hugging Face form: dequantize them first.

    state_dict: the model's whole state_dict, given by a caller that gathered it from a sharded or expert-parallel
    model (services/trainer/engine/parallel/sharded_checkpoint.py); model then only gives the config and dtype.
    None: the model's own state_dict, which must hold every expert."""
    if state_dict is None:
        require_whole_experts(model, "save a Hugging Face checkpoint")
    if any(getattr(m, "is_quantized", False) for m in model.modules()):
        raise ValueError("this model holds 4-bit frozen experts, which a Hugging Face checkpoint cannot store; "
                         "call models.moe.dequantize_experts_ first, or save the unquantized base")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state_dict_adapter = family_for_config({"architectures": [model.args.architecture]}).state_dict_adapter
    state = state_dict_adapter.to_hf(model.state_dict() if state_dict is None else state_dict, model.args)
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards):
        save_file({k: state[k].detach().to("cpu").contiguous() for k in keys}, str(out / name),
                  metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = model.args.to_hf_config()
    # The first parameter's dtype: the embeddings' (a later pipeline stage has none; its first layer's then).
    config["dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def build_on_meta(model_dir: str | Path) -> torch.nn.Module:
    """The model of a directory with no weights (meta device): for checking requests against its architecture."""
    config = read_config(model_dir)
    family = family_for_config(config)
    with torch.device("meta"):
        return family.CausalLM(family.ModelArgs.from_hf_config(config))
