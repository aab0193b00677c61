"""Every system `specfleet bench` can run, by name: specfleet's and the transformers baselines
(bench/systems.py) and vLLM's (bench/vllm.py, which builds on systems.py). They meet here, above
both, so that neither imports the other back."""

from __future__ import annotations

from tools.bench.systems import SYSTEMS as OWN_SYSTEMS
from tools.bench.systems import System
from tools.bench.vllm import VLLM_SYSTEMS

SYSTEMS: dict[str, type[System]] = {**OWN_SYSTEMS, **VLLM_SYSTEMS}
