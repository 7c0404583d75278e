"""A LoRA checkpoint merged into its base model, as a Hugging Face model directory: the scheduler's
ExportMergedModel runs `python -m services.trainer.export_merged BASE_DIR ADAPTER_DIR OUT_DIR` in a child process
(the scheduler itself never imports torch) and streams OUT_DIR back.

The merge is W + B @ A * scaling (models.lora.merge_adapter, per expert for routed experts), computed in float32 and
stored at the base model's dtype; the tokenizer and generation files of the base directory are copied beside the
weights, so transformers' from_pretrained loads the result as it is. A problem with the inputs exits with status 2
and one line on stderr saying what is wrong.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

from models import inspect_model_dir, load_pretrained, save_pretrained
from models.lora import load_peft_adapter, merge_adapter
from models.model_dir import INDEX_FILE, weight_files

# Files of the base directory that describe the model's weights; the merged directory writes its own.
_WEIGHT_DESCRIPTIONS = {"config.json", INDEX_FILE}


def export_merged(base_dir: Path, adapter_dir: Path, out_dir: Path) -> None:
    info = inspect_model_dir(base_dir)
    dtype = getattr(torch, info.torch_dtype or "float32")
    model = load_pretrained(base_dir, dtype=torch.float32)
    load_peft_adapter(model, adapter_dir)
    merge_adapter(model, "default")
    model.to(dtype)
    save_pretrained(model, out_dir)
    weights = {p.name for p in weight_files(base_dir)}
    for f in sorted(base_dir.iterdir()):
        if f.is_file() and f.name not in weights | _WEIGHT_DESCRIPTIONS and not f.name.endswith(".safetensors"):
            shutil.copyfile(f, out_dir / f.name)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m services.trainer.export_merged BASE_DIR ADAPTER_DIR OUT_DIR", file=sys.stderr)
        return 2
    base_dir, adapter_dir, out_dir = map(Path, argv)
    try:
        export_merged(base_dir, adapter_dir, out_dir)
    except ValueError as exc:  # a base or adapter that does not fit (models/ says what and where)
        print(str(exc).replace("\n", " "), file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
