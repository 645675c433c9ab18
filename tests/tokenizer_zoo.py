"""Tokenizers people bring, built small for tests: the `tokenizers` quick-tour BPE, WordLevel and Unigram with
the special tokens asked for (or none), and a Llama-style tokenizer.json (<s>/</s>, ▁ spaces, byte fallback)."""

from __future__ import annotations

import json

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

DOCS = [f"Story {i}: the little dog ran to the park and saw a red ball. It was happy, {i * 7} times." for i in
        range(120)]


def bpe(specials: list[str]) -> Tokenizer:
    """The `tokenizers` quick-tour BPE: whitespace pre-tokenizer, [UNK] and friends when asked."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]" if "[UNK]" in specials else None))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, show_progress=False))
    return tok


def word_level(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]" if "[UNK]" in specials else None))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=specials, show_progress=False))
    return tok


def unigram(specials: list[str]) -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=specials, show_progress=False,
                                      unk_token="<unk>" if "<unk>" in specials else None)
    tok.train_from_iterator(DOCS, trainer)
    return tok


def llama_style() -> Tokenizer:
    """Built like Llama/Mistral's tokenizer.json: <unk> <s> </s>, ▁ for spaces, byte-fallback tokens
    <0x00>..<0xFF>, and a post-processor that prepends <s> (which packing must not rely on)."""
    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    base.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"],
                                                       show_progress=False))
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    spec["pre_tokenizer"] = None
    spec["decoder"] = json.loads(decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ]).__getstate__())
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def byte_level(specials: list[str]) -> Tokenizer:
    """A GPT-2/Qwen2-style byte-level BPE (lossless: decode(encode(text)) == text) with the special tokens asked
    for, e.g. ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] for ChatML."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(DOCS, trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def save_folder(tok: Tokenizer, folder, tokenizer_config: dict) -> str:
    """`tok` saved as folder/tokenizer.json with a tokenizer_config.json beside it (a model folder's layout);
    returns the tokenizer.json path."""
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return str(folder / "tokenizer.json")


# Qwen2-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2-0.5B-Instruct) and its special tokens.
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN2_TOKENIZER_CONFIG = {"eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>",
                          "chat_template": QWEN2_TEMPLATE}
