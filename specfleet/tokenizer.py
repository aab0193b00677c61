"""A served model's tokenizer read with the `tokenizers` library alone, where that is exactly transformers' tokenizer.

Every service process (the verifier, each drafter, the router) loads a tokenizer at start. This
module imports no torch and no transformers, so the router starts without either.
Through `transformers.AutoTokenizer` that costs about 6 s of CPU (importing transformers, its
lazy modules, then the load); `tokenizers.Tokenizer.from_file` reads tokenizer.json in a
fraction of a second. `load_fast(path)` gives a `Tokenizer` over that backend when transformers
would load the same backend unchanged and read the same special tokens, and None otherwise
(`load_tokenizer` then loads transformers' own). `Tokenizer` has the surface the
services and the benchmark use: encode, decode, convert_ids_to_tokens, get_vocab, len,
eos_token_id, bos_token_id, chat_template and apply_chat_template.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pathlib

from tokenizers import Tokenizer as Backend

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"

# tokenizer_config.json's tokenizer_class values that transformers loads as `TokenizersBackend`
# (PreTrainedTokenizerFast is its alias): tokenizer.json's backend as it is. Model-specific classes
# (LlamaTokenizer, Qwen2Tokenizer, ...) may rebuild the backend from the vocabulary at load.
BACKEND_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")

# config.json's model_type values for which AutoTokenizer loads the class tokenizer_config.json
# names. For some others it loads the model's own class whatever the config says (qwen2 gets
# Qwen2Tokenizer), and Mistral checkpoints may get MistralCommonBackend. A directory without
# config.json (a tokenizer alone) is fine too.
MODEL_TYPES = ("llama", "qwen3")

NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
EXTRA_SPECIAL = ("extra_special_tokens", "additional_special_tokens")

# tokenizer_config.json keys the fast tokenizer accounts for: each either changes no id or string
# of encode/decode (bookkeeping, padding and truncation settings that only apply when asked for,
# the chat template, whose rendering stays transformers'), or is checked below (special and added
# tokens, clean_up_tokenization_spaces). Any other key (split_special_tokens, add_bos_token,
# fast_tokenizer_files, auto_map, model-specific *_token names, ...) is one transformers may act
# on at load, so such a directory loads with transformers.
KNOWN_KEYS = {
    "tokenizer_class",
    "backend",
    "is_local",
    "local_files_only",
    "name_or_path",
    "model_max_length",
    "padding_side",
    "truncation_side",
    "model_input_names",
    "clean_up_tokenization_spaces",
    "chat_template",
    "added_tokens_decoder",
    *NAMED_SPECIAL,
    *EXTRA_SPECIAL,
}

# The fields of an added token (tokenizer.json's added_tokens, tokenizer_config.json's added_tokens_decoder).
ADDED_TOKEN_FIELDS = ("content", "lstrip", "rstrip", "single_word", "normalized", "special")


def _content(token) -> str | None:
    """A special token's string: the config files write a string or an added token's fields (a dict with "content")."""
    return token.get("content") if isinstance(token, dict) else token


def _read_json(path: pathlib.Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def special_tokens(path: pathlib.Path, config: dict) -> dict:
    """The special-token entries transformers reads from a directory: tokenizer_config.json's, with
    special_tokens_map.json's over them where that (legacy) file exists and the config has no
    added_tokens_decoder; transformers gives the legacy file precedence in that case only."""
    tokens = {key: config[key] for key in (*NAMED_SPECIAL, *EXTRA_SPECIAL) if key in config}
    legacy = path / SPECIAL_TOKENS_MAP_FILE
    if "added_tokens_decoder" not in config and legacy.exists():
        tokens.update(_read_json(legacy))
    return tokens


def _file_refusal(path: pathlib.Path) -> str | None:
    """Why the directory's files alone mean transformers' tokenizer may differ from the backend as read; None if they do not."""
    if not (path / TOKENIZER_FILE).exists():
        return f"no {TOKENIZER_FILE}"
    if not (path / CONFIG_FILE).exists():
        return f"no {CONFIG_FILE}"
    config = _read_json(path / CONFIG_FILE)
    if config.get("tokenizer_class") not in BACKEND_CLASSES:
        return f"tokenizer_class is {config.get('tokenizer_class')!r}, not one of {', '.join(BACKEND_CLASSES)}"
    unknown = sorted(set(config) - KNOWN_KEYS)
    if unknown:
        return f"{CONFIG_FILE} sets {', '.join(unknown)}"
    if config.get("clean_up_tokenization_spaces"):
        # transformers' decode then rewrites the text (or, for BPE, warns and leaves it).
        return "clean_up_tokenization_spaces is true"
    if (path / "added_tokens.json").exists():
        return "added_tokens.json (legacy) adds tokens at load"
    if (path / "config.json").exists():
        model_type = _read_json(path / "config.json").get("model_type")
        if model_type not in MODEL_TYPES:
            return f"config.json's model_type {model_type!r} may make AutoTokenizer load a model-specific class"
    legacy = path / SPECIAL_TOKENS_MAP_FILE
    if "added_tokens_decoder" not in config and legacy.exists() and set(_read_json(legacy)) - set(NAMED_SPECIAL):
        return f"{SPECIAL_TOKENS_MAP_FILE} names more than {', '.join(NAMED_SPECIAL)}"
    for key in NAMED_SPECIAL:
        if isinstance(config.get(key), dict) and config[key].get("__type") != "AddedToken":
            # transformers takes a dict here only as a serialized AddedToken, and refuses other ones.
            return f"{key} is a dict but not an AddedToken's"
    for key in EXTRA_SPECIAL:
        if not isinstance(config.get(key, []), list) or not all(isinstance(t, str) for t in config.get(key, [])):
            return f"{key} is not a list of strings"
    return None


def _backend_refusal(tokenizer: Tokenizer) -> str | None:
    """Why transformers would change this backend at load (add tokens, change their flags, truncate or pad); None if it would not."""
    backend, config = tokenizer.backend, tokenizer.config
    if backend.truncation is not None or backend.padding is not None:
        return f"{TOKENIZER_FILE} sets truncation or padding"
    added = {index: {field: getattr(token, field) for field in ADDED_TOKEN_FIELDS} for index, token in backend.get_added_tokens_decoder().items()}
    by_content = {token["content"]: token for token in added.values()}
    if "added_tokens_decoder" in config:
        declared = {int(index): {field: token.get(field) for field in ADDED_TOKEN_FIELDS} for index, token in config["added_tokens_decoder"].items()}
        if declared != added:
            # transformers adds the config's tokens that differ, flags included, to the backend.
            return f"{CONFIG_FILE}'s added_tokens_decoder differs from {TOKENIZER_FILE}'s added_tokens"
    specials = tokenizer.special
    for key in NAMED_SPECIAL:
        token = specials.get(key)
        if token is None:
            continue
        have = by_content.get(_content(token))
        if have is None or not have["special"]:
            # transformers adds a named special token missing from the added tokens, as special.
            return f"{key} {_content(token)!r} is not a special added token of {TOKENIZER_FILE}"
        if isinstance(token, dict) and any(token.get(f, have[f]) != have[f] for f in ("lstrip", "rstrip", "single_word", "normalized")):
            return f"{key}'s flags differ from {TOKENIZER_FILE}'s"
    for key in EXTRA_SPECIAL:
        for token in specials.get(key, []):
            have = by_content.get(_content(token))
            # transformers (re)adds each as special and not normalized, which changes a token that is not so already.
            if have is None or not have["special"] or have["normalized"]:
                return f"{key}: {_content(token)!r} is not a special, unnormalized added token of {TOKENIZER_FILE}"
    return None


class Tokenizer:
    """tokenizer.json's backend with transformers' tokenizer's surface (what `load_fast` checks makes them equal)."""

    def __init__(self, path: str | pathlib.Path):
        self.path = pathlib.Path(path)
        self.backend = Backend.from_file(str(self.path / TOKENIZER_FILE))
        # What transformers sets from split_special_tokens, which is false unless the config sets it
        # (a key `load_fast` does not accept): special tokens in the text encode as themselves.
        self.backend.encode_special_tokens = False
        self.config = _read_json(self.path / CONFIG_FILE)
        self.special = special_tokens(self.path, self.config)
        self.eos_token_id = self._token_id(self.special.get("eos_token"))
        self.bos_token_id = self._token_id(self.special.get("bos_token"))
        self._transformers = None

    def _token_id(self, token) -> int | None:
        return None if token is None else self.backend.token_to_id(_content(token))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.backend.id_to_token(int(i)) for i in ids]

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # The chat template is rendered by transformers' own tokenizer, loaded on first use: its
    # rendering (the Jinja environment, its extensions and filters, the special tokens it passes,
    # raise_exception) is transformers' behaviour, which a copy here could only approximate. Only
    # the router renders chats, and only on a chat request.
    def _hf(self):
        if self._transformers is None:
            from transformers import AutoTokenizer

            self._transformers = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
        return self._transformers

    def _has_chat_template(self) -> bool:
        """Whether the directory holds a chat template where transformers reads one."""
        return (
            (self.path / "chat_template.jinja").exists()
            or any((self.path / "additional_chat_templates").glob("*.jinja"))
            or bool(self.config.get("chat_template"))
        )

    @property
    def chat_template(self):
        # None without loading transformers where there is no template to find.
        if self._transformers is None and not self._has_chat_template():
            return None
        return self._hf().chat_template

    @chat_template.setter
    def chat_template(self, template) -> None:
        self._hf().chat_template = template

    def apply_chat_template(
        self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = True, tools: list | None = None, **kwargs
    ):
        return self._hf().apply_chat_template(messages, tokenize=tokenize, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)


def load_fast(path: str | pathlib.Path) -> Tokenizer | None:
    """The directory's `Tokenizer`, or None where transformers' tokenizer could differ from it (the reason is logged)."""
    path = pathlib.Path(path)
    reason = _file_refusal(path)
    if reason is None:
        tokenizer = Tokenizer(path)
        reason = _backend_refusal(tokenizer)
        if reason is None:
            return tokenizer
    log.info("tokenizer at %s loads with transformers: %s", path, reason)
    return None


def load_tokenizer(path: str | pathlib.Path):
    """The tokenizer of a model directory: the `tokenizers`-only `Tokenizer` where it is exactly
    transformers' (`load_fast` checks the directory), else transformers' own.

    Every service process loads one at start, and transformers' costs about 6 s of CPU (the
    import is most of it), while the fast one reads tokenizer.json in a fraction of a second. So
    transformers is imported only for the directories the fast tokenizer does not cover:
    tokenizer classes that may rebuild the backend at load (Llama's, Qwen's),
    clean_up_tokenization_spaces, special tokens transformers adds, and the like.
    """
    fast = load_fast(path)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the vocabulary and special tokens: equal iff token ids mean the same strings."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = {"eos": tokenizer.eos_token_id, "bos": tokenizer.bos_token_id}
    payload = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(payload).hexdigest()[:16]
