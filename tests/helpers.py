"""Reference outputs from the target model alone, for comparison with specfleet's."""

from __future__ import annotations

import functools

import torch

from specfleet.v1 import generation_pb2

PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "name: specfleet\nversion:",
    "Speculative decoding lets",
    "import os\nimport sys\n",
    "items:\n  - drafter\n",
    "if __name__ == '__main__':",
    "A large model verifies",
    "return 0",
    "over the lazy dog.",
    "version: 1",
    "def main(argv):",
    "small model propose tokens",
    "The",
    "x = [i for i in range(10)]",
    "# comment",
    "jumps over",
    "verifier:\n  model:",
    "print('hello')",
    "one pass.",
]


@functools.lru_cache(maxsize=4)
def load_target(path: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


def target_greedy(path: str, prompt: str, max_new_tokens: int) -> list[int]:
    """The target's own greedy `generate` (stops after end of sequence)."""
    return list(_target_greedy(str(path), prompt, max_new_tokens))


@functools.lru_cache(maxsize=None)
def _target_greedy(path: str, prompt: str, max_new_tokens: int) -> tuple[int, ...]:
    # Deterministic, and asked for again by many tests of one worker (the same prompts, lengths and models).
    model, tokenizer = load_target(path)
    ids = tokenizer.encode(prompt, add_special_tokens=False, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tuple(out[0, ids.shape[1] :].tolist())


def target_logprobs(path: str, prompt_ids: list[int], output_ids: list[int], top: int = 0) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """The target's own log-probabilities (transformers, one pass over prompt and output, no cache) of each
    output token, and each position's `top` most likely tokens with theirs."""
    model, _ = load_target(path)
    ids = torch.tensor([prompt_ids + output_ids])
    with torch.inference_mode():
        logp = model(ids).logits[0, len(prompt_ids) - 1 : -1].float().log_softmax(dim=-1)
    chosen = logp.gather(1, torch.tensor(output_ids).unsqueeze(1)).squeeze(1).tolist()
    best = logp.topk(top, dim=-1) if top else None
    return chosen, best.indices.tolist() if best else [], best.values.tolist() if best else []


def greedy_request(prompt: str, max_tokens: int, k: int = 0, **kwargs) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        speculation=generation_pb2.SpeculationOptions(max_draft_tokens=k),
        **kwargs,
    )
