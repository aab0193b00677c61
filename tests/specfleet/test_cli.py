"""The `specfleet` command itself: --version, a command it does not know, the processes `serve` starts."""

from __future__ import annotations

import importlib.metadata
import pathlib
import subprocess
import sys

from specfleet import config as config_mod
from specfleet.cli import COMMANDS, serve_parser, serve_config, service_commands
from tests.harness import REPO


def _specfleet(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specfleet.cli", *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_version_prints_the_installed_package_s_version():
    out = _specfleet("--version")
    assert (out.returncode, out.stdout) == (0, f"specfleet {importlib.metadata.version('specfleet')}\n"), out.stderr


def test_an_unknown_command_is_named_with_the_valid_ones():
    out = _specfleet("serv", "--config", "x.yaml")
    assert out.returncode == 2  # as argparse's invalid choice
    assert "unknown command 'serv'" in out.stderr and out.stdout == ""
    assert all(name in out.stderr for name in COMMANDS)


def _processes(verifier: dict, drafter: dict | None = None) -> dict[str, tuple[str, list[int]]]:
    """What `specfleet serve` starts for a config with this verifier section and drafter service d's settings (default:
    a process of its own; service e always is): name -> (module, cores)."""
    cfg = config_mod.parse(
        {
            "verifier": {"model": "target", **verifier},
            "drafters": [
                {"name": "d", "models": [{"name": "m", "path": "m"}], "cpus": [0], **(drafter or {"colocate": False})},
                {"name": "e", "models": [{"name": "n", "path": "n"}], "cpus": [2], "colocate": False},
            ],
            "router": {"cpus": [0]},
        }
    )
    return {name: (command[command.index("-m") + 1], cpus) for name, command, cpus in service_commands(cfg, pathlib.Path("c.yaml"))}


def test_serve_runs_one_verifier_in_the_router_s_process_unless_told_otherwise():
    drafter, other = ("drafter_service", [0]), ("drafter_service", [2])
    assert _processes({"cpus": [1]}) == {"drafter d": drafter, "drafter e": other, "router": ("specfleet.colocated", [0, 1])}
    separate = _processes({"cpus": [1], "colocate": False})
    assert separate == {"verifier": ("verifier_service", [1]), "drafter d": drafter, "drafter e": other, "router": ("router", [0])}
    # Replicas are processes of their own: the router moves requests off one that dies.
    replicas = _processes({"replicas": ["127.0.0.1:50071"]})
    assert replicas == {
        "verifier": ("verifier_service", []),
        "verifier replica 1": ("verifier_service", []),
        "drafter d": drafter,
        "drafter e": other,
        "router": ("router", [0]),
    }
    # The router's process unpinned where either of the two is.
    assert _processes({})["router"] == ("specfleet.colocated", [])


def test_a_drafter_service_joins_the_router_s_process_where_it_colocates_beside_the_verifier():
    joined = _processes({"cpus": [1]}, {"cpus": [1]})  # drafters[].colocate's default
    assert joined == {"drafter e": ("drafter_service", [2]), "router": ("specfleet.colocated", [0, 1])}
    # A service with cores of its own drafts there, in parallel with the router's process.
    assert _processes({"cpus": [1]}, {"cpus": [3]})["drafter d"] == ("drafter_service", [3])
    assert _processes({"cpus": [1]}, {"cpus": [1, 3]})["drafter d"] == ("drafter_service", [1, 3])
    # Not where the verifier is a process of its own, nor where the service has replicas.
    assert "drafter d" in _processes({"colocate": False}, {"colocate": True})
    replicated = _processes({}, {"colocate": True, "replicas": ["127.0.0.1:50072"]})
    assert replicated["drafter d"] == ("drafter_service", [0]) and "drafter d replica 1" in replicated
    # The process unpinned where any of them is.
    assert _processes({"cpus": [1]}, {"colocate": True, "cpus": []})["router"] == ("specfleet.colocated", [])
    assert "drafter d" not in _processes({}, {"colocate": True, "cpus": []})


def test_serve_takes_set_and_port_flags_over_its_config_and_refuses_a_bad_key_before_starting(tmp_path):
    few = tmp_path / "few.yaml"
    few.write_text("router: {http_port: 8100, max_running: 8}\n")
    args = serve_parser().parse_args(["--config", str(few), "--set", "router.max_running=3", "--http-port", "8123", "--port", "50099"])
    cfg = serve_config(args)
    assert (cfg.router.scheduling.max_running, cfg.router.http_port, cfg.router.port) == (3, 8123, 50099)
    assert cfg.verifier.model == config_mod.default_config(tmp_path).verifier.model  # the rest is the default's
    out = _specfleet("serve", "--config", str(few), "--set", "router.nope=1")
    assert out.returncode == 2 and "router: unknown key(s) ['nope']" in out.stderr, out.stderr
