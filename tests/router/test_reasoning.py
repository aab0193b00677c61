"""router/reasoning.py with a real tokenizer: thought tags that are special tokens (Magistral's) keep their text in a
chat's output, where the server reads thoughts in them; tags that are ordinary text change nothing."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import tokenizers

from router.openai_api import OpenAIServer
from router.openai_schema import ChatRequest
from router.reasoning import TAGS, special_tags
from specfleet.tokenizer import load_tokenizer

# Magistral's templates write the tags in their default system prompt: "auto" reads [THINK] ... [/THINK].
TEMPLATE = (
    "[SYSTEM_PROMPT]Think first: [THINK]your thoughts[/THINK], then answer.[/SYSTEM_PROMPT]"
    "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
)


def _tokenizer(random_family, tmp_path, special: bool):
    """The random target's tokenizer with [THINK] and [/THINK] added, as special tokens or as ordinary ones."""
    path = tmp_path / ("special" if special else "plain")
    shutil.copytree(random_family["target"], path)
    backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    added = [tokenizers.AddedToken(tag, special=special) for tag in ("[THINK]", "[/THINK]")]
    (backend.add_special_tokens if special else backend.add_tokens)(added)
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(path)


@pytest.mark.parametrize("special", [True, False])
def test_special_thought_tags_keep_special_tokens_text_in_a_chat_s_output(random_family, tmp_path, special):
    tokenizer = _tokenizer(random_family, tmp_path, special)
    assert special_tags(tokenizer, TAGS["mistral"]) is special
    assert not special_tags(tokenizer, TAGS["think"]) and not special_tags(tokenizer, None)
    server = OpenAIServer(SimpleNamespace(tokenizer=tokenizer), "m")  # reasoning_parser "auto"
    assert server.thinks == TAGS["mistral"]
    body = ChatRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    (params,) = server._chat_params(body, 8, "[INST]hi[/INST]", "none")
    assert params.skip_special_tokens is not special
