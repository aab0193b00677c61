"""What specfleet's services never need at run time: the benchmark harness (`bench/`), the
demo-model pipeline (`demo_models/`), the stub generator (`protogen`) and the import checks
(`check_imports`). Tools import the runtime packages; nothing in them imports a tool. The
launcher reaches `specfleet bench` and `specfleet models` by module path, at run time
(`specfleet.cli.TOOL_COMMANDS`).
"""
