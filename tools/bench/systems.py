"""The systems under test, each started and stopped by the harness.

Every system takes the same token ids and returns the generated token ids
with client-side timestamps (submit, first token, done), so that all of them
are measured the same way:

  hf-target     transformers `generate`, greedy, target alone, in this process on one thread
  hf-assisted   transformers assisted generation (`assistant_model=` the drafter)
  specfleet-off `specfleet serve` with every request sent `speculation.disabled=true`
  specfleet     `specfleet serve` with one drafter (the chosen one)
  specfleet-multi  `specfleet serve` hosting every drafter of the family in one drafter service (the demo
                   family: routed and fused as `specfleet serve` with no config, the default)
  specfleet-fleet  `specfleet serve` with one drafter service per drafter of the family, each on a core of its own
                   (--drafter-cpus), as a fleet of drafter nodes runs
  vllm-target   vLLM CPU OpenAI-compatible server, target alone
  vllm-draft    vLLM with the drafter as draft model (method draft_model)
  vllm-ngram    vLLM with n-gram (prompt lookup) speculation
  corrupt       negative control: the target's greedy output with one token changed; the check must flag it

In-process systems serve one request at a time (concurrent clients queue, as
they would in front of a plain `generate` loop); the queueing counts in their
latency.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import pathlib
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field

from tools.bench.guide_mask import XgrammarMask
from tools.bench.workload import Request

REPO = pathlib.Path(__file__).resolve().parent.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_affinity(cpus: list[int] | None) -> None:
    """Pin the calling thread (Linux: pid 0 is the calling thread) to cpus."""
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)


def taskset_prefix(cpus: list[int] | None) -> list[str]:
    if not cpus:
        return []
    return ["taskset", "-c", ",".join(map(str, cpus))]


@dataclass
class Output:
    token_ids: list[int]
    t_submit: float
    t_first: float | None
    t_done: float
    stats: dict = field(default_factory=dict)  # speculation stats where the system reports them
    error: str | None = None


# A demo family's model-free member (`kind: ngram`, its path the target's tokenizer), named as `specfleet serve`'s
# default fleet names it.
MODEL_FREE = "ngram"


@dataclass
class Family:
    """The weights every system uses: one target and its drafters (all sharing the target's tokenizer)."""

    name: str  # "demo", "random" or a directory
    target: pathlib.Path
    drafters: dict[str, pathlib.Path]  # name -> directory
    drafter: str  # the one used by single-drafter systems


@dataclass
class Settings:
    """What every system gets the same: threads, cores, k, EOS handling, sampling."""

    threads: int = 1
    cpus: list[int] | None = None
    k: int = 4
    ignore_eos: bool = True
    temperature: float = 0.0
    # Sampled requests to specfleet carry a seed each (the exponential race, obligation 6), or none (rejection
    # sampling, what a client that sends no seed gets).
    seeded: bool = True
    dtype: str = "float32"
    # Where the in-process transformers systems (and the greedy reference) run: cpu or cuda[:N].
    # specfleet's services take theirs from the config (--set verifier.device=cuda).
    device: str = "cpu"
    assist_schedule: str = "constant"
    startup_timeout_s: float = 600.0
    log_dir: pathlib.Path = pathlib.Path("bench-results/logs")
    vllm_python: pathlib.Path | None = None
    vllm_max_model_len: int = 2048
    send_domain: bool = False
    # Cores of the drafter services: specfleet-fleet pins its i-th service to the i-th core (in turn), the
    # other specfleet systems their one service to all of them; None leaves them where `serve` puts them.
    drafter_cpus: list[int] | None = None
    vllm_args: list[str] = field(default_factory=list)
    # Every system's penalties on repeated tokens, as OpenAI and vLLM mean them (presence_penalty, frequency_penalty,
    # repetition_penalty), the neutral ones left out; the greedy reference applies them too.
    penalties: dict[str, float] = field(default_factory=dict)
    # Structured output: every system's requests ask for JSON following this schema (None: text), without free
    # whitespace where `json_compact` (vLLM's disable_any_whitespace); the greedy reference applies xgrammar's mask.
    json_schema: dict | None = None
    json_compact: bool = False


class System:
    name = ""
    description = ""
    reports_speculation = False

    def __init__(self, family: Family, settings: Settings, label: str | None = None):
        self.family = family
        self.settings = settings
        self.label = label or self.name

    async def start(self) -> None:
        pass

    async def generate(self, req: Request) -> Output:
        raise NotImplementedError

    async def stop(self) -> None:
        pass

    def counters(self) -> dict:
        """Server-side counters (cumulative); the runner reports their difference over a load point."""
        return {}

    def describe(self) -> dict:
        return {"system": self.name, "label": self.label, "description": self.description}


# --- transformers, in process ---------------------------------------------------------------------------------


class _Timer:
    """A `generate` streamer that only notes when the first new token(s) arrive."""

    def __init__(self):
        self.calls = 0
        self.t_first: float | None = None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.t_first is None:  # the first put is the prompt
            self.t_first = time.perf_counter()

    def end(self):
        pass


class OutputPenalties:
    """OpenAI's presence and frequency penalties on the tokens after the prompt, as a transformers logits processor
    (transformers has none built in; its repetition_penalty is vLLM's)."""

    def __init__(self, start: int, presence: float, frequency: float):
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids, scores):
        import torch

        counts = torch.stack([torch.bincount(row[self.start :], minlength=scores.shape[-1]) for row in input_ids]).to(scores.dtype)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class HFTarget(System):
    name = "hf-target"
    description = "transformers generate, target alone, in process, one thread"
    _models: dict = {}

    def __init__(self, family, settings, label=None):
        super().__init__(family, settings, label)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _init_thread(self):
        import torch

        torch.set_num_threads(self.settings.threads)
        set_affinity(self.settings.cpus)

    @classmethod
    def load(cls, path: pathlib.Path, dtype: str, device: str = "cpu"):
        key = (str(path), dtype, device)
        if key not in cls._models:
            import torch
            from transformers import AutoModelForCausalLM

            cls._models[key] = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()
        return cls._models[key]

    async def start(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=self._init_thread)
        await asyncio.get_running_loop().run_in_executor(self._pool, self._load)

    def _load(self):
        self.model = self.load(self.family.target, self.settings.dtype, self.settings.device)

    def _kwargs(self) -> dict:
        kw = {"do_sample": False}
        if self.settings.temperature > 0:
            kw = {"do_sample": True, "temperature": self.settings.temperature, "top_k": 0, "top_p": 1.0}
        if self.settings.ignore_eos:
            kw["eos_token_id"] = None
        if "repetition_penalty" in self.settings.penalties:
            kw["repetition_penalty"] = self.settings.penalties["repetition_penalty"]
        return kw

    def _processors(self, prompt_tokens: int) -> list:
        presence, frequency = self.settings.penalties.get("presence_penalty", 0.0), self.settings.penalties.get("frequency_penalty", 0.0)
        processors = [OutputPenalties(prompt_tokens, presence, frequency)] if presence or frequency else []
        if self.settings.json_schema is not None:
            eos, vocab = self._pad_id(), self.model.config.vocab_size
            schema = json.dumps(self.settings.json_schema)
            processors.append(XgrammarMask(self.family.target, vocab, eos, "json", schema, self.settings.json_compact, prompt_tokens))
        return processors

    def _pad_id(self) -> int:
        eos = self.model.config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        return eos if isinstance(eos, int) else 0

    def _generate_sync(self, req: Request, t_submit: float) -> Output:
        import torch

        timer = _Timer()
        ids = torch.tensor([req.prompt_ids], device=self.model.device)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=req.max_tokens,
                min_new_tokens=0,
                streamer=timer,
                pad_token_id=self._pad_id(),
                logits_processor=self._processors(ids.shape[1]),
                **self._kwargs(),
            )
        t_done = time.perf_counter()
        return Output(token_ids=out[0, ids.shape[1] :].tolist(), t_submit=t_submit, t_first=timer.t_first, t_done=t_done)

    async def generate(self, req: Request) -> Output:
        t_submit = time.perf_counter()
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._generate_sync, req, t_submit)

    async def stop(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=True)


class HFAssisted(HFTarget):
    name = "hf-assisted"
    description = "transformers assisted generation (assistant_model = the drafter), in process, one thread"

    def _load(self):
        super()._load()
        self.assistant = self.load(self.family.drafters[self.family.drafter], self.settings.dtype, self.settings.device)
        gc = self.assistant.generation_config
        gc.num_assistant_tokens = self.settings.k
        gc.num_assistant_tokens_schedule = self.settings.assist_schedule
        if self.settings.assist_schedule == "constant":
            gc.assistant_confidence_threshold = 0.0  # always draft k tokens, like the others

    def _kwargs(self) -> dict:
        return {**super()._kwargs(), "assistant_model": self.assistant}

    def describe(self) -> dict:
        return {**super().describe(), "drafter": self.family.drafter, "k": self.settings.k, "schedule": self.settings.assist_schedule}


class Corrupt(HFTarget):
    name = "corrupt"
    description = "negative control: target greedy output with its middle token changed (must be flagged)"

    def _generate_sync(self, req, t_submit):
        out = super()._generate_sync(req, t_submit)
        if out.token_ids:
            i = len(out.token_ids) // 2
            out.token_ids[i] = (out.token_ids[i] + 1) % self.model.config.vocab_size
        return out


# --- specfleet ------------------------------------------------------------------------------------------------


def parse_prometheus(text: str, prefix: str) -> dict[str, float]:
    """Samples of the metrics named prefix*, summed over their labels (gauges included; `_created` skipped)."""
    import re

    out: dict[str, float] = {}
    pattern = re.compile(r"^(" + re.escape(prefix) + r"[A-Za-z0-9_:]*)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)$")
    for line in text.splitlines():
        m = pattern.match(line.strip())
        if m and not m.group(1).endswith("_created") and m.group(2) != "NaN":
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


def parse_overrides(items: list[str]) -> list[tuple[str, object]]:
    """KEY=VALUE with VALUE parsed as YAML (router.num_draft_tokens=6, verifier.max_wait_ms=0), as `serve --set` reads them."""
    from specfleet import config as config_mod

    return [config_mod.parse_override(item) for item in items]


class Specfleet(System):
    name = "specfleet"
    description = "specfleet serve, one drafter"
    reports_speculation = True
    disabled = False

    def __init__(self, family, settings, label=None, drafters: list[str] | None = None, overrides=()):
        super().__init__(family, settings, label)
        self.drafter_names = drafters or [family.drafter]
        self.overrides = list(overrides)
        self.proc: subprocess.Popen | None = None
        self.channel = None

    def config(self) -> dict:
        s = self.settings
        cfg = {
            "verifier": {"model": str(self.family.target), "address": f"127.0.0.1:{free_port()}", "threads": s.threads, "dtype": s.dtype},
            "drafters": [
                {
                    "name": "drafters",
                    "address": f"127.0.0.1:{free_port()}",
                    "threads": s.threads,
                    "dtype": s.dtype,
                    "models": [self._draft_model(n) for n in self.drafter_names],
                    **({"cpus": s.drafter_cpus} if s.drafter_cpus else {}),
                }
            ],
            "router": {
                "host": "127.0.0.1",
                "port": free_port(),
                "default_drafter": self.family.drafter if self.family.drafter in self.drafter_names else self.drafter_names[0],
                "num_draft_tokens": s.k,
                "max_draft_tokens": max(16, s.k),
                "max_tokens_limit": 8192,
            },
        }
        from specfleet import config as config_mod

        if "metrics_port" in {f.name for f in dataclasses.fields(config_mod.RouterConfig)}:
            # the router's Prometheus counters give the verifier's exact busy time per load point
            cfg["router"]["metrics_port"] = free_port()
        self._routing(cfg["router"])
        for key, value in self.overrides:
            config_mod.set_key(cfg, key, value)
        return cfg

    def _routing(self, router: dict) -> None:
        """Routing settings beyond the config's defaults (none: one drafter has nothing to route among)."""

    def counters(self) -> dict:
        port = getattr(self, "metrics_port", 0)
        if not port:
            return {}
        import urllib.request

        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                return {k: v for k, v in parse_prometheus(r.read().decode(), "specfleet:").items() if k.endswith("_total")}
        except OSError:
            return {}

    def _draft_model(self, name: str) -> dict:
        """A draft model's config entry; demo drafters named after a domain declare it as their speciality."""
        from specfleet import config as config_mod
        from tools.bench.workload import DOMAINS

        path = self.family.drafters[name]
        if name == MODEL_FREE:
            return {"name": name, "kind": "ngram", "path": str(path)}
        entry = {"name": name, "path": str(path)}
        known = {f.name for f in dataclasses.fields(config_mod.DraftModelConfig)}
        if "specialities" in known and name in DOMAINS:
            entry["specialities"] = [name]
        if "exemplars_file" in known and (path / "exemplars.jsonl").exists():
            entry["exemplars_file"] = str(path / "exemplars.jsonl")
        return entry

    async def start(self) -> None:
        import grpc
        import yaml

        from specfleet.serving import CHANNEL_OPTIONS

        cfg = self.config()
        self.metrics_port = int(cfg["router"].get("metrics_port") or 0)
        log_dir = pathlib.Path(self.settings.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        config_path = log_dir / f"{self.label}.yaml"
        config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.config_path = config_path
        self.router = f"127.0.0.1:{cfg['router']['port']}"
        self._log = open(log_dir / f"{self.label}.log", "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(self.settings.threads), "HF_HUB_OFFLINE": "1"}
        command = [*taskset_prefix(self.settings.cpus), sys.executable, "-m", "specfleet.cli", "serve", "--config", str(config_path)]
        self.command = shlex.join(command)
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=REPO, env=env, start_new_session=True)
        ready = await asyncio.to_thread(self._wait_ready, self.settings.startup_timeout_s)
        if not ready:
            await self.stop()
            tail = (log_dir / f"{self.label}.log").read_text()[-3000:]
            raise RuntimeError(f"{self.label}: specfleet serve did not become ready; log tail:\n{tail}")
        self.channel = grpc.aio.insecure_channel(self.router, options=CHANNEL_OPTIONS)
        from specfleet.v1 import generation_pb2_grpc

        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    def _wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if "specfleet is ready" in line:
                # keep draining stdout so that the child never blocks on a full pipe
                threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()
                return True
            if not line and self.proc.poll() is not None:
                return False
        return False

    def request(self, req: Request):
        from specfleet.v1 import generation_pb2

        return generation_pb2.GenerateRequest(
            prompt_token_ids=req.prompt_ids,
            max_tokens=req.max_tokens,
            temperature=self.settings.temperature,
            seed=zlib.crc32(req.id.encode()) if self.settings.seeded else None,
            stop_at_eos=not self.settings.ignore_eos,
            request_id=req.id.replace("#", "-") + f"-{time.monotonic_ns()}",
            speculation=generation_pb2.SpeculationOptions(disabled=self.disabled, max_draft_tokens=0 if self.disabled else self.settings.k),
            **self._domain_hint(req),
            **self.settings.penalties,
            **self._guide(),
        )

    def _guide(self) -> dict:
        if self.settings.json_schema is None:
            return {}
        from specfleet.v1 import common_pb2

        return {"guide": common_pb2.Guide(kind="json", spec=json.dumps(self.settings.json_schema), compact=self.settings.json_compact)}

    def _domain_hint(self, req: Request) -> dict:
        """The workload's domain label, sent only with --send-domain (a client usually does not know it)."""
        from specfleet.v1 import generation_pb2

        if self.settings.send_domain and "domain" in generation_pb2.GenerateRequest.DESCRIPTOR.fields_by_name:
            return {"domain": req.domain}
        return {}

    async def generate(self, req: Request) -> Output:
        import grpc

        msg = self.request(req)
        t_submit = time.perf_counter()
        t_first, ids, final = None, [], None
        try:
            async for chunk in self.stub.GenerateStream(msg, timeout=self.settings.startup_timeout_s):
                if chunk.token_ids and t_first is None:
                    t_first = time.perf_counter()
                ids.extend(chunk.token_ids)
                final = chunk
        except grpc.aio.AioRpcError as err:
            return Output(ids, t_submit, t_first, time.perf_counter(), error=f"{err.code().name}: {err.details()}")
        t_done = time.perf_counter()
        stats = {}
        if final is not None and final.HasField("speculation"):
            s = final.speculation
            stats = {
                "rounds": s.rounds,
                "draft_tokens": s.draft_tokens,
                "accepted_tokens": s.accepted_tokens,
                "drafters": {
                    d.drafter: {"rounds": d.rounds, "draft_tokens": d.draft_tokens, "accepted_tokens": d.accepted_tokens} for d in s.drafters
                },
                "draft_wall_ms": s.draft_wall_ms,
                "draft_compute_ms": s.draft_compute_ms,
                "verify_wall_ms": s.verify_wall_ms,
                "verify_compute_ms": s.verify_compute_ms,
                "draft_queue_ms": s.draft_queue_ms,
                "verify_queue_ms": s.verify_queue_ms,
                "router_ms": s.router_ms,
            }
            if "domain" in type(s).DESCRIPTOR.fields_by_name:
                stats["routed_domain"] = s.domain
        return Output(ids, t_submit, t_first, t_done, stats=stats)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
        if hasattr(self, "_log"):
            self._log.close()

    def describe(self) -> dict:
        return {
            **super().describe(),
            "drafters": self.drafter_names,
            "default_drafter": self.config_summary(),
            "k": 0 if self.disabled else self.settings.k,
            "overrides": {k: v for k, v in self.overrides},
        }

    def config_summary(self) -> str:
        return self.family.drafter if self.family.drafter in self.drafter_names else self.drafter_names[0]


class SpecfleetOff(Specfleet):
    name = "specfleet-off"
    description = "specfleet serve, speculation.disabled=true (target alone through the router)"
    disabled = True


class SpecfleetMulti(Specfleet):
    name = "specfleet-multi"
    description = "specfleet serve hosting every drafter of the family"

    def __init__(self, family, settings, label=None, drafters=None, overrides=()):
        super().__init__(family, settings, label, drafters=drafters or sorted(family.drafters), overrides=overrides)

    def _routing(self, router: dict) -> None:
        """With the bundled demo family, the fusion settings `specfleet serve` starts with when given no config, so
        that this system is the embedded default the docs call "the default" (--set changes them)."""
        if self.family.name != "demo":
            return
        import tempfile

        from specfleet.config.runtime import default_config

        with tempfile.TemporaryDirectory() as work_dir:
            routing = default_config(pathlib.Path(work_dir)).router.routing
        router.update(fusion_width=routing.fusion_width, fusion_depth=routing.fusion_depth)


class SpecfleetFleet(SpecfleetMulti):
    name = "specfleet-fleet"
    description = "specfleet serve with one drafter service per drafter, each on a core of its own"

    def config(self) -> dict:
        cfg = super().config()
        shared = {k: v for k, v in cfg["drafters"][0].items() if k not in ("name", "address", "models", "cpus")}
        cores = self.settings.drafter_cpus
        cfg["drafters"] = [
            {
                **shared,
                "name": f"drafter-{model['name']}",
                "address": f"127.0.0.1:{free_port()}",
                "models": [model],
                **({"cpus": [cores[i % len(cores)]]} if cores else {}),
            }
            for i, model in enumerate(cfg["drafters"][0]["models"])
        ]
        return cfg


class SpecfleetAttached(Specfleet):
    """A specfleet router that is already running (a multi-node deployment, or a test's cluster).

    The harness neither starts nor stops it, so it cannot vouch for its weights, threads or
    cores: the row says so. The outputs are still checked against the target given here.
    """

    name = "specfleet-attached"
    description = "an already running specfleet router (--attach LABEL=HOST:PORT[:off])"

    def __init__(self, family, settings, label=None, address: str = "", disabled: bool = False):
        super().__init__(family, settings, label)
        self.address = address
        self.disabled = disabled

    async def start(self) -> None:
        import grpc

        from specfleet.serving import CHANNEL_OPTIONS, wait_until_serving
        from specfleet.v1 import generation_pb2_grpc

        await wait_until_serving(self.address, self.settings.startup_timeout_s)
        self.router = self.address
        self.command = f"(attached to {self.address})"
        self.channel = grpc.aio.insecure_channel(self.address, options=CHANNEL_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)

    async def stop(self) -> None:
        if self.channel is not None:
            await self.channel.close()
            self.channel = None

    def describe(self) -> dict:
        return {
            "system": self.name,
            "label": self.label,
            "description": self.description,
            "address": self.address,
            "k": 0 if self.disabled else self.settings.k,
            "started_by_harness": False,
        }


SYSTEMS: dict[str, type[System]] = {cls.name: cls for cls in (HFTarget, HFAssisted, SpecfleetOff, Specfleet, SpecfleetMulti, SpecfleetFleet, Corrupt)}
