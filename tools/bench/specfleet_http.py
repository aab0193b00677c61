"""specfleet measured through its OpenAI-compatible HTTP API: the same `specfleet serve` as the gRPC systems
(bench/systems.py), its requests sent as a vLLM user's client sends them, by the same client the vLLM systems use
(bench/http_client.py): server-sent events of `POST /v1/completions` with token ids, one thread per request in
flight. Beside the gRPC systems, it says what the HTTP front costs; beside vLLM, it compares the two through one
protocol."""

from __future__ import annotations

import asyncio
import concurrent.futures
import zlib

from tools.bench.http_client import stream_completion
from tools.bench.systems import Output, Specfleet, SpecfleetMulti, SpecfleetOff, System, free_port
from tools.bench.workload import Request


class OverHttp:
    """A Specfleet system whose requests go through `router.http_port` instead of gRPC."""

    def config(self) -> dict:
        cfg = super().config()
        self.http_port = free_port()
        cfg["router"].update(http_port=self.http_port, served_model_name="target")
        return cfg

    async def start(self) -> None:
        await super().start()
        self.base = f"http://127.0.0.1:{self.http_port}"
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=64)

    def body(self, req: Request) -> dict:
        s = self.settings
        body = {
            "model": "target",
            "prompt": req.prompt_ids,
            "max_tokens": req.max_tokens,
            "temperature": s.temperature,
            "ignore_eos": s.ignore_eos,
            "request_id": req.id.replace("#", "-"),
            "speculation": {"disabled": self.disabled, "max_draft_tokens": 0 if self.disabled else s.k},
            **s.penalties,
        }
        if s.seeded:
            body["seed"] = zlib.crc32(req.id.encode())
        if s.send_domain:
            body["domain"] = req.domain
        if s.json_schema is not None:
            body["structured_outputs"] = {"json": s.json_schema, "disable_any_whitespace": s.json_compact}
        return body

    async def generate(self, req: Request) -> Output:
        call = (self.base, self.body(req), self.settings.startup_timeout_s)
        return await asyncio.get_running_loop().run_in_executor(self._pool, stream_completion, *call)

    async def stop(self) -> None:
        if getattr(self, "_pool", None):
            self._pool.shutdown(wait=False)
        await super().stop()


class SpecfleetHttp(OverHttp, Specfleet):
    name = "specfleet-http"
    description = "specfleet serve, one drafter, through its OpenAI-compatible HTTP API"


class SpecfleetOffHttp(OverHttp, SpecfleetOff):
    name = "specfleet-off-http"
    description = "specfleet serve, speculation.disabled=true, through its OpenAI-compatible HTTP API"


class SpecfleetMultiHttp(OverHttp, SpecfleetMulti):
    name = "specfleet-multi-http"
    description = "specfleet serve hosting every drafter of the family (the default), through its OpenAI-compatible HTTP API"


HTTP_SYSTEMS: dict[str, type[System]] = {cls.name: cls for cls in (SpecfleetHttp, SpecfleetOffHttp, SpecfleetMultiHttp)}
