"""Supervised fine-tuning with the Training API: your own loop over chat data, then sampling the trained weights.

    python examples/sft_loop.py                           # embedded stack; under a minute on 2 CPU cores
    python examples/sft_loop.py --steps 60 --data my_chats.jsonl

Each row of --data (default examples/data/sft_demo.jsonl) is {"messages": [...]} ending with the assistant's answer.
The prompt is the conversation before it rendered with the model's chat template (add_generation_prompt), the
completion is the answer and the end-of-turn token; the cross_entropy weights are 0 on the prompt and 1 on the
completion, so the model learns the answers only. Every step is one forward_backward over the training rows and one
optim_step (a LoRA adapter, rank --rank), and prints the loss per answer token. A few rows are held out: their loss
is measured with forward (no gradients) before and after. At the end save_weights_and_get_sampling_client publishes
the trained weights and the example samples answers from them, greedy, for training and held-out questions.

Services: by default the example starts its own embedded stack (SQLite, local processes; see _common.py). With
TRAINYARD_TRAINER_URL set it uses that stack instead (TRAINYARD_API_KEY, TRAINYARD_ROLLOUT_URL).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from _common import EXAMPLES, Timer, parser, service_client
from trainyard import types

# Held out from training: paraphrases of training questions (their answers are in the training rows).
HELD_OUT = {"Which city is the capital of France?", "How many legs do spiders have?"}


def read_rows(path: Path) -> list[list[dict]]:
    return [json.loads(line)["messages"] for line in path.read_text().splitlines() if line.strip()]


def prompt_tokens(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def sft_datum(tokenizer, messages: list[dict]) -> types.Datum:
    """Next-token prediction over prompt + answer; weight 1 on the answer's tokens and its end-of-turn token."""
    prompt = prompt_tokens(tokenizer, messages[:-1])
    answer = tokenizer.encode(messages[-1]["content"], add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = prompt + answer
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], steps=40)
    p.add_argument("--data", type=Path, default=EXAMPLES / "data" / "sft_demo.jsonl", help="chat rows (JSONL)")
    p.add_argument("--lr", type=float, default=5e-3, help="Adam learning rate")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    args = p.parse_args(argv)
    timer = Timer()
    rows = read_rows(args.data)
    train = [m for m in rows if m[-2]["content"] not in HELD_OUT]
    held_out = [m for m in rows if m[-2]["content"] in HELD_OUT]

    with service_client(args.work_dir) as service:
        tc = service.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed).result()
        tokenizer = tc.get_tokenizer()
        data = [sft_datum(tokenizer, m) for m in train]
        eval_data = [sft_datum(tokenizer, m) for m in held_out]
        print(f"{len(data)} training rows, {len(eval_data)} held out; LoRA rank {args.rank}, lr {args.lr}")
        eval_before = tc.forward(eval_data).result().metrics["loss:mean"] if eval_data else float("nan")

        losses = []
        for step in range(args.steps):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))  # on the wire before fb's result is back
            losses.append(fb.result().metrics["loss:mean"])
            opt.result()
            print(f"step {step:3d}  loss {losses[-1]:.4f}  [{timer}]")
        eval_after = tc.forward(eval_data).result().metrics["loss:mean"] if eval_data else float("nan")

        sampler = tc.save_weights_and_get_sampling_client("sft-final").result()
        print(f"trained weights published for sampling as {sampler.model_path}; greedy answers:")
        params = types.SamplingParams(max_tokens=32, temperature=0.0)
        shown = train[:2] + train[4:5] + held_out
        futures = [sampler.sample(types.ModelInput.from_ints(prompt_tokens(tokenizer, m[:-1])), 1, params)
                   for m in shown]
        exact = 0
        for m, fut in zip(shown, futures):
            answer = fut.result().sequences[0].text.strip()
            exact += answer == m[-1]["content"]
            tag = " (held out)" if m in held_out else ""
            print(f"  Q: {m[-2]['content']}{tag}\n  A: {answer}\n     expected: {m[-1]['content']}")
        tc.close()

    print(f"train loss {losses[0]:.3f} -> {losses[-1]:.3f} over {args.steps} steps; held-out loss "
          f"{eval_before:.3f} -> {eval_after:.3f}; {exact}/{len(shown)} sampled answers exact; done in {timer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
