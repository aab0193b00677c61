"""Byte-level BPE tokenizer for the demo models (lossless: decode(encode(x)) == x)."""

from __future__ import annotations

from pathlib import Path

from .corpus import DOMAINS, load_split

EOS = "<|endoftext|>"
# The demo models are not trained on chats; this plain template only lets the OpenAI API's
# /v1/chat/completions turn messages into a prompt. It is not part of the tokenizer's
# fingerprint (specfleet.tokenizer.tokenizer_fingerprint: vocabulary and special tokens only).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(corpus: Path, out_dir: Path, vocab_size: int = 8192, sample_chars: int = 1_500_000):
    """Train on (a sample of) every domain's train split; save as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if (out_dir / "tokenizer.json").exists():
        return load_tokenizer(out_dir)
    texts: list[str] = []
    for d in DOMAINS:
        n = 0
        for t in load_split(corpus, d, "train"):
            if n >= sample_chars:
                break
            texts.append(t)
            n += len(t)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        unk_token=None,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    return load_tokenizer(out_dir)


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def roundtrip_ok(tok, text: str) -> bool:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return tok.decode(ids, clean_up_tokenization_spaces=False) == text
