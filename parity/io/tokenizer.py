"""A byte-level BPE tokenizer built locally (no hub), saved as `tokenizer.json` + `tokenizer_config.json`.

Ids 0-3 are the special tokens `<|pad|>`, `<|bos|>`, `<|eos|>`, `<|kimi_image_placeholder|>` (matching the
configs' pad/bos/eos/media_placeholder ids); K3's chat-format tokens (`parity.io.chat_format`) follow the learned
merges, inside the vocab, and `tokenizer_config.json` carries the chat template. The merges are learned from a fixed
synthetic corpus (arithmetic, reversal and sorting prompts plus common English), so the same vocab size gives the
same file.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from parity.io.chat_format import CHAT_TEMPLATE, CHAT_TOKENS, IMAGE_PLACEHOLDER

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", IMAGE_PLACEHOLDER]

_WORDS = (
    "the of and to in is it that for on as with was be by this are or from at an which have not you all "
    "one two three four five six seven eight nine ten answer question sum add plus minus times reverse sort "
    "list digits number numbers string letters word words result compute what equals please give only "
    "model token train reward policy value step first last next before after small large tiny kimi"
).split()


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        word = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
        nums = " ".join(str(rng.randint(0, 99)) for _ in range(rng.randint(3, 6)))
        lines.append(f"What is {a} + {b}? Answer: {a + b}")
        lines.append(f"Reverse the string {word}. Answer: {word[::-1]}")
        lines.append(f"Sort the numbers {nums}. Answer: {' '.join(sorted(nums.split(), key=int))}")
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 15))).capitalize() + ".")
    return lines


def build_tokenizer(vocab_size: int, out_dir: str | Path) -> Tokenizer:
    """Train and save the tokenizer; `vocab_size` includes the special tokens, the chat tokens and the 256 byte
    tokens, and every id stays below it."""
    needed = 256 + len(SPECIAL_TOKENS) + len(CHAT_TOKENS)
    if vocab_size < needed:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level BPE with K3's chat tokens "
                         f"(needs >= {needed})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(CHAT_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CHAT_TOKENS])
    out = Path(out_dir)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({"pad_token": SPECIAL_TOKENS[0], "bos_token": SPECIAL_TOKENS[1], "eos_token": SPECIAL_TOKENS[2]}, indent=2)
    )
    return tok
