"""DPO with the Training API: a custom loss through forward_backward_custom, on preference pairs.

    python examples/dpo_loop.py                           # embedded stack; under a minute on 2 CPU cores
    python examples/dpo_loop.py --steps 40 --beta 0.2 --data my_pairs.jsonl

Each row of --data (default examples/data/dpo_polite.jsonl) is {"prompt", "chosen", "rejected"}: here the chosen
answer is the polite one. Prompt and answers are rendered with the model's chat template; a datum's weights are 1
on the answer's tokens (and its end-of-turn token), 0 on the prompt, so a sequence's logprob lp is the sum of its
answer tokens' logprobs. The reference logprobs ref come from one forward of the initial model, before training.
DPO's loss per pair is

    -log sigmoid(beta * ((lp_chosen - ref_chosen) - (lp_rejected - ref_rejected)))

computed here with torch on the logprobs the trainer returns; forward_backward_custom turns it into the exact
gradient on the model's weights. Each step prints the loss, the reward margin (the mean of beta * (...) above) and
the accuracy (pairs whose margin is positive); held-out pairs are measured with forward before and after.

Services: by default the example starts its own embedded stack (SQLite, local processes; see _common.py). With
TRAINYARD_TRAINER_URL set it uses that stack instead (TRAINYARD_API_KEY, TRAINYARD_ROLLOUT_URL).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from _common import EXAMPLES, Timer, parser, service_client
from trainyard import types

HELD_OUT = 4  # the last rows of the data: measured, never trained on


def answer_datum(tokenizer, prompt: str, answer: str) -> types.Datum:
    """The prompt as a user turn, the answer as the assistant's; weight 1 on the answer's tokens."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    p = tokenizer.encode(text, add_special_tokens=False)
    a = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    tokens = p + a
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": tokens[1:], "weights": [0.0] * (len(p) - 1) + [1.0] * len(a)})


def pair_data(tokenizer, rows: list[dict]) -> list[types.Datum]:
    """chosen, rejected, chosen, rejected, ...: datum 2i is pair i's chosen answer, 2i + 1 its rejected one."""
    return [answer_datum(tokenizer, r["prompt"], r[key]) for r in rows for key in ("chosen", "rejected")]


def sequence_logprobs(data: list[types.Datum], logprobs: list) -> torch.Tensor:
    """Each datum's answer logprob: the sum of its tokens' logprobs weighted by its weights (the answer mask)."""
    return torch.stack([(torch.as_tensor(lp) * d.loss_fn_inputs["weights"].to_torch()).sum()
                        for d, lp in zip(data, logprobs)])


def dpo_loss(data: list[types.Datum], logprobs: list, ref: torch.Tensor,
             beta: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's loss, mean over the pairs, and its metrics; ref: the reference logprob of each datum's answer."""
    lp = sequence_logprobs(data, logprobs)
    chosen, rejected = beta * (lp[0::2] - ref[0::2]), beta * (lp[1::2] - ref[1::2])  # the implicit rewards
    margin = chosen - rejected
    loss = -F.logsigmoid(margin).mean()
    return loss, {"margin": margin.mean().detach(), "accuracy": (margin > 0).double().mean(),
                  "chosen_reward": chosen.mean().detach(), "rejected_reward": rejected.mean().detach()}


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0], steps=30)
    p.add_argument("--data", type=Path, default=EXAMPLES / "data" / "dpo_polite.jsonl",
                   help="preference pairs (JSONL: prompt, chosen, rejected)")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank")
    args = p.parse_args(argv)
    timer = Timer()
    rows = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    train_rows, held_rows = rows[:-HELD_OUT], rows[-HELD_OUT:]

    with service_client(args.work_dir) as service:
        tc = service.create_lora_training_client(args.base_model, rank=args.rank, seed=args.seed).result()
        tokenizer = tc.get_tokenizer()
        train, held = pair_data(tokenizer, train_rows), pair_data(tokenizer, held_rows)

        # The reference model is the initial one: one forward, before any step.
        ref = tc.forward(train + held).result()
        ref_lp = sequence_logprobs(train + held, [o["logprobs"].to_torch() for o in ref.loss_fn_outputs])
        ref_train, ref_held = ref_lp[:len(train)], ref_lp[len(train):]

        def loss_fn(data, logprobs):  # forward_backward_custom's contract: (loss, metrics) from the logprobs
            return dpo_loss(data, logprobs, ref_train, args.beta)

        print(f"{len(train_rows)} training pairs, {len(held_rows)} held out; LoRA rank {args.rank}, lr {args.lr}, "
              f"beta {args.beta}")

        history = []
        for step in range(args.steps):
            fb = tc.forward_backward_custom(train, loss_fn)
            opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
            m = fb.result().metrics
            opt.result()
            history.append(m)
            print(f"step {step:3d}  dpo loss {m['loss']:.4f}  margin {m['margin']:+.3f}  accuracy "
                  f"{m['accuracy']:.2f}  chosen {m['chosen_reward']:+.3f}  rejected {m['rejected_reward']:+.3f}  "
                  f"[{timer}]")

        out = tc.forward(held).result()  # held-out pairs, with the trained weights
        loss, hm = dpo_loss(held, [o["logprobs"].to_torch() for o in out.loss_fn_outputs], ref_held, args.beta)
        tc.close()

    first, last = history[0], history[-1]
    print(f"training pairs: dpo loss {first['loss']:.3f} -> {last['loss']:.3f}, margin {first['margin']:+.3f} -> "
          f"{last['margin']:+.3f}, accuracy {first['accuracy']:.2f} -> {last['accuracy']:.2f}; held-out pairs: "
          f"dpo loss {np.log(2):.3f} -> {float(loss):.3f}, margin +0.000 -> {float(hm['margin']):+.3f}, accuracy "
          f"{float(hm['accuracy']):.2f}; done in {timer}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
