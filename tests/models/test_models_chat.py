"""Chat prompts and SFT loss masks on the tiny model's ChatML template."""

import pytest

from models.chat import SftExample, encode_chat_prompt, tokenize_sft_example
from models.tokenizer import eos_token_ids, load_tokenizer

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 plus 3?"},
    {"role": "assistant", "content": "The answer is 5."},
    {"role": "user", "content": "And 4 plus 4?"},
    {"role": "assistant", "content": "The answer is 8."},
    {"role": "user", "content": "Thank you!"},
    {"role": "assistant", "content": "You are welcome, have a good day."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


def _masked_runs(tokenizer, example: SftExample) -> list[str]:
    """Decoded text of each maximal run of target tokens."""
    runs, current = [], []
    for token, mask in zip(example.input_ids + [None], example.loss_mask + [0]):
        if mask:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs


def test_only_assistant_turns_and_their_end_token_are_targets(tokenizer):
    example = tokenize_sft_example(tokenizer, {"messages": CONVERSATION}, max_seq_len=4096)
    assert len(example.input_ids) == len(example.loss_mask)
    assert _masked_runs(tokenizer, example) == [
        "The answer is 5.<|im_end|>", "The answer is 8.<|im_end|>", "You are welcome, have a good day.<|im_end|>",
    ]
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert tokenizer.decode(example.input_ids) == rendered
    # Everything else (system/user turns, role headers, the newline after <|im_end|>) is context only.
    unmasked = tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if not m])
    assert unmasked == rendered.replace("The answer is 5.<|im_end|>", "").replace(
        "The answer is 8.<|im_end|>", ""
    ).replace("You are welcome, have a good day.<|im_end|>", "")


def test_prompt_completion_masks_completion_and_eos(tokenizer):
    row = {"prompt": "What is 2 plus 3? ", "completion": "The answer is 5."}
    example = tokenize_sft_example(tokenizer, row, max_seq_len=4096)
    prompt_ids = tokenizer("What is 2 plus 3? ")["input_ids"]
    completion_ids = tokenizer("The answer is 5.", add_special_tokens=False)["input_ids"]
    assert example.input_ids == prompt_ids + completion_ids + [tokenizer.eos_token_id]
    assert example.loss_mask == [0] * len(prompt_ids) + [1] * (len(completion_ids) + 1)


def test_truncation_keeps_the_start(tokenizer):
    full = tokenize_sft_example(tokenizer, {"messages": CONVERSATION}, max_seq_len=4096)
    short = tokenize_sft_example(tokenizer, {"messages": CONVERSATION}, max_seq_len=30)
    assert short.input_ids == full.input_ids[:30] and short.loss_mask == full.loss_mask[:30]
    with pytest.raises(ValueError, match="max_seq_len must be >= 1"):
        tokenize_sft_example(tokenizer, {"messages": CONVERSATION}, max_seq_len=0)


def test_encode_chat_prompt_ends_with_generation_prompt(tokenizer):
    ids = encode_chat_prompt(tokenizer, CONVERSATION[:2])
    assert tokenizer.decode(ids) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_eos_ids_include_generation_config(tokenizer, tiny_model_dir):
    im_end, endoftext = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert eos_token_ids(tokenizer, tiny_model_dir) == [im_end, endoftext]


def test_bad_rows_and_templates_are_clear_errors(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    with pytest.raises(ValueError, match="either 'messages' or both 'prompt' and 'completion'"):
        tokenize_sft_example(tokenizer, {"text": "hi"}, max_seq_len=8)
    with pytest.raises(ValueError, match=r"messages\[1\] must be a dict with 'role' and 'content'"):
        tokenize_sft_example(tokenizer, {"messages": [CONVERSATION[0], {"role": "user"}]}, max_seq_len=8)
    # A template that renders the final turn differently from earlier ones is not prefix-consistent.
    tokenizer.chat_template = (
        "{%- for m in messages %}{%- if loop.last %}[final]{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(ValueError, match="does not render conversation prefixes consistently"):
        tokenize_sft_example(tokenizer, {"messages": CONVERSATION}, max_seq_len=4096)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="has no chat template"):
        encode_chat_prompt(tokenizer, CONVERSATION[:2])


def test_leading_assistant_turn_is_rejected(tokenizer):
    messages = [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Hi."}]
    with pytest.raises(ValueError, match="must start with a system or user message"):
        tokenize_sft_example(tokenizer, {"messages": messages}, max_seq_len=4096)
