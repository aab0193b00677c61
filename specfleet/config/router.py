"""The router's section: its own keys, and one section per component that the component takes whole.

In YAML every key sits directly under `router:` (`router.fusion_width`, `router.max_running`); in
code each component's keys are grouped in the section it is handed (`RouterConfig.routing` to the
`DrafterRouter`, `.speculation` to the cost model and the `SpeculationController`, `.scheduling` to
the scheduler, `.requests` to the front door's limits), so a reload replaces a section whole and a
default lives in one place. `router: {routing: {...}}` is read too.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass

from specfleet.config.fields import Check, above, at_least, knob, one_of, section
from specfleet.config.services import CORES, PORT

ROUTING_POLICIES = ("expertise", "fixed", "random", "oracle")
DOMAIN_PRIORS = ("likelihood", "exemplars")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "pythonic", "mistral", "none")
REASONING_PARSERS = ("auto", "think", "mistral", "none")


def chat_template_text(setting: str) -> str | None:
    """router.chat_template's template: the setting itself where it holds Jinja's `{{` or `{%`, else the text of the
    file it names; None where it is empty (the tokenizer's own)."""
    if not setting:
        return None
    return setting if "{{" in setting or "{%" in setting else pathlib.Path(setting).read_text()


def _chat_template_check(setting: str) -> str | None:
    if not setting or "{{" in setting or "{%" in setting or pathlib.Path(setting).is_file():
        return None
    return f"must be a chat template (Jinja, holding {{{{ or {{%) or the path of a file that holds one; no such file: {setting!r}"


@dataclass
class RequestLimitsConfig:
    """What a request may ask for (router/request.py `Limits`, checked by the front door)."""

    default_max_tokens: int = knob(64, "tokens generated when the request does not say (1 to max_tokens_limit)")
    max_tokens_limit: int = knob(2048, "the most tokens a request may ask for")
    num_draft_tokens: int = knob(4, "draft tokens per round when the request does not say (0 to max_draft_tokens)")
    max_draft_tokens: int = knob(16, "the most draft tokens per round a request may ask for")
    priority_scheduling: bool = knob(
        False,
        "admit waiting requests by their priority (lower first) ahead of clients' turns, as vLLM's --scheduling-policy "
        "priority; off: a request that sets a priority other than 0 is refused, so no client can jump the queue",
    )


@dataclass
class SchedulingConfig:
    """Admission and the lanes of rounds (router/rounds.py `SchedulerConfig`)."""

    max_running: int = knob(64, "requests generated at once; more wait in the queue", check=at_least(1))
    max_queued: int = knob(1024, "requests waiting; past it RESOURCE_EXHAUSTED", check=at_least(0))
    rpc_timeout_s: float = knob(60.0, "deadline of each internal RPC (draft and verify calls get shorter ones from the cost model)", check=above(0))
    pipeline_depth: int = knob(
        0,
        "groups of requests drafted and verified alternately (1: no pipelining); 0: the router chooses, 2 when some "
        "drafter can compute beside the verifier, else 1 (specfleet/placement.py)",
        check=Check(lambda v: v >= 0, "0 (the router chooses) or at least 1, got {value}"),
    )
    plain_steps: int = knob(
        8,
        "tokens a request decodes plainly in one verify call, one forward pass each, in a round where no request drafts "
        "(1: one a round); the verifier stops early at end of sequence or once another call waits for it (a new request's "
        "first round starts at once beside the lanes' rounds), and a request's first round decodes one, so its first token "
        "streams at once (docs/benchmarks/plain-steps.md)",
        check=Check(lambda v: 1 <= v <= 64, "between 1 and 64, got {value}"),
    )
    lookup_tokens: int = knob(
        4,
        "tokens each plain step may draft by n-gram lookup in the request's own context, verified in the same forward "
        "pass at the verifier (prompt lookup: repeating text advances several tokens a pass, with no drafter and no round "
        "trip; the output is the target's either way); capped by the request's max_draft_tokens, none where speculation "
        "is off; 0: plain steps decode one token a pass (docs/benchmarks/lookup.md)",
        check=Check(lambda v: 0 <= v <= 63, "between 0 and 63, got {value}"),
    )


@dataclass
class RoutingConfig:
    """Which drafters draft for a request (router/routing.py `DrafterRouter`)."""

    routing_policy: str = knob(
        "expertise",
        "expertise (learned online), fixed (default_drafter), random, or oracle (the specialist of the request's declared domain)",
        check=one_of(ROUTING_POLICIES),
    )
    default_drafter: str = knob("", "the drafter of the fixed policy and of requests nothing is known about")
    use_domain_hint: bool = knob(True, "take GenerateRequest.domain over the prompt classifier's guess")
    domain_prior: str = knob(
        "likelihood",
        "how a new request's domain is guessed: likelihood (each specialist scores the "
        "prompt while prefilling it, where adaptive speculation measures speculating ahead of plain decoding; the "
        "exemplars elsewhere) or exemplars (n-gram similarity to the exemplars)",
        check=one_of(DOMAIN_PRIORS),
    )
    exemplar_margin: float = knob(
        0.02,
        "with the likelihood prior, a prompt whose nearest exemplar's domain leads every other domain's by at least this "
        "cosine similarity takes that domain without specialists scoring it (0: every prompt is scored); how often the "
        "demo family's exemplars place prompts, and how rightly, at each margin: docs/benchmarks/exemplar-margin.md",
        check=Check(lambda v: 0 <= v <= 1, "a cosine similarity between 0 and 1, got {value}"),
    )
    fewer_models: bool = knob(
        True,
        "with expertise routing and adaptive speculation, a round moves requests to fewer distinct draft models where the "
        "cost model says that raises its goodput (each distinct model costs a step at every position); false: every request "
        "keeps the drafter routing chose",
    )
    fusion_width: int = knob(
        1,
        "cooperating drafters per request at most (1: no fusion); with expertise routing and adaptive speculation a round "
        "gives a request the helpers (drafters after its lead) whose expected extra tokens pay for their tree rows and "
        "model steps under the cost model, up to this many drafters in all (router/drafter_choice.py)",
        check=at_least(1),
    )
    fusion_below: float = knob(
        0.75, "with adaptive speculation off, the best drafter's expected acceptance below which it asks for help (fusion_width)"
    )
    fusion_depth: int = knob(
        0,
        "draft positions at which the cooperating drafters after the first propose (0: all k)",
        check=Check(lambda v: v >= 0, "0 (every position) or at least 1, got {value}"),
    )
    redis_url: str = knob("", "state router replicas share, learned expertise and stored responses: redis://host:port/db; empty: in-process state")
    expertise_decay: float = knob(
        0.995,
        "weight left on old routing evidence after each update (follows drifting traffic)",
        check=Check(lambda v: 0 < v <= 1, "must be in (0, 1], got {value}"),
    )


@dataclass
class SpeculationConfig:
    """How many tokens to draft (router/cost_model.py `CostModel`: its starting point; router/speculation.py `SpeculationController`)."""

    adaptive_speculation: bool = knob(
        True,
        "choose k per request and round from predicted acceptance and load, 0 for all (unrouted) while speculating measures "
        "slower than plain decoding; false: always num_draft_tokens",
    )
    stop_below_confidence: float = knob(0.0, "drafters stop once the product of their confidences falls below this (0: never)", check=at_least(0))
    verify_base_ms: float = knob(8.0, "cost model: a verification pass's fixed cost (a guess until profiled)", check=at_least(0))
    verify_per_session_ms: float = knob(0.0, "cost model: per session of a verification pass", check=at_least(0))
    verify_per_token_ms: float = knob(0.3, "cost model: per token fed to a verification pass", check=at_least(0))
    draft_per_token_ms: float = knob(1.0, "cost model: per draft step", check=at_least(0))
    draft_base_ms: float = knob(0.0, "cost model: a draft call's fixed cost", check=at_least(0))
    pin_cost_model: bool = knob(False, "keep the cost model as given: no profiling at start-up, no following online")
    remeasure_every: int = knob(
        32,
        "adaptive speculation decodes plainly while rounds that speculate (every round it routes) are measured slower than rounds "
        "decoded plainly, unrouted; once per this many rounds at a load it measures the other way (up to 16x as many while "
        "speculating keeps losing); 0: never falls back (drafting as the cost model plans)",
        check=at_least(0),
    )


@dataclass
class RouterConfig:
    host: str = knob("127.0.0.1", "the public gRPC API's listen address")
    port: int = knob(50051, "the public gRPC API's port")
    tokenizer: str = knob("", "tokenizer for prompts and output text; empty: the verifier's model directory")
    max_request_bytes: int = knob(
        4 * 1024 * 1024,
        "the largest request the public APIs read (bytes), refused before it is read: gRPC with RESOURCE_EXHAUSTED, HTTP with 413",
        check=at_least(1),
    )
    verifier_wait_s: float = knob(60.0, "how long a request waits for a live verifier replica before it fails with UNAVAILABLE", check=above(0))
    startup_timeout_s: float = knob(180.0, "how long start-up waits for the verifier and drafters to become healthy", check=above(0))
    metrics_port: int | None = knob(
        None,
        "Prometheus metrics at http://host:metrics_port/metrics; 0: off; unset: DEFAULT_METRICS_PORTS['router'] when free, else off with a warning",
        check=PORT,
    )
    http_port: int | None = knob(
        None,
        "the OpenAI-compatible HTTP API at http://host:http_port/v1; 0: off; unset: "
        "DEFAULT_HTTP_PORT when free, else off with a warning (a taken explicit port fails start-up)",
        check=PORT,
    )
    served_model_name: str = knob("", "the model name clients pass as `model` to the HTTP API; empty: the target directory's name")
    tool_call_parser: str = knob(
        "auto",
        'how the HTTP API reads tool calls from the text of a chat whose tool_choice is "auto" (router/tool_parsers.py): '
        "hermes (<tool_call>{...}</tool_call>: Qwen, Hermes), llama3_json (Llama 3.1 and later), pythonic ([f(x=1)]: "
        'Llama 3.2 and 4), mistral ([TOOL_CALLS]...), none ("auto" refused), auto: the one the target\'s chat template '
        "writes, else none",
        check=one_of(TOOL_CALL_PARSERS),
    )
    chat_template: str = knob(
        "",
        "the chat template the HTTP API renders chats with (vLLM's --chat-template), read at start-up: a Jinja file's path, "
        "or the template itself; empty: the tokenizer's own",
        check=_chat_template_check,
    )
    reasoning_parser: str = knob(
        "auto",
        "whether the HTTP API tells a reasoning model's thought from its answer (router/reasoning.py): think (the text "
        "between <think> and </think> is a chat reply's `reasoning`: DeepSeek R1, Qwen 3, QwQ), mistral (between [THINK] "
        "and [/THINK]: Magistral), none, auto: the one whose opening tag the target's chat template writes",
        check=one_of(REASONING_PARSERS),
    )
    response_store_mb: int = knob(
        64,
        "the memory the HTTP API keeps finished /v1/responses in (for previous_response_id and GET /v1/responses/{id}), "
        "the least recently used forgotten first; 0: none kept",
        check=at_least(0),
    )
    response_ttl_s: float = knob(
        30 * 24 * 3600.0,
        "with redis_url: how long Redis keeps a stored response, which every router replica then reads (OpenAI keeps them 30 days)",
        check=above(0),
    )
    cpus: list[int] = knob(
        doc="cores `specfleet serve` pins the router to (empty: any)",
        factory=list,
        expect=CORES,
        check=Check(lambda v: all(c >= 0 for c in v), CORES + ", got {value!r}"),
    )
    requests: RequestLimitsConfig = section(RequestLimitsConfig, "what a request may ask for", flat=True)
    scheduling: SchedulingConfig = section(SchedulingConfig, "admission and lanes", flat=True)
    routing: RoutingConfig = section(RoutingConfig, "which drafters draft", flat=True)
    speculation: SpeculationConfig = section(SpeculationConfig, "how many tokens to draft", flat=True)
