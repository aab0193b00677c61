"""Seeding the cost model at start-up: timed verify and draft passes of a few sizes (router/speculation.py
fits them), so that the first rounds plan with this machine's costs rather than a guess."""

from __future__ import annotations

import logging

from router import messages
from router.cost_model import CATCH_UP_TOKENS, CostModel
from router.transport import point_mass
from specfleet import limits
from specfleet.sampling import SamplingParams

log = logging.getLogger("router.server")


async def profile_costs(
    verifier, drafters: dict, cost: CostModel, token: int, max_context: int, verify_limits: limits.CallLimits = limits.CallLimits()
) -> None:
    """Seed the cost model with timed passes of different sizes.

    Verification: sessions with a context, each verifying a chain of 0 or 4 tokens, at
    1, 4 and 16 sessions a pass (fewer where the verifier's per-call limits say so), the
    fastest of two tries each (`CostModel.fit_verify`). Drafting, per drafter service: a
    session drafting 1 and 4 tokens from one token, then one drafting a token after catching
    up on a whole context (`CostModel.observe_draft`).
    """
    sampling = SamplingParams(temperature=0.0, top_p=1.0)
    context = max(1, min(64, max_context // 4))
    most = max(1, min(verify_limits.sessions, verify_limits.tokens // (context + 4)))
    timed: dict[tuple[int, int], float] = {}
    for n in sorted({min(n, most) for n in (1, 4, 16)}):
        ids = [f"profile-{n}-{i}" for i in range(n)]

        def request(depth: int, first: bool) -> list[messages.VerifySession]:
            """The first call sends the contexts; later ones roll back to them and verify `depth` tokens."""

            def sync(sid: str) -> messages.SessionSync:
                if first:
                    return messages.SessionSync(session_id=sid, new_token_ids=[token] * context)
                return messages.SessionSync(session_id=sid, prefix_length=context)

            tree = messages.TokenTree(
                token_ids=[token] * depth,
                parents=list(range(-1, depth - 1)),
                proposals=[point_mass(token)] * depth,
            )
            return [messages.VerifySession(sync=sync(sid), tree=tree, sampling=sampling) for sid in ids]

        await verifier.verify(request(0, first=True), 60)  # prefills the contexts
        for _ in range(2):
            for depth in (0, 4):
                reply = await verifier.verify(request(depth, first=False), 60)
                key = (n, n * (depth + 1))
                timed[key] = min(timed.get(key, float("inf")), reply.compute_ms)
        await verifier.release(ids)
    cost.fit_verify([(n, tokens, ms) for (n, tokens), ms in timed.items()])
    for name, service in drafters.items():
        transport = service.replicas[0]
        for depth in (1, 4):  # two depths separate a call's fixed part from its per-token part
            session = messages.DraftSession(
                sync=messages.SessionSync(session_id="profile", new_token_ids=[token]), model=name, num_draft_tokens=depth, sampling=sampling
            )
            reply = await transport.draft([session], 60)
            cost.observe_draft(depth, reply.compute_ms)
            await transport.release(["profile"])
        if context - 1 < CATCH_UP_TOKENS:
            continue  # too short a context to tell a catch-up from a call's base
        # A session that lacks a context: what catching a drafter up costs a token (after the steps' fit above).
        session = messages.DraftSession(
            sync=messages.SessionSync(session_id="profile", new_token_ids=[token] * context), model=name, num_draft_tokens=1, sampling=sampling
        )
        reply = await transport.draft([session], 60)
        cost.observe_draft(1, reply.compute_ms, caught_up=context - 1)
        await transport.release(["profile"])
    log.info(
        "cost model: verify %.2f ms + %.3f ms/session + %.3f ms/token, draft %.2f ms + %.2f ms/token, catching up %.3f ms/token",
        cost.verify_base,
        cost.verify_per_session,
        cost.verify_per_token,
        cost.draft_base,
        cost.draft_per_token,
        cost.draft_catch_up_per_token,
    )
