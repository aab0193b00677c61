"""The router's own counters and learned state (`specfleet_router_*`) in Prometheus text format.

`specfleet/metrics.py` serves them on the router's /metrics after the `specfleet:*`
families, as text rendered from the state the router already keeps (`RouterMetrics`,
the learned routing state, the cost model).
"""

from __future__ import annotations


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels.items())
    return "{" + inner + "}"


def render(scheduler) -> str:
    """All router metrics, one `# TYPE` block per family."""
    m = scheduler.round.metrics
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        lines.append(f"# HELP specfleet_router_{name} {help_text}")
        lines.append(f"# TYPE specfleet_router_{name} {kind}")
        for labels, value in samples:
            lines.append(f"specfleet_router_{name}{_labels(**labels)} {value:g}")

    family("requests_running", "gauge", "Requests being generated.", [({}, scheduler.running)])
    family("requests_waiting", "gauge", "Requests queued for admission.", [({}, scheduler.waiting)])
    family("requests_finished_total", "counter", "Requests completed.", [({}, m.requests_finished)])
    family("requests_failed_total", "counter", "Requests that ended with an error.", [({}, m.requests_failed)])
    family("requests_cancelled_total", "counter", "Requests their clients cancelled, or gave up on at their deadline.", [({}, m.requests_cancelled)])
    family("rounds_total", "counter", "Draft-and-verify rounds.", [({}, m.rounds)])
    family("draft_tokens_total", "counter", "Draft tokens sent for verification.", [({}, m.draft_tokens)])
    family("accepted_tokens_total", "counter", "Draft tokens the target accepted.", [({}, m.accepted_tokens)])
    family("drafter_errors_total", "counter", "Failed drafter calls (the round decoded without drafts).", [({}, m.drafter_errors)])
    family("session_misses_total", "counter", "Sessions a server had lost and was sent again.", [({}, m.session_misses)])
    family("verify_busy_seconds_total", "counter", "Verifier compute time reported for this router's calls.", [({}, m.verify_busy_ms / 1e3)])
    by_domain = sorted(m.by_domain.items())
    family(
        "drafter_proposed_tokens_total", "counter", "Tokens each drafter proposed, per request domain.",
        [({"domain": d or "-", "drafter": dr}, c.draft_tokens) for (d, dr), c in by_domain],
    )
    family(
        "drafter_accepted_tokens_total", "counter", "Proposals of each drafter that matched the target's tokens, per domain.",
        [({"domain": d or "-", "drafter": dr}, c.accepted_tokens) for (d, dr), c in by_domain],
    )
    family(
        "routed_rounds_total", "counter", "Rounds in which each drafter led a request's drafting, per request domain.",
        [({"domain": d or "-", "drafter": dr}, n) for (d, dr), n in sorted(scheduler.round.router.led.items())],
    )
    expertise = sorted(scheduler.round.router.store.snapshot().items())
    family(
        "expertise_acceptance", "gauge", "Learned per-token acceptance (posterior mean without prior) per domain and drafter.",
        [
            ({"domain": d or "-", "drafter": dr}, e.accepted / (e.accepted + e.rejected))
            for (d, dr), e in expertise
            if e.accepted + e.rejected > 0
        ],
    )
    cost = scheduler.round.controller.cost
    family(
        "cost_model_ms", "gauge", "The fitted cost model used for adaptive speculation.",
        [
            ({"term": "verify_base"}, cost.verify_scale * cost.verify_base),
            ({"term": "verify_per_session"}, cost.verify_scale * cost.verify_per_session),
            ({"term": "verify_per_token"}, cost.verify_scale * cost.verify_per_token),
            ({"term": "draft_base"}, cost.draft_base),
            ({"term": "draft_per_token"}, cost.draft_per_token),
        ],
    )
    return "\n".join(lines) + "\n"

