"""A tiny Qwen3-style model directory built locally, for tests and the demo (no hub, no network).

The directory has everything a real Hugging Face chat model has: config.json, model.safetensors,
generation_config.json, and a byte-level BPE tokenizer (trained here on the small corpus below) with a ChatML chat
template. Building is fully reproducible: the same seed gives byte-identical files, so tests and demos can compare
checksums across machines.

    python -m models.tiny OUT_DIR
"""

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from models.checkpoint import save_pretrained
from models.families import family_for_config
from models.llama import ModelArgs

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)  # ids 0, 1, 2
VOCAB_SIZE = 1024
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
INIT_STD = 0.02

_CORPUS = """\
The quick brown fox jumps over the lazy dog while the sun sets behind the quiet hills.
A language model reads text one token at a time and learns to predict the next token.
Fine-tuning adapts a pretrained model to a new task with a small amount of labeled data.
The assistant answers questions clearly, politely and with short sentences.
The user asks a question and the assistant gives a helpful answer.
You are a helpful assistant. Please answer the question below.
Training runs for a number of steps, and the loss should go down as the model learns.
The learning rate controls how far each step moves the weights of the network.
A checkpoint stores the weights so that training can resume after a restart.
Low-rank adapters add a few small matrices to each layer instead of changing every weight.
Reinforcement learning rewards good answers and discourages bad ones.
The reward function checks whether the final answer is correct.
Sampling with a higher temperature gives more varied and surprising text.
Greedy decoding always picks the most likely next token.
The weather today is sunny with a light breeze from the west.
Tomorrow it will rain in the morning and clear up in the afternoon.
She walked to the market to buy apples, bread, cheese and fresh milk.
He cooked pasta with tomatoes, garlic, olive oil and a little salt.
The children played in the garden until it was time for dinner.
The library opens at nine in the morning and closes at six in the evening.
Water boils at one hundred degrees and freezes at zero degrees.
The cat slept on the warm windowsill for most of the afternoon.
Our team meets every Monday to plan the work for the week.
Please write a short summary of the article in three sentences.
Translate the following sentence into simple English.
Explain why the sky looks blue on a clear day.
Light from the sun is scattered by the air, and blue light is scattered the most.
Write a friendly email to thank a colleague for their help.
Thank you for your help with the report, it made a real difference.
List three ideas for a healthy breakfast.
Oatmeal with fruit, eggs with toast, and yogurt with honey are healthy choices.
How many days are there in a week? There are seven days in a week.
How many months are there in a year? There are twelve months in a year.
What is the capital of France? The capital of France is Paris.
What color is grass? Grass is green.
The train leaves the station at ten and arrives in the city at noon.
Keep your answers short, correct and kind.
If you do not know the answer, say that you are not sure.
The model was trained on a small dataset of questions and answers.
Good data matters more than a large number of training steps.
Every example has a prompt and a completion written by a person.
The evaluation set is kept separate from the training set.
Numbers, letters and punctuation are all turned into tokens.
A token can be a whole word, part of a word, or a single character.
The river flows through the valley and into the sea.
Birds sing in the trees early in the morning.
The old house at the end of the street has a red door.
They read books, wrote stories and painted pictures together.
It is important to drink water and get enough sleep.
The meeting was moved to Thursday afternoon at three.
Scientists measure temperature, pressure and humidity to understand the climate.
The orchestra rehearsed the symphony twice before the concert on Saturday.
Volunteers planted hundreds of trees along the riverbank last spring.
The museum exhibition displays sculptures, paintings and photographs from many centuries.
Engineers tested the bridge carefully before opening it to traffic.
The recipe requires flour, sugar, butter, eggs, vanilla and a pinch of cinnamon.
Astronomers observed a distant galaxy through a powerful telescope.
The committee approved the proposal after a long and thoughtful discussion.
Our neighbors adopted a playful puppy from the animal shelter.
The hospital hired additional nurses to support the emergency department.
Students practiced vocabulary, grammar and pronunciation every afternoon.
The farmer harvested potatoes, carrots, onions and cabbages before the frost.
Mathematics describes patterns, quantities, shapes and changes with precise symbols.
A triangle has three sides, a square has four sides, and a hexagon has six sides.
The programmer fixed the bug, reviewed the changes and deployed the update.
Customers appreciated the quick delivery and the excellent service.
The mountain path was steep, narrow and covered with loose stones.
Historians study letters, diaries, maps and newspapers to understand the past.
The village celebrates its harvest festival with music, dancing and traditional food.
Electricity flows through copper wires from the power station to our homes.
The journalist interviewed witnesses and verified every important detail.
Penguins, seals and whales live in the cold waters near Antarctica.
The airplane climbed above the clouds and turned toward the southern coast.
Good software documentation explains concepts, examples, limitations and errors.
The gardener pruned the roses, watered the vegetables and trimmed the hedge.
Musicians need patience, discipline and creativity to master their instruments.
The marathon runners drank water at every checkpoint along the route.
Children learn languages quickly when they hear them spoken every day.
The architect designed a building with large windows, wooden floors and a green roof.
Recycling paper, glass, plastic and metal reduces waste and saves energy.
The detective examined the footprints and found an important clue.
Chemistry explains how atoms combine to form molecules and compounds.
The baker wakes up before sunrise to prepare bread, rolls and pastries.
Thunderstorms bring lightning, heavy rain and sometimes strong winds.
The company published its annual report with revenue, profit and growth figures.
Reading novels improves imagination, empathy and concentration.
The volcano erupted, sending smoke and ash high into the atmosphere.
Doctors recommend regular exercise, balanced meals and enough rest.
The ship sailed across the Atlantic Ocean carrying passengers and cargo.
"""

_NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty"
).split()


# Word lists combined into simple sentences below, so every word occurs often enough to become a token.
_NOUNS = (
    "teacher student doctor farmer writer painter engineer scientist pilot baker driver singer dancer gardener "
    "neighbor friend mother father sister brother village mountain forest ocean island desert bridge castle "
    "kitchen window garden computer keyboard question answer problem solution picture letter journey festival "
    "morning evening winter summer spring autumn"
).split()
_ADJECTIVES = (
    "happy careful clever gentle patient curious brave quiet bright honest famous modern ancient simple "
    "beautiful strong friendly busy tired hungry"
).split()
_VERBS = (
    "visited painted described remembered explained discovered repaired noticed carried followed imagined "
    "answered watched helped finished started opened cleaned studied designed"
).split()


def _corpus_lines() -> list[str]:
    lines = _CORPUS.splitlines()
    for i, noun in enumerate(_NOUNS):
        for j in range(3):
            adjective = _ADJECTIVES[(i + 7 * j) % len(_ADJECTIVES)]
            verb = _VERBS[(3 * i + j) % len(_VERBS)]
            other = _NOUNS[(5 * i + 11 * j + 1) % len(_NOUNS)]
            lines.append(f"The {adjective} {noun} {verb} the {other} in the {_NOUNS[(i + j) % len(_NOUNS)]}.")
        lines.append(f"{noun.capitalize()}s are often {_ADJECTIVES[i % len(_ADJECTIVES)]}, but this {noun} is not.")
        lines.append(f"Why is the {noun} so {_ADJECTIVES[(i + 3) % len(_ADJECTIVES)]}? Nobody knows.")
    for a in range(11):
        for b in range(0, 11, 2):
            lines.append(f"What is {a} plus {b}? The answer is {a + b}.")
            lines.append(f"{_NUMBER_WORDS[a]} plus {_NUMBER_WORDS[b]} equals {_NUMBER_WORDS[a + b]}.")
    for role, text in (("user", "Hello, who are you?"), ("assistant", "I am a small helpful assistant.")):
        lines.append(f"{IM_START}{role}\n{text}{IM_END}\n")
    return lines


def train_tokenizer() -> Tokenizer:
    """Byte-level BPE (GPT-2 pre-tokenization, like Qwen and Llama 3) with the ChatML special tokens first."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus_lines(), trainer)
    return tokenizer


def _tokenizer_config(tokenizer: Tokenizer) -> dict:
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    return {
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 2048,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


_COMMON = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "bos_token_id": None,
    "eos_token_id": SPECIAL_TOKENS.index(IM_END),
    "pad_token_id": SPECIAL_TOKENS.index(ENDOFTEXT),
    "dtype": "float32",
}
# One tiny config per family: the dense Qwen3 the demo uses, a Qwen3-MoE and a DeepSeek-V3 (MLA + MoE) model.
TINY_CONFIGS = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "intermediate_size": 384,
              "num_key_value_heads": 2, "head_dim": 32},
    "qwen3_moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "intermediate_size": 384,
                  "num_key_value_heads": 2, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 96, "norm_topk_prob": True, "decoder_sparse_step": 1,
                  "mlp_only_layers": [0]},
    "deepseek_v3": {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "intermediate_size": 384,
                    "num_key_value_heads": 4, "moe_intermediate_size": 96, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "n_shared_experts": 1,
                    "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
                    "topk_method": "noaux_tc", "first_k_dense_replace": 1, "moe_layer_freq": 1, "q_lora_rank": 64,
                    "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32},
}


def tiny_config(vocab_size: int, family: str = "qwen3") -> dict:
    if family not in TINY_CONFIGS:
        raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join(TINY_CONFIGS)}")
    return {**_COMMON, **TINY_CONFIGS[family], "vocab_size": vocab_size}


def tiny_args(vocab_size: int) -> ModelArgs:
    return ModelArgs.from_hf_config(tiny_config(vocab_size))


# The embeddings (std INIT_STD) are tied to lm_head, which LoRA leaves frozen; with a unit final norm the logits
# stay within about +-2.6 and no adapter can push the loss much below 4.4. Pretrained models carry final-norm gains
# of several units; a gain of 4 lets the demo's LoRA memorize its data.
FINAL_NORM_GAIN = 4.0


def _init_weights(model: torch.nn.Module, seed: int) -> None:
    """Normal(0, INIT_STD) matrices, unit norms (FINAL_NORM_GAIN for the final one), drawn in a fixed order from one
    CPU generator."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "model.norm.weight":
                param.fill_(FINAL_NORM_GAIN)
            elif name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * INIT_STD)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# A larger random model on the tiny tokenizer, where compute rather than per-call overhead dominates (benchmarks).
QWEN3_H512_L8 = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
                 "head_dim": 64, "intermediate_size": 1536}


def build_tiny_model(out_dir: str | Path, seed: int = 0, family: str = "qwen3",
                     overrides: dict | None = None) -> Path:
    """Write the tiny model directory of a family (see TINY_CONFIGS) to out_dir (created if needed); return it.
    overrides replace config.json entries (e.g. QWEN3_H512_L8) before the weights are drawn."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _write_json(
        out / "special_tokens_map.json",
        {"additional_special_tokens": [IM_START, IM_END], "eos_token": IM_END, "pad_token": ENDOFTEXT},
    )
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    _write_json(
        out / "generation_config.json",
        {"eos_token_id": [ids[IM_END], ids[ENDOFTEXT]], "pad_token_id": ids[ENDOFTEXT], "do_sample": True},
    )
    config = {**tiny_config(tokenizer.get_vocab_size(), family), **(overrides or {})}
    spec = family_for_config(config)
    model = spec.CausalLM(spec.ModelArgs.from_hf_config(config))
    _init_weights(model, seed)
    save_pretrained(model, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the tiny Qwen3-style test model directory.")
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=list(TINY_CONFIGS), default="qwen3")
    args = parser.parse_args()
    print(build_tiny_model(args.out_dir, seed=args.seed, family=args.family))


if __name__ == "__main__":
    main()
