"""Where models run: the `device` settings, how a device this machine lacks is refused, what GetInfo says.

The config file is shared by every node, so reading it checks only the
spelling of a device; whether it exists is checked where the model loads
(and by `specfleet serve`, which starts every service on this machine).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import yaml

from specfleet import config as config_mod
from specfleet.engine import load_model
from tests.harness import REPO, cluster_config

# SPECFLEET_TEST_DEVICE=cuda runs the engine tests on a GPU (scripts/device-check sets it).
DEVICE = os.environ.get("SPECFLEET_TEST_DEVICE", "cpu")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")


def _config(**devices) -> dict:
    return {
        "verifier": {"model": "models/demo/target", "device": devices.get("verifier", "cpu")},
        "drafters": [
            {"name": "small", "models": [{"name": "general", "path": "models/demo/drafters/general"}], "device": devices.get("drafter", "cpu")}
        ],
    }


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1", "auto"])
def test_config_accepts_every_device_spelling_without_checking_this_machine(device):
    # A router on a CPU node reads the same file as the GPU verifier.
    cfg = config_mod.parse(_config(verifier=device, drafter=device))
    assert cfg.verifier.device == device and cfg.drafters[0].device == device


@pytest.mark.parametrize("devices, where", [({"verifier": "gpu"}, "verifier.device"), ({"drafter": "cuda:x"}, r"drafters\[0\].device")])
def test_config_refuses_a_misspelt_device_naming_the_key(devices, where):
    with pytest.raises(config_mod.ConfigError, match=f"{where}: must be cpu, cuda, cuda:N or auto"):
        config_mod.parse(_config(**devices))


@no_cuda
def test_resolve_device_without_cuda():
    assert config_mod.resolve_device("auto", "verifier.device") == "cpu"
    assert config_mod.resolve_device("cpu", "verifier.device") == "cpu"
    with pytest.raises(config_mod.ConfigError) as err:
        config_mod.resolve_device("cuda:0", "drafters[small].device")
    assert str(err.value) == ("drafters[small].device: cuda:0 was asked for but torch sees no CUDA device (torch.cuda.is_available() is False)")


def _run(args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout)


@no_cuda
def test_serve_refuses_cuda_before_starting_anything(tmp_path, random_family):
    config = cluster_config(random_family)
    config["verifier"]["device"] = "cuda"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _run(["-m", "specfleet.cli", "serve", "--config", str(path)])
    assert result.returncode == 2, result.stderr
    assert "verifier.device: cuda was asked for but torch sees no CUDA device" in result.stderr
    assert "specfleet is ready" not in result.stdout


@no_cuda
@pytest.mark.parametrize("service", ["verifier", "drafter"])
def test_service_entry_point_refuses_cuda_naming_the_setting(tmp_path, random_family, service):
    """A service started on its own node (`specfleet verifier|drafter --config`) checks its own device."""
    config = cluster_config(random_family)
    section = config["verifier"] if service == "verifier" else config["drafters"][0]
    section["device"] = "cuda:0"
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(config))
    result = _run(["-m", "specfleet.cli", service, "--config", str(path)])
    where = "verifier.device" if service == "verifier" else "drafters[drafters].device"
    assert result.returncode != 0
    assert f"specfleet {service}: {where}: cuda:0 was asked for but torch sees no CUDA device" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_info_names_device_and_dtype(dtype):
    loaded = load_model("general", "models/demo/drafters/general", dtype=dtype, device=DEVICE)
    info = loaded.info()
    assert info.dtype == dtype and info.attention == "auto"
    assert info.device == str(loaded.model.device) and info.device.startswith(DEVICE.split(":")[0])
    assert loaded.model.embed.device.type == DEVICE.split(":")[0]
    assert all(t.device == loaded.model.device for layer in loaded.model.layers for t in (layer.qkv, layer.down))


def test_attention_mode_is_a_checked_setting_spelt_as_the_engine_spells_it():
    from specfleet.engine import attention, cpu_linear

    assert config_mod.ATTENTION_MODES == attention.ATTENTION_MODES
    assert config_mod.LINEAR_MODES == cpu_linear.LINEAR_MODES
    data = _config()
    data["verifier"]["attention"] = "batched"
    assert config_mod.parse(data).verifier.attention == "batched"
    data["drafters"][0]["attention"] = "paged"
    with pytest.raises(config_mod.ConfigError, match=r"drafters\[0\].attention: must be one of auto, per-session, batched, kernel, got 'paged'"):
        config_mod.parse(data)


def test_the_attention_kernel_asked_for_where_it_cannot_run_is_refused_at_load():
    """`attention: kernel` is a float32 model's on a CPU: a bfloat16 model asking for it is told to use auto."""
    from specfleet.engine import load_model

    with pytest.raises(ValueError, match="attention 'kernel' runs a float32 model on a CPU .* here bfloat16 on cpu with heads of 64: use auto"):
        load_model("target", "models/demo/target", dtype="bfloat16", attention="kernel")


def test_auto_attention_on_a_cpu_takes_the_kernel_only_for_head_sizes_it_takes():
    """A head size the kernel does not take (not a multiple of 16, or past its largest) attends per session under
    `auto`, rather than failing every pass."""
    from types import SimpleNamespace

    from specfleet.engine import attention, cpu_kernels

    def model(head_dim: int):
        return SimpleNamespace(attention="auto", device=torch.device("cpu"), dtype=torch.float32, head_dim=head_dim)

    built = cpu_kernels.library() is not None
    assert attention.attends_on_kernel(model(64)) == built and attention.attends_on_kernel(model(256)) == built
    assert not attention.attends_on_kernel(model(72)) and not attention.attends_on_kernel(model(512))


@pytest.mark.parametrize("sizes", [[[4, 1], [8, 5]], []])
def test_cuda_graph_sizes_are_checked_pairs(sizes):
    data = _config()
    data["verifier"]["cuda_graph_sizes"] = sizes
    assert config_mod.parse(data).verifier.cuda_graph_sizes == sizes


@pytest.mark.parametrize("sizes", [[4, 8], [[4]], [[0, 1]], [[2, "5"]], "[[1, 1]]"])
def test_cuda_graph_sizes_refuse_anything_but_positive_pairs_naming_the_key(sizes):
    data = _config()
    data["verifier"]["cuda_graph_sizes"] = sizes
    with pytest.raises(config_mod.ConfigError, match=r"verifier.cuda_graph_sizes: a list of \[sessions, tokens\] pairs"):
        config_mod.parse(data)
