"""The verifier's and the drafter services' sections: what both share (`ServiceConfig`), then each one's own."""

from __future__ import annotations

import re
from dataclasses import dataclass

from specfleet.config.fields import Check, at_least, knob, one_of, redefault, required

# cpu, cuda, cuda:N (a GPU by index) or auto (cuda if torch sees one, else cpu).
DEVICE_PATTERN = re.compile(r"cpu|cuda(:\d+)?|auto")
# specfleet.engine.attention.ATTENTION_MODES, spelled out so that reading a config does not import torch.
ATTENTION_MODES = ("auto", "per-session", "batched", "kernel")
# specfleet.engine.cpu_linear.LINEAR_MODES, likewise.
LINEAR_MODES = ("auto", "transposed", "packed", "plain")
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")

DEVICE_CHECK = Check(lambda v: DEVICE_PATTERN.fullmatch(v), "must be cpu, cuda, cuda:N or auto, got {value!r}")
CORES = "a list of core numbers (0, 1, ...)"
PORT = Check(lambda v: v >= 0, "expected a port number (0: off) or null (the default), got {value!r}", "a port number (0: off) or null")


def _resources(resources: dict[str, float]) -> str | None:
    for name, amount in resources.items():
        if name in RESERVED_RESOURCES:
            return f".{name}: use num_cpus, num_gpus or memory_mb instead"
        if amount <= 0:
            return f".{name}: must be above 0, got {amount}"
    return None


@dataclass
class RayPlacement:
    """Where a service's Ray actor may run and how Ray treats it (`specfleet serve --ray`)."""

    num_cpus: float = knob(1.0, "CPUs Ray reserves for the actor", check=at_least(0))
    num_gpus: float = knob(
        0.0,
        "GPUs Ray reserves for the actor",
        check=Check(lambda v: v >= 0 and (v <= 1 or v == int(v)), "a fraction only below 1 (Ray's rule) and at least 0, got {value}"),
    )
    resources: dict[str, float] = knob(
        doc="custom node resources, e.g. {big_gpu: 1}: declared by `ray start --resources`, consumed by the actor",
        factory=dict,
        check=_resources,
        expect="expected a mapping of names to numbers",
    )
    label_selector: dict[str, str] = knob(
        doc="node labels the actor needs, e.g. {ray.io/accelerator-type: H100} (`ray start --labels`)",
        factory=dict,
        expect="expected a mapping of names to strings",
    )
    max_restarts: int = knob(
        3,
        "restarts after the actor's process or node dies (-1: without limit); each reloads the model",
        check=Check(lambda v: v >= -1, "-1 (no limit) or at least 0, got {value}"),
    )
    memory_mb: float = knob(0.0, "Ray's memory reservation for the actor in MB (0: none), for placement only", check=at_least(0))


@dataclass
class ServiceConfig:
    """What the verifier and every drafter service share: where they listen, where their models run, how they batch."""

    address: str = knob("127.0.0.1:50061", "where the router reaches it; the service listens on its port")
    replicas: list[str] = knob(
        doc="more replicas (same models and settings), by address: the router spreads requests over them and moves a dead "
        "one's requests on; `specfleet serve` starts one process per address (replica N: metrics on metrics_port + N)",
        factory=list,
        expect="a list of host:port addresses",
    )
    device: str = knob("cpu", "where the models run: cpu, cuda, cuda:N, or auto (cuda if torch sees one, else cpu)", check=DEVICE_CHECK)
    dtype: str = knob("float32", "the models' dtype on their device")
    attention: str = knob(
        "auto",
        "attention of a forward pass: batched (one call per layer for the whole batch, its KV gathered), per-session, "
        "kernel (one compiled call per layer on a CPU, float32), or auto: batched on a GPU, kernel on a CPU where it is "
        "built, else per session (docs/benchmarks/engine-forward-pass.md)",
        check=one_of(ATTENTION_MODES),
    )
    linear: str = knob(
        "auto",
        "linear layers on a CPU: auto lays each weight out for the CPU's kernels at load (a transposed copy for passes of "
        "up to the row count where it measured faster on this CPU, timed per weight shape at load, oneDNN's blocked "
        "layout for wider ones; float32; a second copy of the weights in memory: docs/benchmarks/engine-forward-pass.md), "
        "and where a weight's values are bfloat16s (a bfloat16 checkpoint), a bfloat16 copy that specfleet's own kernel "
        "reads at half the bytes, for passes of up to the rows where it measured fastest (built with the machine's C++ "
        "compiler on first use; without one, not used); "
        "transposed or packed lays them out and always takes that one; plain runs F.linear on the checkpoint's layout; "
        "ignored on a GPU",
        check=one_of(LINEAR_MODES),
    )
    threads: int = knob(1, "torch threads of the service", check=at_least(1))
    max_batch_size: int = knob(64, "dynamic batching: concurrent calls merged up to this many sessions", check=at_least(1))
    max_wait_ms: float = knob(0.0, "how long a batch waits after its first call (0: only what arrived while the previous ran)", check=at_least(0))
    max_cache_mb: float = knob(
        1024.0, "KV cache budget, counted in KV blocks; least recently used caches are dropped (rebuilt on use) past it", check=at_least(0)
    )
    max_model_len: int = knob(
        0,
        "positions a session may use (prompt, output and drafts), at most what each model allows; 0: all it allows. "
        "A session's KV takes blocks as it grows, so a long context costs only the sessions that use it",
        check=at_least(0),
    )
    kv_block_size: int = knob(16, "positions of a KV block: a session's KV memory is rounded up to whole blocks", check=at_least(1))
    enable_prefix_caching: bool = knob(
        True,
        "sessions whose tokens start the same way (a shared system prompt, a conversation's earlier turns) share the "
        "cached KV blocks of that prefix rather than computing it again (each model its own)",
    )
    max_prefill_tokens: int = knob(
        512,
        "chunked prefill: prompt positions one batch prefills at most; a longer prompt is prefilled over several "
        "rounds while the sessions already decoding keep their pace (a drafter service's session drafts nothing until "
        "its prompt is in; 0: no limit; docs/benchmarks/paged-kv.md)",
        check=at_least(0),
    )
    tensor_parallel_size: int = knob(
        1,
        "each model split over this many processes (ranks) with tensor parallelism, one device each (on GPUs: `device` "
        "and the next ones), NCCL between GPUs and shared memory between CPU ranks; its attention heads, key/value heads (or "
        "a multiple of them) and intermediate size must divide by it; max_cache_mb is then each rank's; a drafter service "
        "split so hosts one draft model (an n-gram one beside it); under Ray, each rank is an actor of `ray`'s placement, "
        "all N in one placement group on one node (specfleet/engine/parallel.py)",
        check=at_least(1),
    )
    max_sessions: int = knob(4096, "sessions whose token ids are kept at all; past it the oldest are forgotten", check=at_least(1))
    session_idle_s: float = knob(
        600.0,
        "a session no call has used for this long is forgotten, KV and token ids, so that a router that died without "
        "releasing its sessions leaves nothing held for long; a router that comes back resends them (0: never)",
        check=at_least(0),
    )
    max_call_sessions: int = knob(256, "sessions one call may carry (specfleet/limits.py); the router splits its calls to fit", check=at_least(1))
    max_call_tokens: int = knob(
        0,
        "context tokens summed over one call's sessions (kept prefix, new tokens, tree, drafts): bounds its compute and KV. "
        "0: 32768, or one session of the model's full context where that is more (a drafter service: the router keeps "
        "its calls within that, times router.fusion_width, and the service refuses only past max_call_sessions)",
        check=at_least(0),
    )
    cpus: list[int] = knob(
        doc="cores `specfleet serve` pins it to on this machine (empty: any); under --ray use `ray`",
        factory=list,
        expect=CORES,
        check=Check(lambda v: all(c >= 0 for c in v), CORES + ", got {value!r}"),
    )
    ray: RayPlacement | None = knob(None, "placement as a Ray actor (`specfleet serve --ray`); unset: RayPlacement's defaults")
    metrics_port: int | None = knob(
        None,
        "Prometheus metrics at http://host:metrics_port/metrics; 0: off; unset: DEFAULT_METRICS_PORTS of the service "
        "(a drafter service: plus its index in `drafters`) when free, else off with a warning",
        check=PORT,
    )

    def model_options(self) -> dict:
        """What this section sets of every model its service loads: `specfleet.engine.load_model`'s keywords."""
        return dict(
            dtype=self.dtype,
            attention=self.attention,
            linear=self.linear,
            max_model_len=self.max_model_len,
            kv_block_size=self.kv_block_size,
            prefix_caching=self.enable_prefix_caching,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    def addresses(self) -> list[str]:
        """Every replica's address; the first is `address`."""
        return [self.address, *self.replicas]


GRAPH_SIZES = "a list of [sessions, tokens] pairs of positive integers"


@dataclass
class VerifierConfig(ServiceConfig):
    model: str = knob("", "the target model's directory", check=required("the target model directory is required"))
    colocate: bool = knob(
        True,
        "where `specfleet serve` starts one verifier (no replicas, no --ray), run it in the router's process, which calls it "
        "without a socket and still serves its gRPC address (a crash then restarts both); false: always a process of its own",
    )
    cuda_graph_sizes: list[list[int]] = knob(
        doc="on a CUDA device: [sessions, tokens] buckets whose passes replay CUDA graphs (captured on first use), "
        "e.g. [[1, 1], [8, 5], [32, 5]]; other shapes and CPUs run eagerly",
        factory=list,
        expect=GRAPH_SIZES,
        check=Check(lambda v: all(len(s) == 2 and min(s) >= 1 for s in v), GRAPH_SIZES + ", got {value!r}"),
    )


DRAFT_KINDS = ("model", "ngram")


@dataclass
class DraftModelConfig:
    name: str = knob("", "the draft model's name (routing, metrics, router.default_drafter)")
    kind: str = knob(
        "model",
        "model: a checkpoint drafts; ngram: no model, proposals from n-gram statistics of the request's own tokens (drafter_service/ngram.py)",
        check=one_of(DRAFT_KINDS),
    )
    path: str = knob("", "its checkpoint directory; for kind ngram, a directory with the target's tokenizer (the target's own works)")
    ngram_max: int = knob(4, "kind ngram: the longest context suffix it looks up", check=at_least(1))
    ngram_min: int = knob(1, "kind ngram: the shortest suffix it looks up; below it (no earlier occurrence) it proposes nothing", check=at_least(1))
    ngram_matches: int = knob(
        16, "kind ngram: the most recent earlier occurrences of the matched suffix whose next tokens make its distribution", check=at_least(1)
    )
    specialities: list[str] = knob(doc="what it is good at (labels such as code, de, structured)", factory=list)
    exemplars: list[str] = knob(doc="texts typical of it, for routing prompts before anything is learned", factory=list)
    exemplars_file: str = knob("", 'more exemplars: a file of JSON lines with a "text" field')


@dataclass
class DrafterServiceConfig(ServiceConfig):
    address: str = redefault(ServiceConfig, "address", "127.0.0.1:50062")
    max_cache_mb: float = redefault(ServiceConfig, "max_cache_mb", 512.0)
    name: str = knob("", "the service's name (logs, metrics, `specfleet drafter --name`)", check=required())
    models: list[DraftModelConfig] = knob(doc="the draft models it hosts", factory=list, check=required("a drafter service needs at least one model"))
    proposal_top_k: int = knob(16, "entries kept in a sampled proposal's sparse distribution", check=at_least(1))
    stack_models: bool = knob(True, "draft models of one shape draft in one forward pass a step (specfleet/engine/stack.py)")
    colocate: bool = knob(
        True,
        "where `specfleet serve` runs the verifier in the router's process (verifier.colocate) and this service has no "
        "replicas and no cores of its own (its `cpus` empty or among the router's and verifier's), run this service there "
        "too, called without a socket, still serving its gRPC address",
    )
