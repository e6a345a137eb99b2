"""Byte-level BPE tokenizer trained on the shipped corpus, saved in the layout transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CORPUS_DIR = Path(__file__).with_name("corpus")
BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def corpus_lines() -> list[str]:
    """Every line of every corpus file, in a fixed order."""
    lines: list[str] = []
    for path in sorted(CORPUS_DIR.glob("*.txt")):
        lines.extend(path.read_text(encoding="utf-8").splitlines(keepends=True))
    return lines


def train(vocab_size: int) -> Tokenizer:
    """Train deterministically: same corpus and vocab size -> identical tokenizer.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def save(tokenizer: Tokenizer, out_dir: Path, max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(tok)): {"content": tok, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
        for tok in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_length, "added_tokens_decoder": added, "chat_template": CHAT_TEMPLATE,
    }
    write_json(out_dir / "tokenizer_config.json", config)
    write_json(out_dir / "special_tokens_map.json", {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD})


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")
