"""The shape of the code, measured: what the architecture issue (25) set bounds on.

    python bench/code_shape.py                 # this checkout
    python bench/code_shape.py --root /tmp/old # another checkout (e.g. a git worktree of an older commit)

Reports, for the `launcher` package: lines per module (the longest, and how many exceed 600), the ten
longest functions (and how many exceed 60 lines), imports of launcher modules made inside functions,
import cycles between modules (strongly connected components), `sys.exit` calls outside the command-line
entry points (a module's `main`, `__main__.py`), string-key reads of job.json's content in the rank's code
(`job["..."]`, `job.get("...")` in launcher/train and launcher/launch/worker.py), and which modules have no
test file of their own (tests/unit/<package>/test_<module>.py, or tests/test_<module>.py in the flat layout).
Pure static analysis (ast): no imports of the code, so any checkout can be measured.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

LINE_LIMIT = 600
FUNCTION_LIMIT = 60


def modules(root: Path) -> dict[str, Path]:
    return {".".join(p.relative_to(root).with_suffix("").parts): p for p in sorted((root / "launcher").rglob("*.py"))}


def function_lengths(tree: ast.AST, module: str) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found.append((node.end_lineno - node.lineno + 1, f"{module}.{node.name}"))
    return found


def in_function_imports(tree: ast.AST) -> int:
    """Imports of launcher modules inside function bodies (each import statement once)."""
    count = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for sub in node.body:
            for inner in ast.walk(sub):
                if isinstance(inner, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                if (isinstance(inner, ast.ImportFrom) and (inner.module or "").startswith("launcher")) or (
                    isinstance(inner, ast.Import) and any(a.name.startswith("launcher") for a in inner.names)
                ):
                    count += 1
    return count


def imported_modules(tree: ast.AST, known: set[str]) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("launcher"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in known else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("launcher"))
    return found & known


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                on_stack.discard(member)
                component.append(member)
            on_stack.discard(node)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def exits_below_cli(tree: ast.AST, module: str) -> list[str]:
    """`sys.exit(...)` calls outside a function named `main` and outside __main__.py / train.py."""
    if module.endswith("__main__"):
        return []
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name == "main":
            continue
        for inner in ast.walk(node):
            if (
                isinstance(inner, ast.Call)
                and isinstance(inner.func, ast.Attribute)
                and inner.func.attr == "exit"
                and isinstance(inner.func.value, ast.Name)
                and inner.func.value.id == "sys"
            ):
                found.append(f"{module}.{node.name}:{inner.lineno}")
    return sorted(set(found))


def job_key_reads(tree: ast.AST) -> int:
    """`job["key"]` and `job.get("key")` on a name `job` (job.json read as a dict)."""
    count = 0
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.value, ast.Name)
            and node.value.id == "job"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.slice.value, str)
        ) or (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "job"
        ):
            count += 1
    return count


def rank_side(module: str, root: Path) -> bool:
    """The code a rank runs: the trainer package (or the old flat recipe/checkpoint/worker modules)."""
    flat = {"launcher.recipe", "launcher.checkpoint", "launcher.worker", "launcher.wandb_logger", "launcher.watchdog"}
    return module.startswith("launcher.train.") or module == "launcher.launch.worker" or module in flat


def has_test(module: str, root: Path) -> bool:
    parts = module.split(".")
    if parts[-1] in ("__init__", "__main__"):
        return True
    if len(parts) == 2:  # the flat layout: tests/test_<module>.py
        return (root / "tests" / f"test_{parts[1]}.py").is_file()
    return (root / "tests" / "unit" / Path(*parts[1:-1]) / f"test_{parts[-1]}.py").is_file()


def measure(root: Path) -> dict:
    found = modules(root)
    trees = {name: ast.parse(path.read_text()) for name, path in found.items()}
    lines = {name: len(path.read_text().splitlines()) for name, path in found.items()}
    functions = sorted((f for name, tree in trees.items() for f in function_lengths(tree, name)), reverse=True)
    graph = {name: imported_modules(tree, set(found)) - {name} for name, tree in trees.items()}
    code = [name for name in found if not name.endswith(("__init__", "__main__"))]
    return {
        "modules": len(code),
        "lines": sum(lines.values()),
        "longest_modules": sorted(((n, m) for m, n in lines.items()), reverse=True)[:5],
        "over_line_limit": sorted(m for m, n in lines.items() if n > LINE_LIMIT),
        "longest_functions": functions[:10],
        "over_function_limit": [f for f in functions if f[0] > FUNCTION_LIMIT],
        "in_function_imports": sum(in_function_imports(tree) for tree in trees.values()),
        "cycles": cycles(graph),
        "exits_below_cli": [e for name, tree in trees.items() for e in exits_below_cli(tree, name)],
        "job_key_reads_in_ranks": sum(job_key_reads(tree) for name, tree in trees.items() if rank_side(name, root)),
        "untested": sorted(m for m in code if not has_test(m, root)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    args = parser.parse_args()
    shape = measure(args.root)
    print(f"{args.root}: {shape['modules']} modules, {shape['lines']} lines")
    print(f"longest modules: {', '.join(f'{m} {n}' for n, m in shape['longest_modules'])}")
    print(f"modules over {LINE_LIMIT} lines: {len(shape['over_line_limit'])} {shape['over_line_limit']}")
    print(f"longest functions: {', '.join(f'{name} {n}' for n, name in shape['longest_functions'])}")
    print(f"functions over {FUNCTION_LIMIT} lines: {len(shape['over_function_limit'])}")
    print(f"in-function imports of launcher modules: {shape['in_function_imports']}")
    print(f"import cycles: {len(shape['cycles'])} {shape['cycles']}")
    print(f"sys.exit below the command lines: {len(shape['exits_below_cli'])} {shape['exits_below_cli']}")
    print(f"string-key reads of job.json in the ranks' code: {shape['job_key_reads_in_ranks']}")
    print(f"modules without a test file of their own: {len(shape['untested'])} {shape['untested']}")


if __name__ == "__main__":
    main()
