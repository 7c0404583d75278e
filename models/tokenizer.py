"""Tokenizer loading for local Hugging Face model directories (no hub access)."""

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """The model directory's own tokenizer and chat template, read from disk only."""
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"Cannot load a tokenizer from {str(model_dir)!r}: {e}") from e


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_dir: str | Path) -> list[int]:
    """Every token id that ends generation: the tokenizer's eos plus generation_config.json's eos_token_id.

    Chat models often stop on more than one token (Qwen: <|im_end|> and <|endoftext|>; Llama 3: <|eot_id|> and
    <|end_of_text|>), and only generation_config.json lists them all."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        try:
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"Cannot read {gen_path}: {e}") from None
        for token_id in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if token_id is not None and int(token_id) not in ids:
                ids.append(int(token_id))
    return ids
