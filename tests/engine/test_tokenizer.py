"""The `tokenizers`-only tokenizer (specfleet/tokenizer.py) against transformers' on the same directory.

`load_tokenizer` gives it only where it is exactly transformers' tokenizer; here every part of
the surface the services use must agree with `AutoTokenizer`'s for the bundled demo tokenizer
and the random models' one: encode, decode (of whole texts and of every single id, as streaming
decodes), the vocabulary, the special tokens, the fingerprint, the chat template. Directories it
does not cover load with transformers, and loading the fast one never imports transformers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from specfleet.tokenizer import load_tokenizer, tokenizer_fingerprint
from specfleet.tokenizer import MODEL_TYPES, Tokenizer
from tests.harness import REPO

DEMO = REPO / "models" / "demo" / "target"

TEXTS = [
    "",
    "The quick brown fox jumps over the lazy dog.",
    "Hello, world! How are you today?",
    " leading space, trailing space ",
    "Die Straße ist naß, und Bäume blühen früh. Übermäßig schön!",
    "L'été à Noël, où ça? Déjà vu: garçon, crème brûlée, naïve, Œuvre.",
    "¿Dónde está el niño? ¡Mañana comeré piña y jalapeños!",
    "Perché è così? Più caffè, città, università.",
    "def main(argv):\n    if argv:\n        return 0\n\treturn 1\n\n\nclass A:\n\tpass\n",
    '{"name": "specfleet", "items": [1, 2.5, null, true], "nested": {"a": "b\\n"}}',
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 ❤️ 🇩🇪",
    "     five spaces, then\n\n\n\nfour newlines\r\n and \t\ttabs   ",
    "\n",
    " ",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> <|endoftext",
    "<|endoftext|><|endoftext|>text",
    "日本語のテキストと中文文本。",
    "Mixed 123 numbers 4567890 and symbols #$%^&*()_+-=[]{}|;':\",./<>?",
]

MESSAGES = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, with an accent: é?"},
    ],
    [{"role": "user", "content": "Code:\n\tdef f():\n    return 1\n<|endoftext|>"}],
]


def _transformers(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.fixture(scope="module", params=["demo", "random"])
def both(request):
    """(fast, transformers') tokenizers of the demo target and of the random models' target."""
    path = DEMO if request.param == "demo" else request.getfixturevalue("random_family")["target"]
    fast = load_tokenizer(path)
    assert isinstance(fast, Tokenizer), f"{path} should load the fast tokenizer"
    return fast, _transformers(path)


def test_encode_and_decode_equal_transformers(both):
    fast, hf = both
    for text in TEXTS:
        for add_special_tokens in (True, False):
            ids = hf.encode(text, add_special_tokens=add_special_tokens)
            assert fast.encode(text, add_special_tokens=add_special_tokens) == ids, (text, add_special_tokens)
            for skip in (True, False):
                assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (text, skip)


def test_every_single_id_and_every_prefix_decodes_as_with_transformers(both):
    """Streaming decodes one id at a time, and growing prefixes of the output (router/request.py)."""
    fast, hf = both
    for i in range(len(hf)):
        for skip in (True, False):
            assert fast.decode([i], skip_special_tokens=skip) == hf.decode([i], skip_special_tokens=skip), (i, skip)
    ids = hf.encode("".join(TEXTS), add_special_tokens=False)
    for end in range(len(ids) + 1):
        assert fast.decode(ids[:end], skip_special_tokens=True) == hf.decode(ids[:end], skip_special_tokens=True), end


def test_vocabulary_special_tokens_and_fingerprint_equal_transformers(both):
    fast, hf = both
    every_id = list(range(len(hf)))
    assert len(fast) == len(hf)
    assert fast.convert_ids_to_tokens(every_id) == hf.convert_ids_to_tokens(every_id)
    assert fast.get_vocab() == hf.get_vocab()
    assert (fast.eos_token_id, fast.bos_token_id) == (hf.eos_token_id, hf.bos_token_id)
    assert tokenizer_fingerprint(fast) == tokenizer_fingerprint(hf)


def test_the_chat_template_renders_as_with_transformers():
    fast, hf = load_tokenizer(DEMO), _transformers(DEMO)
    assert fast.chat_template == hf.chat_template and hf.chat_template
    for messages in MESSAGES:
        for add_generation_prompt in (True, False):
            rendered = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt) == rendered


def test_no_chat_template_is_none_without_loading_transformers(random_family):
    fast = load_tokenizer(random_family["target"])
    assert fast.chat_template is None and _transformers(random_family["target"]).chat_template is None
    assert fast._transformers is None


def test_loading_the_fast_tokenizer_does_not_import_transformers():
    script = (
        "import sys\n"
        "from specfleet.tokenizer import load_tokenizer\n"
        "from specfleet.tokenizer import Tokenizer\n"
        "assert isinstance(load_tokenizer('models/demo/target'), Tokenizer)\n"
        "assert 'transformers' not in sys.modules, 'transformers was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]


def _copy(tmp_path, config=None, model_type="llama", files=None):
    """A copy of the demo target's tokenizer files, with tokenizer_config.json's entries `config` set (None removes one)."""
    out = tmp_path / "tokenizer"
    out.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(DEMO / name, out / name)
    settings = json.loads((out / "tokenizer_config.json").read_text())
    for key, value in (config or {}).items():
        if value is None:
            settings.pop(key, None)
        else:
            settings[key] = value
    (out / "tokenizer_config.json").write_text(json.dumps(settings))
    if model_type is not None:
        (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    for name, content in (files or {}).items():
        (out / name).write_text(json.dumps(content))
    return out


FALLBACKS = {
    "a model-specific tokenizer class": dict(config={"tokenizer_class": "LlamaTokenizerFast"}),
    "no tokenizer class": dict(config={"tokenizer_class": None}),
    "clean_up_tokenization_spaces": dict(config={"clean_up_tokenization_spaces": True}),
    "split_special_tokens": dict(config={"split_special_tokens": True}),
    "a model type whose own tokenizer class AutoTokenizer loads": dict(model_type="qwen2"),
    "an eos token that is not an added token": dict(config={"eos_token": "Hello"}),
    "an extra special token transformers adds": dict(config={"extra_special_tokens": ["<|new|>"]}),
    "added_tokens_decoder unlike tokenizer.json's": dict(
        config={
            "added_tokens_decoder": {
                "0": {"content": "<|endoftext|>", "lstrip": True, "rstrip": False, "single_word": False, "normalized": False, "special": True}
            }
        }
    ),
    "legacy added_tokens.json": dict(files={"added_tokens.json": {"<|new|>": 12288}}),
    "special_tokens_map.json with additional tokens": dict(files={"special_tokens_map.json": {"additional_special_tokens": ["<|new|>"]}}),
}


@pytest.mark.parametrize("case", FALLBACKS)
def test_directories_the_fast_tokenizer_does_not_cover_load_with_transformers(tmp_path, case):
    from transformers import PreTrainedTokenizerBase

    tokenizer = load_tokenizer(_copy(tmp_path, **FALLBACKS[case]))
    assert not isinstance(tokenizer, Tokenizer) and isinstance(tokenizer, PreTrainedTokenizerBase)


def test_a_tokenizer_json_that_truncates_loads_with_transformers(tmp_path):
    """The backend as read would truncate every encoding; transformers' encode does not unless asked."""
    from tokenizers import Tokenizer as Backend

    path = _copy(tmp_path)
    backend = Backend.from_file(str(path / "tokenizer.json"))
    backend.enable_truncation(4)
    backend.save(str(path / "tokenizer.json"))
    tokenizer = load_tokenizer(path)
    assert not isinstance(tokenizer, Tokenizer)
    assert len(tokenizer.encode(TEXTS[1])) > 4 == len(backend.encode(TEXTS[1]).ids)


def test_a_directory_transformers_refuses_is_refused_by_transformers(tmp_path):
    """A special token as a dict that is not a serialized AddedToken: transformers' error, not a tokenizer."""
    with pytest.raises(TypeError, match="eos_token"):
        load_tokenizer(_copy(tmp_path, config={"eos_token": {"content": "<|endoftext|>"}}))


def test_the_covered_variants_equal_transformers(tmp_path):
    """Special tokens as added-token dicts, added_tokens_decoder equal to tokenizer.json's, no config.json."""
    eos = {"content": "<|endoftext|>", "lstrip": False, "rstrip": False, "single_word": False, "normalized": False, "special": True}
    variants = {
        "dicts": dict(config={"eos_token": {"__type": "AddedToken", **eos}, "bos_token": None, "added_tokens_decoder": {"0": eos}}),
        "no config.json": dict(model_type=None),
        "qwen3": dict(model_type="qwen3"),
    }
    for name, variant in variants.items():
        path = _copy(tmp_path / name, **variant)
        fast, hf = load_tokenizer(path), _transformers(path)
        assert isinstance(fast, Tokenizer), name
        assert (fast.eos_token_id, fast.bos_token_id, len(fast)) == (hf.eos_token_id, hf.bos_token_id, len(hf)), name
        for text in TEXTS:
            ids = hf.encode(text)
            assert fast.encode(text) == ids and fast.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), (name, text)


def test_special_tokens_map_json_names_the_special_tokens_as_in_transformers(tmp_path):
    """The legacy special_tokens_map.json overrides tokenizer_config.json's special tokens, unless
    the config has added_tokens_decoder: transformers' precedence, whichever way it goes."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    backend = Backend.from_file(str(DEMO / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<|eot|>", special=True, normalized=False)])
    added = {
        str(i): {f: getattr(t, f) for f in ("content", "lstrip", "rstrip", "single_word", "normalized", "special")}
        for i, t in backend.get_added_tokens_decoder().items()
    }
    for name, config in {"map wins": {}, "config wins": {"added_tokens_decoder": added}}.items():
        path = _copy(tmp_path / name, config=config, files={"special_tokens_map.json": {"eos_token": {"content": "<|eot|>"}}})
        backend.save(str(path / "tokenizer.json"))
        fast, hf = load_tokenizer(path), _transformers(path)
        assert isinstance(fast, Tokenizer), name
        assert (fast.eos_token_id, fast.bos_token_id, len(fast)) == (hf.eos_token_id, hf.bos_token_id, len(hf)), name
        assert fast.eos_token_id == (backend.token_to_id("<|eot|>") if name == "map wins" else 0), name
        assert tokenizer_fingerprint(fast) == tokenizer_fingerprint(hf), name
        for text in ["a<|eot|>b<|endoftext|>c", *TEXTS]:
            ids = hf.encode(text)
            assert fast.encode(text) == ids and fast.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), (name, text)


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_autotokenizer_loads_the_declared_backend_class_for_the_model_types_covered(tmp_path, model_type):
    """MODEL_TYPES holds the model types whose config.json leaves AutoTokenizer on the class tokenizer_config.json names."""
    assert type(_transformers(_copy(tmp_path, model_type=model_type))).__name__ == "TokenizersBackend"
