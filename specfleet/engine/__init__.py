"""The model-execution layer: everything that touches a model's tensors lives here.

The verifier and the drafters hand it token ids and sessions and get back token
ids, probabilities or proposals; they create no tensors of their own.

    loading.py   load a checkpoint onto its device and dtype (`load_model`, `LoadedModel`)
    checkpoint.py config.json and safetensors read without transformers, where they state every field
    llama.py     the forward pass of every served family, plain tensor code
    cpu_linear.py linear weights laid out for a CPU's matmul kernels (`linear: auto`)
    kv.py        the paged KV pool, prefix caching and a session's cache (`KVPool`, `Session`)
    sessions.py  sessions by id under the KV budget, the session cap and an idle time (`SessionStore`)
    runner.py    batched passes over sessions: `forward_batch`, `prefill`, `tree_pass`, `next_token_logits`
    stack.py     same-shape models in one pass (a drafter service's specialists drafting together)
    parallel.py  tensor parallelism: a model split over ranks, rank 0 starting and driving the others (`rank.py`),
                 their messages and CPU collectives through shared memory (`shared_memory.py`)
    shaping.py   logits to what is sent: target tokens, shaped p and its noise, draft proposals
    guides.py    structured output: a session's grammar matcher and each row's allowed tokens (`GuideState`)
    sampling.py  the tensor math of sampling: shaping logits, seeded generators, the exponential race
"""

from specfleet.engine.guides import GuideState, session_guide
from specfleet.engine.kv import KVPool, Session
from specfleet.engine.sessions import SessionStore, UnknownSession
from specfleet.engine.loading import (
    DTYPES,
    TOKEN_MAP_FILE,
    LoadedModel,
    configure_torch,
    dtype_name,
    load_model,
    read_token_map,
    resolve_device,
)
from specfleet.engine.runner import ForwardItem, TreePass, forward_batch, next_token_logits, prefill, prefill_shares, tree_pass

__all__ = [
    "DTYPES",
    "TOKEN_MAP_FILE",
    "ForwardItem",
    "GuideState",
    "KVPool",
    "LoadedModel",
    "Session",
    "SessionStore",
    "TreePass",
    "UnknownSession",
    "configure_torch",
    "dtype_name",
    "forward_batch",
    "load_model",
    "next_token_logits",
    "prefill",
    "prefill_shares",
    "session_guide",
    "read_token_map",
    "resolve_device",
    "tree_pass",
]

# The tokenizer is shared with the router, which runs no model: specfleet/tokenizer.py.
