"""What `lint-imports` (the layers of pyproject.toml's [tool.importlinter]) does not check:

  - every module of the runtime packages and tools is in one of the layers, so a new module
    cannot slip past the contract;
  - no import cycles: no module reaches itself through imports, those inside functions included;
  - no private names across packages: no module imports `_name` (a function, class, constant or
    module) from another package, or reads `module._name` of one.

A package here is a folder: `specfleet/` (its own modules), `specfleet/engine/`, `router/`,
`tools/bench/`, ... Run it from anywhere:

    python -m tools.check_imports        # prints each problem; exits 1 if there is one
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parent.parent
ROOTS = ("specfleet", "router", "drafter_service", "verifier_service", "tools")


@dataclasses.dataclass
class Module:
    name: str
    path: pathlib.Path
    rel: str  # its path in the repository
    is_package: bool

    @property
    def package(self) -> str:
        """The folder it lives in, as a dotted name."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclasses.dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of ours
    name: str | None  # the name taken from it (`from target import name`, `target.name`), if any
    line: int


def find_modules(repo: pathlib.Path = REPO, roots: tuple[str, ...] = ROOTS) -> dict[str, Module]:
    modules = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(repo).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            modules[".".join(parts)] = Module(".".join(parts), path, str(path.relative_to(repo)), is_package)
    return modules


def _longest_module(dotted: str, modules: dict[str, Module]) -> tuple[str, list[str]] | None:
    """The longest prefix of `dotted` that is one of our modules, and the names after it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in modules:
            return name, parts[n:]
    return None


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` for the expression a.b.c (names and attributes only)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def imports_of(module: Module, modules: dict[str, Module]) -> list[Import]:
    """Every import of one of our modules by `module` (at any depth: inside functions too), and every
    `alias.name` it reads off a module it imported."""
    tree = ast.parse(module.path.read_text(), str(module.path))
    found: list[Import] = []
    bound: dict[str, str] = {}  # a local name -> the module it stands for (dotted, maybe not ours)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                hit = _longest_module(alias.name, modules)
                if hit:
                    target, rest = hit
                    found.append(Import(module.name, target, rest[0] if rest else None, node.lineno))
                    parent, _, last = target.rpartition(".")
                    if parent in modules and _is_private(last):  # `import pkg._mod`
                        found.append(Import(module.name, parent, last, node.lineno))
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    top = alias.name.partition(".")[0]
                    bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = module.package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: -(node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            hit = _longest_module(base, modules)
            if not hit:
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:  # a submodule
                    found.append(Import(module.name, full, None, node.lineno))
                    # `from pkg import _mod` names a private module of pkg
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(Import(module.name, base, alias.name, node.lineno))
                    bound[alias.asname or alias.name] = full
                else:
                    target, rest = hit
                    found.append(Import(module.name, target, (rest or [alias.name])[0], node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Del):
            dotted = _dotted(node)
            if not dotted:
                continue
            head, _, tail = dotted.partition(".")
            if head not in bound or not tail:
                continue
            hit = _longest_module(f"{bound[head]}.{tail}", modules)
            if hit and hit[1] and hit[1][-1] == node.attr and len(hit[1]) == 1:
                found.append(Import(module.name, hit[0], node.attr, node.lineno))
    return found


def _is_private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def private_imports(modules: dict[str, Module], imports: list[Import]) -> list[str]:
    problems = []
    for imp in imports:
        if _is_private(imp.name) and modules[imp.importer].package != modules[imp.target].package:
            problems.append(f"{modules[imp.importer].rel}:{imp.line}: {imp.importer} uses {imp.target}.{imp.name}, a private name of another package")
    return sorted(set(problems))


def cycles(modules: dict[str, Module], imports: list[Import]) -> list[list[str]]:
    """The import cycles: strongly connected groups of more than one module (Tarjan)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for imp in imports:
        if imp.target != imp.importer:
            graph[imp.importer].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        # Iterative, so that a deep chain cannot reach Python's recursion limit.
        work = [(v, iter(sorted(graph[v])))]
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(groups)


def layer_entries(pyproject: pathlib.Path = REPO / "pyproject.toml") -> list[list[str]]:
    """The layers contract's layers, top first, each as its list of modules."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [[m.strip() for m in re.split(r"[|:]", layer) if m.strip()] for layer in contract["layers"]]


def unlayered(modules: dict[str, Module], layers: list[list[str]]) -> list[str]:
    """Modules in no layer (a root package's own __init__, holding the layers, excepted)."""
    entries = [m for layer in layers for m in layer]
    holders = {".".join(e.split(".")[:n]) for e in entries for n in range(1, e.count(".") + 1)}
    missing = []
    for name, module in modules.items():
        if any(name == e or name.startswith(f"{e}.") for e in entries):
            continue
        if name in holders and not module.path.read_text().strip():
            continue
        missing.append(f"{module.rel}: {name} is in no layer of pyproject.toml's [tool.importlinter] layers contract")
    return missing


def check(repo: pathlib.Path = REPO) -> list[str]:
    modules = find_modules(repo)
    imports = [imp for module in modules.values() for imp in imports_of(module, modules)]
    problems = unlayered(modules, layer_entries(repo / "pyproject.toml"))
    problems += [f"import cycle: {' <-> '.join(group)}" for group in cycles(modules, imports)]
    problems += private_imports(modules, imports)
    return problems


def main() -> int:
    problems = check()
    for problem in problems:
        print(problem)
    print(
        f"tools.check_imports: {len(problems)} problem(s)"
        if problems
        else "tools.check_imports: layers complete, no cycles, no private cross-package imports"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
