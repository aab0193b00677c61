"""router/grpc_api.py: every field of the public GenerateRequest reaches the router's GenerationParams."""

from __future__ import annotations

import dataclasses

from router.api import GenerationParams
from router.grpc_api import params_of
from specfleet.v1 import common_pb2, generation_pb2


def test_every_generate_request_field_reaches_the_router_s_params():
    request = generation_pb2.GenerateRequest(
        prompt="hi",
        prompt_token_ids=[5],
        max_tokens=7,
        temperature=0.5,
        top_p=0.75,
        top_k=3,
        min_p=0.25,
        seed=9,
        stop=["x"],
        stop_at_eos=False,
        speculation=generation_pb2.SpeculationOptions(disabled=True, max_draft_tokens=2),
        domain="code",
        request_id="r",
        logprobs=True,
        top_logprobs=2,
        logit_bias={4: 1.5},
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.5,
        stop_token_ids=[3],
        min_tokens=2,
        prompt_logprobs=1,
        guide=common_pb2.Guide(kind="regex", spec="a+"),
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        allowed_token_ids=[6, 8],
        bad_words=["no"],
        truncate_prompt_tokens=5,
        priority=2,
        cache_salt="tenant",
        add_special_tokens=False,
    )
    params, defaults = params_of(request), GenerationParams()
    unset = [f.name for f in dataclasses.fields(GenerationParams) if getattr(params, f.name) == getattr(defaults, f.name)]
    assert not unset, unset
    assert (params.min_p, params.top_p, params.guide.spec) == (0.25, 0.75, "a+")
    assert (params.allowed_token_ids, params.bad_words) == ([6, 8], ["no"])
    # Every field of the message is set above: one the test leaves out would leave its parameter unchecked.
    assert {f.name for f, _ in request.ListFields()} == set(request.DESCRIPTOR.fields_by_name)
