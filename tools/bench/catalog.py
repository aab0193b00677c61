"""Every system `specfleet bench` can run, by name: specfleet's and the transformers baselines
(bench/systems.py), specfleet's through its HTTP API (bench/specfleet_http.py) and vLLM's (bench/vllm.py; both
build on systems.py and share bench/http_client.py). They meet here, above them, so that none imports another back."""

from __future__ import annotations

from tools.bench.systems import SYSTEMS as OWN_SYSTEMS
from tools.bench.systems import System
from tools.bench.specfleet_http import HTTP_SYSTEMS
from tools.bench.vllm import VLLM_SYSTEMS

SYSTEMS: dict[str, type[System]] = {**OWN_SYSTEMS, **HTTP_SYSTEMS, **VLLM_SYSTEMS}
