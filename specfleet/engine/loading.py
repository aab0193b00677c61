"""Loading a served model onto its device: weights, tokenizer, dtype, the draft token map.

`load_model` reads a Hugging Face checkpoint of a supported family
(`llama.check_supported`), directly (`checkpoint.py`) or with `transformers` where
only it knows a default, takes its weights into the plain-tensor form
`llama.forward` runs (`LoadedModel.model`), on the device and in the dtype the
service's config names.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specfleet.engine import checkpoint, cpu_kernels, cpu_linear, cpu_pass, kv, llama, parallel
from specfleet.engine.attention import ATTENTION_MODES, kernel_attends
from specfleet.engine.kv import KVPool
from specfleet.engine.llama import LlamaModel, check_supported, from_weights
from specfleet.guides import GuideCompiler
from specfleet.guides import available as guides_available
from specfleet.tokenizer import load_tokenizer, tokenizer_fingerprint

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The config's name of a torch dtype (float32, bfloat16, float16)."""
    return next((name for name, d in DTYPES.items() if d == dtype), str(dtype).removeprefix("torch."))


def resolve_device(device: str) -> torch.device:
    """cpu, cuda, cuda:N, or auto (cuda if torch sees one, else cpu); raises ValueError when it does not exist here.

    Services check their config's `device` with `specfleet.config.resolve_device` first, which
    names the setting; this is the same check for direct callers (tests, benchmarks).
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for but torch sees no CUDA device (torch.cuda.is_available() is False)")
    return resolved


def configure_torch(threads: int) -> None:
    # One thread per model process: with two threads and another busy process on a
    # 2-core machine, latency spiked 10-100x.
    torch.set_num_threads(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@dataclass
class LoadedModel:
    name: str
    path: str
    model: LlamaModel
    tokenizer: object
    fingerprint: str
    vocab_size: int
    max_context: int
    eos_token_id: int
    parameters: int
    # Draft models only: the vocabulary ids the output layer scores (see `load_model`), or None for all.
    token_map: torch.Tensor | None = None  # [V'] int64, global ids in the order of the logits
    local_index: torch.Tensor | None = None  # [vocab] int64: position in token_map, -1 if absent
    # The KV memory of this model's sessions: blocks of kv_block_size positions on the model's device.
    pool: KVPool = field(init=False)
    guides: GuideCompiler = field(init=False)
    kv_block_size: int = kv.BLOCK_SIZE
    # Whether sessions share the cached blocks their tokens start with (`kv.KVPool`).
    prefix_caching: bool = False
    # CUDA graphs of batched passes (`graphs.CudaGraphs`), or None: every pass eager.
    graphs: object | None = None
    # How linear layers run on a CPU (`cpu_linear.LINEAR_MODES`): all but plain lay them out for its kernels in `prepare`.
    linear: str = "plain"

    def __post_init__(self):
        # Structured output's grammars, compiled for this model's tokenizer and vocabulary on first use.
        self.guides = GuideCompiler(self.tokenizer, self.vocab_size, self.eos_token_id)
        self.pool = KVPool(self.model, self.kv_block_size, prefix_caching=self.prefix_caching)
        if self.model.parallel is not None and self.model.parallel.rank == 0:
            self.pool.log = []  # the other ranks replay its copies (`parallel.py`)

    @property
    def ranks(self) -> list:
        """Rank 0 of a split model: its other ranks (`parallel.Group.workers`); otherwise none."""
        group = self.model.parallel
        return group.workers if group is not None and group.rank == 0 else []

    def close(self) -> None:
        """Stop the model's other tensor-parallel ranks, if it has any (rank 0)."""
        if self.model.parallel is not None and self.model.parallel.rank == 0:
            self.model.parallel.close()

    def prepare(self, max_cache_bytes: int, max_sessions: int) -> None:
        """Before serving, once: on a CPU with `linear` other than plain, lay the linear weights out for its kernels
        (`cpu_linear.py`), and on any CPU build the compiled kernels if that did not (`cpu_kernels.py`: a seeded
        request's race takes them); with CUDA graphs, size the KV pool for the cache budget (its tensor then
        stays, so the graphs stay valid) and capture every graph. A stack's members are not prepared
        (their weights are views of the stack's). Tensor parallelism's rank 0 has the other ranks prepare too."""
        if self.model.parallel is not None and self.model.parallel.rank == 0:
            self.model.parallel.send(("prepare", max_cache_bytes, max_sessions))
        if self.linear != "plain" and self.model.device.type == "cpu" and cpu_linear.available(self.model.dtype):
            added, rows = cpu_linear.lay_out(self.model, self.linear)
            self.model.cpu_pass = cpu_pass.prepare(self.model)
            log.info(
                "model %s: linear layers laid out for the CPU's kernels (%.1f MB more memory); per weight shape, rows the "
                "bfloat16 copy serves (in a pass of every layer in one call), then W^T, oneDNN's layout more: %s; that pass "
                "serves %s rows",
                self.name,
                added / 2**20,
                ", ".join(f"{'x'.join(map(str, shape))}: {b} ({p}), {t}" for shape, (t, b, p) in rows.items()),
                "no" if self.model.cpu_pass is None else f"1-{self.model.cpu_pass.max_rows}",
            )
        if self.model.device.type == "cpu":
            cpu_kernels.library()  # built here if nothing above built it: a seeded request's race uses it, not a compile
        if self.graphs is None:
            return
        per_session = -(-self.max_context // self.pool.block_size)
        self.pool.reserve(1 + min(max_sessions * per_session, max_cache_bytes // self.pool.block_bytes))  # + the scratch block
        self.graphs.capture_all()

    def global_ids(self, local: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of positions along the logits' last dimension."""
        return local if self.token_map is None else self.token_map[local.to(self.token_map.device)]

    def info(self):
        """This model as the contract's ModelInfo (what GetInfo answers)."""
        from specfleet.v1 import common_pb2

        return common_pb2.ModelInfo(
            name=self.name,
            path=self.path,
            vocab_size=self.vocab_size,
            max_context=self.max_context,
            eos_token_id=self.eos_token_id,
            tokenizer_fingerprint=self.fingerprint,
            parameters=self.parameters,
            device=str(self.model.device),
            dtype=dtype_name(self.model.dtype),
            attention=self.model.attention,
            structured_output=guides_available(),
        )


TOKEN_MAP_FILE = "token_map.json"


def _checked(name: str, path: pathlib.Path, dtype: str, attention: str, device: str) -> str:
    """The torch device to load onto, once the directory, dtype, attention mode and device are known to be usable."""
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"model '{name}': no config.json in {path}; expected a Hugging Face model directory")
    if dtype not in DTYPES:
        raise ValueError(f"model '{name}': dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if attention not in ATTENTION_MODES:
        raise ValueError(f"model '{name}': attention must be one of {list(ATTENTION_MODES)}, got {attention!r}")
    try:
        return resolve_device(str(device))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"model '{name}': {e}") from None


def load_model(
    name: str,
    path: str | os.PathLike,
    dtype: str = "float32",
    device: str = "cpu",
    use_token_map: bool = False,
    attention: str = "auto",
    cuda_graph_sizes: list[list[int]] | None = None,
    linear: str = "plain",
    max_model_len: int = 0,
    kv_block_size: int = kv.BLOCK_SIZE,
    prefix_caching: bool = False,
    tensor_parallel_size: int = 1,
    group: parallel.Group | None = None,
    start_ranks: Callable[[list[str]], list] | None = None,
) -> LoadedModel:
    """Load a Hugging Face Llama-family causal LM and its tokenizer from a local directory, offline.

    use_token_map (drafters only): if the directory has `token_map.json`, a JSON list of
    vocabulary ids, the output layer keeps only those rows (FR-Spec's frequency-ranked
    draft vocabulary; SGLang's speculative token map). On a small drafter the output
    layer is most of a step's cost, and the target's tokens rarely fall outside the few
    thousand most frequent ones. Proposals are then distributions over those ids, which
    is still exactly what they were drawn from, so verification stays lossless; a token
    outside the map can only be reached as the target's correction. The target never
    uses one: its distribution must be whole.

    cuda_graph_sizes: [sessions, tokens] buckets whose passes replay CUDA graphs (`graphs.py`)
    when the model runs on a CUDA device; ignored on a CPU.

    linear: `cpu_linear.LINEAR_MODES`; `auto` takes effect in `LoadedModel.prepare`, on a CPU.

    max_model_len: positions a session may use (0: all the model allows, `llama.context_limit`);
    more than the model allows is refused. kv_block_size: positions of a KV block (`kv.KVPool`).
    prefix_caching: sessions share the cached blocks their tokens start with (`kv.KVPool`).

    tensor_parallel_size: the model split over this many processes (`parallel.py`), this one rank 0, which
    starts the others: child processes, on GPUs one device each from `device` on, or with `start_ranks` as
    `parallel.launch` says (a Ray actor's: `ray_ranks.start`). `group`: this process is a rank of a group already
    joined (what those other ranks pass).
    """
    if linear not in cpu_linear.LINEAR_MODES:
        raise ValueError(f"model '{name}': linear must be one of {list(cpu_linear.LINEAR_MODES)}, got {linear!r}")
    path = pathlib.Path(path)
    configured = device
    device = _checked(name, path, dtype, attention, device)
    started = time.perf_counter()
    tokenizer = load_tokenizer(path)
    # The keywords every rank loads with (the others get them in their spec).
    options = dict(dtype=dtype, device=str(configured), use_token_map=use_token_map, attention=attention, linear=linear)
    options.update(cuda_graph_sizes=cuda_graph_sizes, max_model_len=max_model_len, kv_block_size=kv_block_size, prefix_caching=prefix_caching)
    if tensor_parallel_size > 1 and group is None:
        try:
            parallel.check_divisible(_read_config(path), tensor_parallel_size)
        except ValueError as e:
            raise ValueError(f"model '{name}' at {path}: {e}") from None
        # Started elsewhere, each rank has a device of its own (`parallel.launch`); otherwise this process sees them all.
        if device.type == "cuda" and start_ranks is None and (device.index or 0) + tensor_parallel_size > torch.cuda.device_count():
            raise ValueError(
                f"model '{name}': tensor_parallel_size {tensor_parallel_size} needs a GPU a rank from {device} on; "
                f"torch sees {torch.cuda.device_count()}"
            )
        spec = dict(name=name, path=str(path), threads=torch.get_num_threads(), **options)
        group = parallel.launch(spec, tensor_parallel_size, device, start=start_ranks)
        try:
            return _build(name, path, tokenizer, device, group, started, options)
        except BaseException:
            group.abandon()  # the ranks wait for this one to be ready: end them, and leave nothing in /dev/shm
            raise
    return _build(name, path, tokenizer, device, group, started, options)


def _build(name: str, path: pathlib.Path, tokenizer, device, group: parallel.Group | None, started: float, options: dict) -> LoadedModel:
    """`load_model` from its weights on: this process's model (with `group`, its rank's slices), as `options` say."""
    dtype, attention, linear, cuda_graph_sizes = options["dtype"], options["attention"], options["linear"], options["cuda_graph_sizes"]
    if group is not None:
        device = parallel.rank_device(torch.device(device), group.rank)
    try:
        config, model, parameters = _read_weights(path, DTYPES[dtype], torch.device(device), group)
    except ValueError as e:
        raise ValueError(f"model '{name}' at {path}: {e}") from None
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else getattr(config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0]
    model.attention = attention
    if attention == "kernel" and not kernel_attends(model):
        raise ValueError(
            f"model '{name}': attention 'kernel' runs a float32 model on a CPU with the kernels this machine compiles "
            f"(specfleet/engine/cpu_kernels.py; a C++ compiler) and heads of 16, 32, ... {cpu_kernels.MAX_HEAD_DIM}, "
            f"here {dtype} on {model.device} with heads of {model.head_dim}: use auto"
        )
    token_map = local_index = None
    if options["use_token_map"] and (path / TOKEN_MAP_FILE).exists():
        token_map = read_token_map(name, path / TOKEN_MAP_FILE, int(config.vocab_size))
        model.lm_head = model.lm_head[token_map.to(model.device)].contiguous()
        # The maps stay on the CPU: they translate positions of logits that forward_batch
        # hands back on the CPU, where the drafter samples.
        local_index = torch.full((int(config.vocab_size),), -1, dtype=torch.long)
        local_index[token_map] = torch.arange(len(token_map))
    if group is not None:
        model.vocab = model.lm_head.shape[0]
        model.lm_head = parallel.shard_vocab(model.lm_head, group.rank, group.size)
        model.parallel = group
        group.ready()
    loaded = LoadedModel(
        name=name,
        path=str(path),
        model=model,
        tokenizer=tokenizer,
        fingerprint=tokenizer_fingerprint(tokenizer),
        vocab_size=int(config.vocab_size),
        max_context=_context(name, config, options["max_model_len"]),
        eos_token_id=int(eos) if eos is not None else -1,
        parameters=parameters,
        token_map=token_map,
        local_index=local_index,
        linear=linear,
        kv_block_size=options["kv_block_size"],
        prefix_caching=options["prefix_caching"],
    )
    if cuda_graph_sizes and model.device.type == "cuda":
        from specfleet.engine.graphs import CudaGraphs

        loaded.graphs = CudaGraphs(loaded, cuda_graph_sizes)
    log.info(
        "loaded model %s from %s: %.1fM parameters, %s on %s, %s attention, %s, %.1fs",
        name,
        path,
        loaded.parameters / 1e6,
        dtype,
        _describe_device(model.device),
        attention,
        f"output layer over {len(token_map)} ids ({TOKEN_MAP_FILE})" if token_map is not None else "full output layer",
        time.perf_counter() - started,
    )
    return loaded


def _context(name: str, config, max_model_len: int) -> int:
    """The positions a session may use: max_model_len, or all the model allows when it is 0."""
    limit = llama.context_limit(config)
    if max_model_len > limit:
        raise ValueError(f"model '{name}': max_model_len {max_model_len} exceeds the {limit} positions the model allows")
    return max_model_len or limit


def _read_config(path: pathlib.Path):
    """The checkpoint's config, read directly where it states every field, else by transformers."""
    config = checkpoint.read_config(path)
    if config is not None:
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def _read_weights(path: pathlib.Path, dtype: torch.dtype, device: torch.device, group: parallel.Group | None) -> tuple[object, LlamaModel, int]:
    """(config, model, parameters): read directly when the checkpoint allows it, else with transformers;
    with `group`, this rank's slices (`parallel.slicer`; the parameters counted are still the whole model's)."""
    config = _read_config(path)
    check_supported(config)  # before any weights load
    cut = parallel.slicer(config, group.rank, group.size) if group is not None else None
    read = checkpoint.read_checkpoint(path, dtype, device, cut)
    if read is not None:
        config, weights, parameters = read
    else:
        from transformers import AutoModelForCausalLM

        hf_model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        config, parameters = hf_model.config, sum(p.numel() for p in hf_model.parameters())
        weights = {}
        for name, t in hf_model.state_dict().items():
            part = cut(name) if cut is not None else None
            weights[name] = (t if part is None else t[part]).detach().to(device).contiguous()
    model = from_weights(config, weights)
    if group is not None:
        first, end = parallel.kv_heads_of(model.kv_heads, group.rank, group.size)
        model.heads, model.kv_heads = model.heads // group.size, end - first
    return config, model, parameters


def _describe_device(device: torch.device) -> str:
    """cpu, or cuda:N with the card's name (what the start-up log says)."""
    if device.type != "cuda":
        return str(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


def read_token_map(name: str, path: pathlib.Path, vocab_size: int) -> torch.Tensor:
    """A token_map.json's ids, checked: raises ValueError naming the model and the file."""
    try:
        ids = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"model '{name}': cannot read {path}: {err}") from None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"model '{name}': {path} must be a non-empty JSON list of vocabulary ids in [0, {vocab_size})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"model '{name}': {path} lists some ids twice")
    return torch.tensor(ids, dtype=torch.long)
