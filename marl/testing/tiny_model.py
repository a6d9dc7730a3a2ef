"""Tiny random models with a real tokenizer and a real chat template, built offline in about a second.

Tests, benchmarks and `marl check-env` use these instead of downloading anything: a byte-level BPE tokenizer trained
on a small built-in corpus, ChatML special tokens and chat template (with tool support), and a randomly initialised
Llama. A swarm server serves and trains one like any model dir (`marl serve --model DIR`). Its replies are random
text: enough to play an env end to end (invalid replies, fallbacks and all), not to play it well.
`python -m marl.testing.tiny_model DIR` writes one to DIR.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# ChatML, as SmolLM2 and Qwen use it. Tools are rendered into the system turn in the Hermes style.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "You may call these tools. Reply with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n"
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if not (loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] if message['content'] is string else '' }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "<tool_call>{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments }}}</tool_call>"
    "{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A werewolf hides among the villagers at night.
The seer checks one player each night; the witch holds a potion to save and a potion to poison.
You are a helpful assistant. Answer in one word. Yes. No. Maybe. Player 1 votes for player 7.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100. What is 2 + 3? It is 5. Red green blue yellow.
{"name": "get_weather", "arguments": {"city": "Paris"}} <tool_call> </tool_call> system user assistant tool
"""


def build_tokenizer(vocab_size: int = 512, model_max_length: int = 2048, *,
                    extra_merges: tuple[tuple[str, str], ...] = ()):
    """A byte-level BPE tokenizer with ChatML special tokens, as a `PreTrainedTokenizerFast`.

    `extra_merges` (pairs of token strings, in the byte-level alphabet: " " is "Ġ") are appended after the trained
    merges, and the text is then no longer split at word and punctuation boundaries, so that a merge may join them
    (as `": {"`, one token in some real vocabularies)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 20, trainer=trainer)
    if extra_merges:
        tok = _with_merges(tok, extra_merges)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def _with_merges(tok, merges: tuple[tuple[str, str], ...]):
    from tokenizers import Tokenizer

    state = json.loads(tok.to_str())
    state["pre_tokenizer"]["use_regex"] = False
    vocab = state["model"]["vocab"]
    for left, right in merges:
        assert left in vocab and right in vocab, (left, right)
        state["model"]["merges"].append([left, right])
        vocab.setdefault(left + right, len(vocab))
    return Tokenizer.from_str(json.dumps(state))


def build_tiny_model(
    directory: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    vocab_size: int = 512,
    seed: int = 0,
    extra_merges: tuple[tuple[str, str], ...] = (),
) -> Path:
    """Write a randomly initialised Llama (about 0.1M-5M parameters) plus tokenizer to `directory`."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    directory = Path(directory)
    tokenizer = build_tokenizer(vocab_size, model_max_length=max_position_embeddings, extra_merges=extra_merges)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m marl.testing.tiny_model DIR")
    print(build_tiny_model(sys.argv[1]))
