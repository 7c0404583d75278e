"""Plans of managed jobs from the trainer's own code: the scheduler's planner process (services/scheduler/planner.py
runs `python -m services.trainer.plan`; the scheduler itself never imports torch).

Protocol: one JSON request per stdin line ({"method", "model_path", "dataset_path", "dataset_sha256", "settings"}:
settings as stored on a job row; method "token_stats" with settings {"format", "max_seq_len"} answers a dataset's
token statistics instead of a plan), one JSON answer per stdout line ({"error": ...} when planning failed,
{"data_loss": ...} when the dataset's bytes do not hash to dataset_sha256), until end of input.

The numbers come from the code a job runs: data.py's tokenization, masks, seeded split and StepSampler, the engine's
device and dtype rule, apply_lora on the model built on the meta device (the trainable count is exact). Tokenized
examples are kept per (dataset sha256, model path, max_seq_len, method), so a plan that only changes batch sizes,
the split or the step counts skips tokenizing.

Memory (an estimate; tests/services/trainer/test_plan.py compares it with a measured run): weights at the engine's
dtype; the float32 adapter, its gradients and AdamW's two moments; the activations autograd keeps for the largest
micro-batch, per token and layer:
    sum over the layer's weights of (in + out) features       the inputs and outputs of its projections (routed
                                                              experts: top_k of them per token)
    + rank per LoRA A                                         the adapter's low-rank intermediate
    + 4 x hidden                                              norms and residuals
    + heads x span                                            attention probabilities where the eager path keeps
                                                              them (float32 SDPA on the CPU: packed groups of up to
                                                              SDPA_PACKED_CHUNK_TOKENS; none on CUDA's fused kernels)
at the weights' dtype; and the logprob head's three float32 [chunk, vocab] blocks (kernels/logprobs.py).

DPO (plan_dpo) plans the same numbers over preference pairs (data.tokenize_pairs: rows are pairs, a pair's tokens
are its two sequences', a micro-batch packs batch_size pairs). A full-parameter job's estimate counts float32
weights, their float32 gradients and AdamW's two moments, and no adapter; its reference pass (no gradients, before
training) needs less than a training step, so it adds nothing to the peak.
"""
from __future__ import annotations

import hashlib
import json
import math
import sys
import traceback
from collections import OrderedDict
from pathlib import Path

import torch

from kernels.attention import SDPA_PACKED_CHUNK_TOKENS
from kernels.logprobs import default_chunk_size
from models.checkpoint import build_on_meta
from models.lora import LoraConfig, apply_lora
from models.chat import encode_chat_prompt
from models.model_dir import read_config
from models.tokenizer import load_tokenizer
from services.common.methods import HYPERPARAMS
from services.trainer.data import (StepSampler, num_targets, read_jsonl, split_train_eval, tokenize_pairs,
                                   tokenize_rows)
from services.trainer.engine.engine import training_device, training_dtype

EXAMPLES_KEPT = 8  # tokenized datasets kept
FEW_STEPS = 10
_examples: OrderedDict[tuple, tuple] = OrderedDict()
_tokenizers: dict[str, object] = {}
_models: dict[tuple, dict] = {}


def tokenized(model_path: str, dataset_path: str, sha256: str, max_seq_len: int, method: str):
    """(examples kept, rows skipped, rows, the error that would fail the job or ''), as services/trainer/sft.py gets
    them from load_sft_data."""
    key = (sha256, model_path, max_seq_len, method)
    if key not in _examples:
        if model_path not in _tokenizers:
            _tokenizers[model_path] = load_tokenizer(model_path)
        rows = read_jsonl(verified_bytes(Path(dataset_path), sha256))
        tokenize = tokenize_pairs if method == "dpo" else tokenize_rows
        try:
            examples, skipped = tokenize(_tokenizers[model_path], rows, max_seq_len)
            _examples[key] = (examples, skipped, len(rows), "")
        except ValueError as exc:  # a row the chat template cannot render fails the job the same way
            _examples[key] = ([], 0, len(rows), str(exc))
        if len(_examples) > EXAMPLES_KEPT:
            _examples.popitem(last=False)
    _examples.move_to_end(key)
    return _examples[key]


class DamagedDataset(Exception):
    """The dataset's blob does not hash to the sha256 its row names (answered {"data_loss": ...})."""


def verified_bytes(path: Path, sha256: str) -> bytes:
    """The dataset's bytes, hashed in the one read that loads them; DamagedDataset when they are not the bytes the
    row promised (or the blob is gone)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DamagedDataset(f"blob {sha256} is missing from the object store") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise DamagedDataset(f"blob {sha256} is damaged: read {len(data)} bytes hashing to {digest}")
    return data


def model_numbers(model_path: str, lora: LoraConfig | None, seed: int) -> dict:
    """Parameter counts and activation elements per token (without attention probabilities) of the model with this
    adapter (None: full-parameter, every weight trainable), from the model built on the meta device (no weights are
    read)."""
    key = (model_path, None) if lora is None else (model_path, lora.rank, lora.dropout, tuple(lora.target_modules))
    if key not in _models:
        config = read_config(model_path)
        model = build_on_meta(model_path)
        base = sum(p.numel() for p in model.parameters())
        trainable = base if lora is None else sum(p.numel() for p in apply_lora(model, lora, seed=seed))
        top_k = int(config.get("num_experts_per_tok") or 1)
        per_token = 4 * int(config["hidden_size"]) * int(config["num_hidden_layers"])
        for name, p in model.named_parameters():
            if ".layers." not in name:
                continue
            if ".lora_A." in name:
                copies = top_k if ".experts." in name else 1  # routed experts' A stacks every expert's
                per_token += copies * (lora.rank + p.shape[-1] * (lora.dropout > 0))
            elif ".lora_B." in name or p.dim() < 2:
                continue
            elif p.dim() == 3:  # routed experts [E, out, in]: top_k of them see each token
                per_token += top_k * (p.shape[1] + p.shape[2])
            else:
                per_token += p.shape[0] + p.shape[1]
        _models[key] = {"base": base, "trainable": trainable, "per_token": per_token,
                        "heads": int(config["num_attention_heads"]) * int(config["num_hidden_layers"]),
                        "vocab": int(config["vocab_size"])}
    return _models[key]


def memory_estimate(numbers: dict, tokens: int, longest: int, *, full_parameter: bool = False) -> dict:
    device = training_device()
    dtype = training_dtype(device, full_parameter=full_parameter)
    width = torch.empty((), dtype=dtype).element_size()
    span = 0 if device.type == "cuda" else min(tokens, max(SDPA_PACKED_CHUNK_TOKENS, longest))
    trained = 4 * numbers["trainable"]  # float32
    out = {"device": device.type, "weights_dtype": str(dtype).removeprefix("torch."),
           "weights_bytes": numbers["base"] * width,
           "trainable_bytes": 0 if full_parameter else trained,  # full-parameter: the weights themselves
           "gradient_bytes": trained, "optimizer_bytes": 2 * trained,
           "activation_bytes": tokens * (numbers["per_token"] + numbers["heads"] * span) * width,
           "logprob_chunk_bytes": 3 * min(tokens, default_chunk_size(numbers["vocab"])) * numbers["vocab"] * 4}
    out["total_bytes"] = sum(v for k, v in out.items() if k.endswith("_bytes"))
    return out


def plan_sft(req: dict) -> dict:
    hp = HYPERPARAMS["sft"].from_json(req["settings"])
    examples, skipped, num_rows, failure = tokenized(req["model_path"], req["dataset_path"], req["dataset_sha256"],
                                                     hp.max_seq_len, "sft")
    # A micro-batch packs examples' tokens 0..n-2 (data.collate); the largest packs the batch_size longest.
    return _plan(req, hp, examples, skipped, num_rows, failure, what="no assistant/completion token",
                 usable="an assistant/completion token",
                 tokens=lambda ex: len(ex.input_ids) - 1, longest=lambda ex: len(ex.input_ids) - 1,
                 targets=num_targets, lora=True)


def plan_dpo(req: dict) -> dict:
    """A DPO job's plan: rows are preference pairs; a pair's tokens and targets are its two sequences'
    (data.collate_pairs packs both)."""
    hp = HYPERPARAMS["dpo"].from_json(req["settings"])
    pairs, skipped, num_rows, failure = tokenized(req["model_path"], req["dataset_path"], req["dataset_sha256"],
                                                  hp.max_seq_len, "dpo")
    return _plan(req, hp, pairs, skipped, num_rows, failure, what="a response with no token",
                 usable="a token of both responses",
                 tokens=lambda p: len(p.chosen.input_ids) + len(p.rejected.input_ids) - 2,
                 longest=lambda p: max(len(p.chosen.input_ids), len(p.rejected.input_ids)) - 1,
                 targets=lambda p: num_targets(p.chosen) + num_targets(p.rejected), lora=not hp.full_parameter)


def _plan(req: dict, hp, examples: list, skipped: int, num_rows: int, failure: str, *, what: str, usable: str,
          tokens, longest, targets, lora: bool) -> dict:
    """The plan of a method's tokenized examples (SFT rows or DPO pairs): tokens(ex) the tokens one packs into a
    micro-batch, longest(ex) its longest sequence, targets(ex) its target tokens."""
    warnings = [f"the job would fail: {failure}"] if failure else []
    if skipped and examples:
        warnings.append(f"{skipped} of {num_rows} rows have {what} within max_seq_len={hp.max_seq_len} and are "
                        "skipped")
    train, held_out, steps_per_epoch, total = [], [], 0, 0
    if examples:
        train, held_out = split_train_eval(examples, hp.eval_fraction, hp.seed)
        steps_per_epoch = StepSampler(train, batch_size=hp.batch_size, grad_accum=hp.gradient_accumulation_steps,
                                      seed=hp.seed).steps_per_epoch
        total = hp.max_steps or steps_per_epoch * hp.epochs  # as services/trainer/sft.py's _SftRun counts
    elif not failure:
        warnings.append(f"none of the {num_rows} rows has {usable} within max_seq_len={hp.max_seq_len}: the job would "
                        "fail; raise max_seq_len or shorten the prompts")
    lengths = sorted((tokens(ex) for ex in train), reverse=True)
    largest = sum(lengths[:hp.batch_size])
    checkpoints = -(-total // hp.checkpoint_every)  # every checkpoint_every steps, and the final step
    eval_passes = 0 if not held_out else -(-total // hp.eval_every) if hp.eval_every else checkpoints
    if examples and total < FEW_STEPS:
        warnings.append(f"only {total} optimizer step{'s' * (total != 1)}: too few to learn much; raise epochs or "
                        "max_steps, or lower batch_size")
    if examples and hp.eval_fraction > 0 and not held_out:
        warnings.append("the eval split is empty (fewer than 2 usable rows): no eval loss will be reported")
    if total and hp.warmup_steps >= total:
        warnings.append(f"warmup_steps ({hp.warmup_steps}) >= total steps ({total}): the learning rate never "
                        "reaches its peak")
    adapter = LoraConfig(rank=hp.lora_rank, alpha=hp.lora_alpha, dropout=hp.lora_dropout,
                         target_modules=hp.target_modules) if lora else None
    numbers = model_numbers(req["model_path"], adapter, hp.seed)
    return {
        "dataset_rows": num_rows, "train_rows": len(train), "eval_rows": len(held_out), "skipped_rows": skipped,
        "tokens_per_epoch": sum(lengths), "target_tokens_per_epoch": sum(targets(ex) for ex in train),
        "eval_target_tokens": sum(targets(ex) for ex in held_out), "steps_per_epoch": steps_per_epoch,
        "total_steps": total, "epochs": total / steps_per_epoch if steps_per_epoch else 0.0,
        "checkpoints": checkpoints, "eval_passes": eval_passes, "trainable_parameters": numbers["trainable"],
        "base_parameters": numbers["base"], "largest_micro_batch_tokens": largest,
        "memory": memory_estimate(numbers, largest, max((longest(ex) for ex in train), default=0),
                                  full_parameter=not lora),
        "warnings": warnings,
    }


def plan_rft(req: dict) -> dict:
    """An RFT job's plan: its steps (one per policy version), the passes over the prompts they make, the trainable
    count and the memory of the training side (one step's datums: prompts_per_step x group_size samples of at most
    the longest prompt + max_tokens tokens, trained in micro-batches of the loop's MICRO_BATCH_TOKENS)."""
    from services.trainer.rl.loop import MICRO_BATCH_TOKENS

    hp = HYPERPARAMS["rft"].from_json(req["settings"])
    rows = read_jsonl(verified_bytes(Path(req["dataset_path"]), req["dataset_sha256"]))
    if req["model_path"] not in _tokenizers:
        _tokenizers[req["model_path"]] = load_tokenizer(req["model_path"])
    tokenizer = _tokenizers[req["model_path"]]
    prompt_tokens = [len(tokenizer.encode(r["prompt"], add_special_tokens=False)) if isinstance(r.get("prompt"), str)
                     else 0 for r in rows]
    longest = max(prompt_tokens, default=0) + hp.max_tokens
    lora = LoraConfig(rank=hp.lora_rank, alpha=hp.lora_alpha, dropout=hp.lora_dropout,
                      target_modules=hp.target_modules)
    numbers = model_numbers(req["model_path"], lora, hp.seed)
    if hp.full_parameter:
        numbers = {**numbers, "trainable": numbers["base"]}
    steps_per_epoch = -(-len(rows) // hp.prompts_per_step)
    warnings = []
    if hp.steps < FEW_STEPS:
        warnings.append(f"only {hp.steps} optimizer step{'s' * (hp.steps != 1)}: too few to learn much; raise steps")
    largest = min(MICRO_BATCH_TOKENS, hp.prompts_per_step * hp.group_size * longest)
    return {
        "dataset_rows": len(rows), "train_rows": len(rows), "eval_rows": 0, "skipped_rows": 0,
        "tokens_per_epoch": sum(prompt_tokens), "target_tokens_per_epoch": 0, "eval_target_tokens": 0,
        "steps_per_epoch": steps_per_epoch, "total_steps": hp.steps,
        "epochs": hp.steps / steps_per_epoch if steps_per_epoch else 0.0,
        "checkpoints": -(-hp.steps // hp.checkpoint_every), "eval_passes": 0,
        "trainable_parameters": numbers["trainable"], "base_parameters": numbers["base"],
        "largest_micro_batch_tokens": largest, "memory": memory_estimate(numbers, largest, longest),
        "warnings": warnings,
    }


UNTRUNCATED = 1 << 30  # a max_seq_len that keeps every token: the rows' own lengths
COUNTED = {"sft": "every token of the row as the trainer renders it (chat template, or prompt + completion + eos)",
           "dpo": "the longer of the pair's two sequences (prompt + chosen, prompt + rejected)",
           "rft": "the prompt's tokens (a chat prompt with the template's generation prompt)"}


def token_stats(req: dict) -> dict:
    """Rows, mean / p95 / max tokens and rows over settings["max_seq_len"] of a dataset of settings["format"], from
    the tokenization a job of its method runs (untruncated); the same cache as the plans'."""
    fmt, limit = req["settings"]["format"], int(req["settings"]["max_seq_len"])
    method = {"sft_chat": "sft", "sft_prompt_completion": "sft"}.get(fmt, fmt)
    if method == "rft":
        lengths = _prompt_tokens(req)
    else:
        examples, _, _, failure = tokenized(req["model_path"], req["dataset_path"], req["dataset_sha256"],
                                            UNTRUNCATED, method)
        if failure:
            raise ValueError(failure)
        lengths = [max(len(p.chosen.input_ids), len(p.rejected.input_ids)) if method == "dpo" else len(p.input_ids)
                   for p in examples]
    ordered = sorted(lengths)
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)] if ordered else 0
    return {"rows": len(lengths), "mean_tokens": sum(lengths) / len(lengths) if lengths else 0.0, "p95_tokens": p95,
            "max_tokens": ordered[-1] if ordered else 0, "max_seq_len": limit,
            "over_max_seq_len": sum(n > limit for n in lengths), "counted": COUNTED[method]}


def _prompt_tokens(req: dict) -> list[int]:
    rows = read_jsonl(verified_bytes(Path(req["dataset_path"]), req["dataset_sha256"]))
    if req["model_path"] not in _tokenizers:
        _tokenizers[req["model_path"]] = load_tokenizer(req["model_path"])
    tokenizer = _tokenizers[req["model_path"]]
    return [len(tokenizer.encode(r["prompt"], add_special_tokens=False)) if isinstance(r.get("prompt"), str)
            else len(encode_chat_prompt(tokenizer, r["messages"])) for r in rows]


PLANNERS = {"sft": plan_sft, "dpo": plan_dpo, "rft": plan_rft, "token_stats": token_stats}


def main() -> None:
    torch.set_num_threads(1)  # tokenizing and a seeded permutation: nothing to gain from a thread pool
    for line in sys.stdin:
        try:
            req = json.loads(line)
            answer = PLANNERS[req["method"]](req)
        except DamagedDataset as exc:
            answer = {"data_loss": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the process boundary: the scheduler reports it, this loop goes on
            traceback.print_exc()
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
