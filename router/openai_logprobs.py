"""Log-probabilities in the OpenAI API's shapes (router/openai_api.py): completions', chat's, an echoed prompt's, and
vLLM's prompt_logprobs. `name` gives a token's text in them (`token_text`)."""

from __future__ import annotations

from router.api import TokenLogprobs


def token_text(tokenizer, as_ids: bool):
    """A token id's name in logprobs: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
    return (lambda token_id: f"token_id:{token_id}") if as_ids else (lambda token_id: tokenizer.decode([token_id]))


def completion_logprobs(name, logprobs: list[TokenLogprobs], offset: int) -> dict:
    """The completions API's logprobs object for these tokens; `name` gives a token's text; text_offset counts from `offset`."""
    tokens = [name(lp.token_id) for lp in logprobs]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        # The chosen token and its alternatives, as vLLM and OpenAI list them.
        "top_logprobs": [{name(t.token_id): t.logprob for t in [*lp.top, lp]} for lp in logprobs],
        "text_offset": offsets,
    }


def echo_logprobs(name, prompt_ids: list[int], prompt: list[TokenLogprobs], top_n: int) -> dict:
    """The completions API's logprobs object for an echoed prompt (`prompt`: its tokens' past the first, which has none:
    nothing precedes it), `top_n` alternatives each; text_offset counts from 0."""
    logprobs = completion_logprobs(name, [TokenLogprobs(lp.token_id, lp.logprob, lp.top[:top_n]) for lp in prompt], 0)
    first = name(prompt_ids[0])
    return {
        "tokens": [first, *logprobs["tokens"]],
        "token_logprobs": [None, *logprobs["token_logprobs"]],
        "top_logprobs": [None, *logprobs["top_logprobs"]],
        "text_offset": [0, *(offset + len(first) for offset in logprobs["text_offset"])],
    }


def prompt_logprobs_json(name, prompt: list[TokenLogprobs] | None, top_n: int) -> list | None:
    """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: {logprob, rank, decoded_token}}
    for it and its position's `top_n` most likely tokens."""
    if prompt is None:
        return None

    def entry(logprob: float, rank: int, token_id: int) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": name(token_id)}

    return [
        None,
        *(
            {
                **{str(t.token_id): entry(t.logprob, rank, t.token_id) for rank, t in enumerate(lp.top[:top_n], start=1)},
                str(lp.token_id): entry(lp.logprob, lp.rank, lp.token_id),
            }
            for lp in prompt
        ),
    ]


def chat_logprobs(name, logprobs: list[TokenLogprobs]) -> dict:
    """The chat API's logprobs object for these tokens; `name` gives a token's text."""

    def entry(token_id: int, logprob: float) -> dict:
        token = name(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t.token_id, t.logprob) for t in lp.top]} for lp in logprobs]}
