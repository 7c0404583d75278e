"""Hugging Face-format model directories, without torch: read config.json, find the weight files, validate and
summarise a directory from config.json and the safetensors headers (models/checkpoint.py loads and saves the weights).
"""

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from models.families import family_for_config

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class ModelDirError(ValueError):
    """A model directory the platform cannot use; the message is meant for the user who supplied it."""


@dataclass
class ModelInfo:
    architecture: str
    num_parameters: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    torch_dtype: str | None


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir)
    if not path.exists():
        raise ModelDirError(f"Model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelDirError(f"Model path {str(path)!r} is not a directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelDirError(f"No config.json in model directory {str(path)!r}; is this a Hugging Face model folder?")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelDirError(f"Cannot read {config_path}: {e}") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{config_path} must hold a JSON object, got {type(config).__name__}")
    return config


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights: the shards named by the index if there is one, else every
    *.safetensors file (minus a PEFT adapter that may sit alongside)."""
    path = Path(model_dir)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelDirError(f"Cannot read the shard index {index_path}: {e!r}") from None
        files = [path / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelDirError(f"{index_path} lists shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(f for f in path.glob("*.safetensors") if f.name != "adapter_model.safetensors")
    if not files:
        raise ModelDirError(f"No *.safetensors weights in model directory {str(path)!r}")
    return files


def _read_safetensors_header(file: Path) -> dict:
    """The JSON header (names, dtypes, shapes) without touching the tensor bytes."""
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    return header


def inspect_model_dir(path: str | Path) -> ModelInfo:
    """Validate a model directory and summarise it, reading only config.json and the safetensors headers."""
    model_dir = Path(path)
    config = read_config(model_dir)
    try:
        args = family_for_config(config).ModelArgs.from_hf_config(config)
    except (ValueError, TypeError) as e:
        raise ModelDirError(f"Cannot use the model in {str(model_dir)!r}: {e}") from None
    files = weight_files(model_dir)
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelDirError(
            f"No tokenizer in model directory {str(model_dir)!r}: expected {' or '.join(TOKENIZER_FILES)}"
        )
    num_parameters = 0
    dtypes: dict[str, int] = {}
    for file in files:
        try:
            header = _read_safetensors_header(file)
        except (OSError, ValueError, struct.error) as e:
            raise ModelDirError(f"Cannot read safetensors header of {file}: {e}") from None
        for name, meta in header.items():
            if name == "lm_head.weight" and args.tie_word_embeddings:
                continue  # the same parameter as embed_tokens; counted once, as transformers does
            if name.endswith(".rotary_emb.inv_freq"):
                continue  # a stale buffer some old checkpoints carry, not a parameter
            shape = meta.get("shape") if isinstance(meta, dict) else None
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ModelDirError(f"Malformed safetensors header in {file}: tensor {name!r} has no valid shape")
            numel = math.prod(shape)
            num_parameters += numel
            dtypes[str(meta.get("dtype"))] = dtypes.get(str(meta.get("dtype")), 0) + numel
    torch_dtype = args.torch_dtype
    if torch_dtype is None and dtypes:
        torch_dtype = _SAFETENSORS_DTYPES.get(max(dtypes, key=dtypes.get))
    return ModelInfo(
        architecture=args.architecture,
        num_parameters=num_parameters,
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        max_position_embeddings=args.max_position_embeddings,
        torch_dtype=torch_dtype,
    )


