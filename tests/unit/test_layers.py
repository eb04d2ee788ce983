"""The package's layers, checked: a module imports only from its own layer or the ones below it.

    core < config < data < model < job < plan, tracking < train < launch < tune, compare, export, prepare < infer < chat

core holds what every part needs (errors, the run directory, credentials, signals); config the pure
config logic (schema, the DeepSpeed dict); data and model what a job trains on and with; job what a job
is (planned once, read by the ranks); plan the memory planner; tracking W&B; train one rank; launch the
launcher process; tune, compare, export and prepare the tools on top, and infer above them (it reads a
checkpoint as export does). docs/development.md
draws the same picture.
"""

from __future__ import annotations

import ast

from tests.helpers import ROOT

LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("config",),
    ("data",),
    ("model",),
    ("job",),
    ("plan", "tracking"),
    ("train",),
    ("launch",),
    ("tune", "compare", "export", "prepare"),
    ("infer",),  # reads a checkpoint as export does
    ("chat",),  # launcher.infer under the name LLaMA-Factory's users type
)
RANK = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def imports() -> dict[str, set[str]]:
    """launcher module (dotted) -> the launcher modules it imports, at the top or inside a function."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "launcher").rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("launcher."):
                for alias in node.names:  # `from launcher.train import checkpoint` names a module
                    candidate = f"{node.module}.{alias.name}"
                    found.add(candidate if (ROOT / (candidate.replace(".", "/") + ".py")).is_file() else node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names if alias.name.startswith("launcher."))
        graph[module] = found - {module}
    return graph


def package(module: str) -> str:
    return module.split(".")[1]


def test_every_package_has_a_layer():
    packages = {package(module) for module in imports() if module.count(".") >= 2}
    assert packages == set(RANK), "a package without a layer: give it one in LAYERS (and docs/development.md)"


def test_no_module_imports_a_higher_layer_or_a_peer_package():
    wrong = sorted(
        f"{module} -> {target}"
        for module, targets in imports().items()
        for target in targets
        if module.count(".") >= 2
        and package(target) != package(module)
        and RANK[package(target)] >= RANK[package(module)]
    )
    assert wrong == []


def test_no_import_cycles():
    """Tarjan's strongly connected components of the module graph: none larger than one module."""
    graph = imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert cycles == []


def test_the_pure_layers_import_no_torch():
    """core and config run where torch is not installed (train.py's --cfg job, the DeepSpeed dict's tests)."""
    heavy = ("torch", "deepspeed", "transformers")
    found = []
    for path in [*(ROOT / "launcher" / "core").glob("*.py"), *(ROOT / "launcher" / "config").glob("*.py")]:
        tree = ast.parse(path.read_text())
        for node in tree.body:  # module level: what importing the module costs
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            found += [f"{path.name}: {name}" for name in names if name.split(".")[0] in heavy]
    assert found == []
