"""The `specfleet` command: start services, generate text, build the demo models.

    specfleet serve [--config FILE] [--port N]   everything on this machine, one process per service
    specfleet serve --ray [ADDRESS] [--config FILE]  verifier and drafters as Ray actors, placed by the config
    specfleet generate [--server ADDR] [--stream] [--domain LABEL] PROMPT
    specfleet verifier | drafter | router ...     one service, for multi-node deployments
    specfleet models build | matrix ...           the bundled demo models
    specfleet bench [compare|single-stream|run] ...  specfleet against the alternatives, side by side
    specfleet --version                           the installed package's version

The service subcommands run the services' own entry points; `serve` starts
each of them as a child process (`python -m verifier_service ...`), so no
service imports another.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import pathlib
import secrets
import shlex
import shutil
import signal
import sys
import tempfile
import time

from specfleet import generate, ports


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specfleet serve", description="Start the verifier, the drafters and the router on this machine.")
    parser.add_argument(
        "--config",
        help="deployment YAML (default: bundled demo models, else small random models); a file that names no target and no "
        "drafters changes the default's keys, such as `router: {http_port: 8100}`",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change one config key (repeatable), after --config: router.http_port=8100, drafters.0.attention=per-session (--config-keys lists them)",
    )
    parser.add_argument(
        "--config-keys", action="store_true", help="list every key of the config file (type, default, what it accepts and means) and exit"
    )
    parser.add_argument("--port", type=int, help="router port (default: router.port, 50051)")
    parser.add_argument("--http-port", type=int, help="the OpenAI-compatible API's port (default: router.http_port, 8000; 0: off)")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for all services")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restart a crashed service at most this many times in 10 minutes, then stop everything (default 5; 0: never restart)",
    )
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run the verifier and drafters as Ray actors in the cluster at ADDRESS (HOST:6379 from a Ray node, ray://HOST:10001 "
        "through Ray Client from elsewhere; no ADDRESS: start a local Ray); the router uses them over Ray",
    )
    parser.add_argument("--namespace", default="specfleet", help="Ray namespace of the actors (with --ray)")
    parser.add_argument("--detached", action="store_true", help="with --ray: the actors outlive this command (reused when it runs again)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SPECFLEET_API_KEY", ""),
        help="require `Authorization: Bearer KEY` on the OpenAI-compatible API's /v1/* (default: $SPECFLEET_API_KEY; unset: no key)",
    )
    return parser


def service_commands(cfg, config_file: pathlib.Path) -> list[tuple[str, list[str], list[int]]]:
    """Each process `serve` starts, in start order, as (name, command, cores): the verifier replicas, each
    drafter service's replicas, the router (with the verifier in it, where `colocated`)."""
    py = sys.executable
    commands = []
    together = colocated(cfg)
    for replica, address in enumerate([] if together else cfg.verifier.addresses()):
        name = "verifier" if replica == 0 else f"verifier replica {replica}"
        command = [py, "-m", "verifier_service", "--config", str(config_file), "--host", "127.0.0.1", "--replica", str(replica)]
        commands.append((name, command, cfg.verifier.cpus))
    joining = colocated_drafters(cfg)
    for svc in cfg.drafters:
        if svc in joining:
            continue
        for replica, _ in enumerate(svc.addresses()):
            name = f"drafter {svc.name}" if replica == 0 else f"drafter {svc.name} replica {replica}"
            command = [
                py,
                "-m",
                "drafter_service",
                "--config",
                str(config_file),
                "--name",
                svc.name,
                "--host",
                "127.0.0.1",
                "--replica",
                str(replica),
            ]
            commands.append((name, command, svc.cpus))
    if together:
        # The verifier (and the drafter services joining it) in the router's process (specfleet/colocated.py), on the
        # cores of them all; unpinned if any of them is.
        pinned = [cfg.router.cpus, cfg.verifier.cpus, *(svc.cpus for svc in joining)]
        cores = sorted(set().union(*pinned)) if all(pinned) else []
        commands.append(("router", [py, "-m", "specfleet.colocated", "--config", str(config_file)], cores))
    else:
        commands.append(("router", [py, "-m", "router", "--config", str(config_file)], cfg.router.cpus))
    return commands


def colocated(cfg) -> bool:
    """Whether `serve` runs the verifier in the router's process: `verifier.colocate` and one verifier."""
    return cfg.verifier.colocate and not cfg.verifier.replicas


def colocated_drafters(cfg) -> list:
    """The drafter services `serve` runs in the router's process beside the verifier: `colocate`, no replicas, and no
    cores of its own. A service pinned to cores the router and verifier do not have drafts there in parallel with
    them; in their process it would wait for the process's lock (GIL) between its kernels, as one process's services do."""
    if not colocated(cfg):
        return []
    shared = set(cfg.router.cpus) | set(cfg.verifier.cpus)
    return [svc for svc in cfg.drafters if svc.colocate and not svc.replicas and set(svc.cpus) <= shared]


def _print_ready(cfg, router_address: str, side_ports: dict[str, dict]) -> None:
    """The ready line, a command to try, and the side ports as the services reported them (`specfleet.ports.report`):
    what listens, and what is off although its default was asked for, with the reason."""
    print(f"specfleet is ready: router listening on {router_address} (Ctrl-C stops everything)", flush=True)
    print(f"  try: {_this_command()} generate --server {router_address}{_tls_flags(cfg)} 'def fibonacci(n):'", flush=True)
    scheme = "https" if cfg.security.tls else "http"
    api = side_ports.get("HTTP API")
    if api is not None:
        where = f"{scheme}://{api['address']}/v1" if api["address"] else f"off: {api['why']}"
        print(f"  OpenAI-compatible API: {where}", flush=True)
    metrics = [(what.removesuffix(" metrics"), entry) for what, entry in sorted(side_ports.items()) if what.endswith(" metrics")]
    if metrics:
        listed = (f"{name} {scheme}://{e['address']}/metrics" if e["address"] else f"{name} off ({e['why']})" for name, e in metrics)
        print(f"  metrics: {', '.join(listed)}", flush=True)


def serve_config(args):
    """The config `serve` runs: --config (or the default), then --set, then the port flags."""
    from specfleet import config as config_mod

    cfg = config_mod.effective(args.config, args.overrides, config_mod.REPO / ".cache")
    if args.port is not None:
        cfg.router.port = args.port
    if args.http_port is not None:
        cfg.router.http_port = args.http_port
    return cfg


def _reload(args, config_file: pathlib.Path, supervisor) -> None:
    """SIGHUP: the router re-reads its config (the file, then the same --set and flags); refresh the copy it reads first."""
    from specfleet import config as config_mod

    if not args.config:
        print("specfleet serve: SIGHUP ignored: there is no --config file to reload", file=sys.stderr)
        return
    try:
        new = serve_config(args)
    except config_mod.ConfigError as err:
        print(f"specfleet serve: reload refused, keeping the running config: {err}", file=sys.stderr)
        return
    config_file.write_text(new.to_yaml())
    router = supervisor.pid_of("router")
    if router is not None:
        os.kill(router, signal.SIGHUP)


def _unusable_cores(cfg) -> str | None:
    """What is wrong when a section pins its process to cores this machine does not let us use, else None."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    sections = [("verifier", cfg.verifier.cpus), *((f"drafter {svc.name}", svc.cpus) for svc in cfg.drafters), ("router", cfg.router.cpus)]
    for name, cpus in sections:
        if cpus and not set(cpus) <= usable:
            return f"{name}: cpus {cpus} are not all usable here (usable: {sorted(usable)})"
    return None


def _service_env(name: str) -> dict[str, str] | None:
    """The environment of the process `name`: the router's is this one's; the verifier and drafters lose the
    API key, which only the router checks (a process's environment is readable wherever it is: /proc, crash reports)."""
    if name == "router":
        return None
    return {k: v for k, v in os.environ.items() if k != "SPECFLEET_API_KEY"}


def _stop_all(supervisor, code: int) -> int:
    from specfleet.serving import ROUTER_DRAIN_S

    # A second Ctrl-C or SIGTERM must not cut the orderly stop short and leave services running.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The router first: its in-flight requests finish, and their rounds need the drafters and the
    # verifier until the last one. Then the services, once nothing can call them.
    supervisor.stop("router", drain_s=ROUTER_DRAIN_S + 10)
    return code


def cmd_serve(argv: list[str]) -> int:
    args = serve_parser().parse_args(argv)

    from specfleet import config as config_mod
    from specfleet import security

    if args.config_keys:
        print(config_mod.keys_help())
        return 0

    try:
        cfg = serve_config(args)
        sec = security.load(cfg.security)  # a missing or bad certificate is refused before anything starts
    except config_mod.ConfigError as err:
        print(f"specfleet serve: {err}", file=sys.stderr)
        return 2
    # The key reaches the router (here or under --ray) in its environment, not on its command
    # line, which `ps` shows to every user; the services here start without it (_service_env).
    os.environ["SPECFLEET_API_KEY"] = args.api_key
    if args.ray is None:
        # Every service runs here: a device this machine lacks is refused before anything starts.
        try:
            config_mod.check_devices(cfg)
        except config_mod.ConfigError as err:
            print(f"specfleet serve: {err}", file=sys.stderr)
            return 2
    # A shell starts background jobs with SIGINT ignored, and Python keeps it so: without this,
    # Ctrl-C (or a supervisor's SIGINT) would leave the services or actors running.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.ray is not None:
        from specfleet import ray_cluster

        return ray_cluster.serve(cfg, args.ray or None, args.namespace, args.detached, args.startup_timeout)
    if not sec.token:
        # Internal calls carry a shared secret even on loopback (another user of this machine can reach
        # it); with none configured, a fresh one reaches the services through their environment.
        os.environ[security.INTERNAL_TOKEN_ENV] = secrets.token_urlsafe(32)
    # Children read the exact effective config, including defaults chosen here.
    config_file = pathlib.Path(tempfile.mkdtemp(prefix="specfleet-")) / "config.yaml"
    config_file.write_text(cfg.to_yaml())
    side_ports = config_file.parent / "side-ports.jsonl"
    os.environ[ports.SIDE_PORTS_ENV] = str(side_ports)

    commands = service_commands(cfg, config_file)
    unusable = _unusable_cores(cfg)
    if unusable:
        print(f"specfleet serve: {unusable}", file=sys.stderr)
        return 2
    from specfleet.supervisor import GaveUp, Supervisor

    supervisor = Supervisor(lambda cpus: _child_setup(cpus, os.getpid()), max_restarts=max(0, args.max_restarts))

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        for name, command, cpus in commands:
            supervisor.start(name, command, cpus, _service_env(name))
        procs = [(c.name, c.proc) for c in supervisor.children]
        router_address = f"{cfg.router.host}:{cfg.router.port}"
        from specfleet.serving import wait_started, wait_until_serving

        ready = asyncio.run(wait_started(router_address, procs, args.startup_timeout, functools.partial(wait_until_serving, security=sec)))
        if not ready:
            return _stop_all(supervisor, 1)

        signal.signal(signal.SIGHUP, lambda *_: _reload(args, config_file, supervisor))
        _print_ready(cfg, router_address, ports.reported(str(side_ports)))
        while True:
            try:
                supervisor.tend()
            except GaveUp as err:
                print(f"specfleet serve: {err}; stopping", file=sys.stderr)
                return _stop_all(supervisor, 1)
            time.sleep(0.25)
    except KeyboardInterrupt:
        print("specfleet serve: stopping", file=sys.stderr)
        return _stop_all(supervisor, 0)
    finally:
        shutil.rmtree(config_file.parent, ignore_errors=True)


def _this_command() -> str:
    """How a shell runs this specfleet: `specfleet` only when PATH finds this very one (after `make
    serve` it is .venv/bin/specfleet, not on PATH), else its path, else the interpreter and module."""
    me = pathlib.Path(sys.argv[0])
    if me.name == "specfleet" and me.exists():
        on_path = shutil.which("specfleet")
        if on_path and pathlib.Path(on_path).resolve() == me.resolve():
            return "specfleet"
        return shlex.quote(str(me))
    return f"{shlex.quote(sys.executable)} -m specfleet.cli"


def _tls_flags(cfg) -> str:
    """`specfleet generate`'s TLS flags for this router (empty without TLS); the API key stays in the environment."""
    tls = cfg.security.tls
    if tls is None:
        return ""
    flags = f" --ca {shlex.quote(tls.ca)}"
    if tls.client_auth == "all":
        flags += f" --cert {shlex.quote(tls.cert)} --key {shlex.quote(tls.key)}"
    return flags


def _child_setup(cpus: list[int], parent: int):
    """What a service's process does between fork and exec (so every thread it starts inherits it).

    Pins it to `cpus`; and, on Linux, has the kernel kill it when `specfleet serve` dies: in its own
    process group, a service would otherwise outlive a serve that was killed outright.
    """

    libc = None
    if sys.platform == "linux":
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls into it

    def setup() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)
        if libc is not None:
            PR_SET_PDEATHSIG = 1
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # serve died before the line above took effect
                os._exit(1)

    return setup


# The services' and the tools' subcommands, by "module:function". They are imported only when one
# runs, from these strings: the launcher sits above the services and below the tools
# (docs/ARCHITECTURE.md, "Layers"), so it names them here and never imports them at the top.
SERVICE_COMMANDS = {
    "verifier": "verifier_service.server:main",
    "drafter": "drafter_service.server:main",
    "router": "router.server:main",
}
# tools/ is not part of the runtime: an install without it (the image) refuses these with a reason.
TOOL_COMMANDS = {
    "models": "tools.demo_models.cli:main",
    "bench": "tools.bench.cli:main",
}


def entry_point(name: str, path: str):
    """The subcommand `name`, run by the function at `path` ("module:function"), imported when it runs."""

    def run(argv: list[str]) -> int:
        import importlib

        module, _, function = path.partition(":")
        try:
            loaded = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if name not in TOOL_COMMANDS or not f"{module}.".startswith(f"{err.name}."):  # a missing dependency is not a missing tool
                raise
            print(f"specfleet {name}: the tools are not installed here ({module}: tools/ of a source checkout)", file=sys.stderr)
            return 2
        return getattr(loaded, function)(argv)

    return run


COMMANDS = {
    "serve": cmd_serve,
    "generate": generate.main,
    **{name: entry_point(name, path) for name, path in {**SERVICE_COMMANDS, **TOOL_COMMANDS}.items()},
}


# The distribution's name ([project] name in pyproject.toml), whose version `--version` prints.
PACKAGE = "specfleet"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:  # a source tree run without installing it
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--version":
        print(f"specfleet {_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        # As argparse words an invalid choice, with its exit code: a typo is named, not answered with the whole help.
        print(f"specfleet: unknown command {argv[0]!r} (choose from {', '.join(COMMANDS)}; specfleet --help says what each does)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
