"""The package's import graph, read from its source with ``ast``: what the layering tests and any test of one
module's imports check."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ddp_ft"


def imports(path: Path, module: str) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                names = [f"{target}.{a.name}" for a in node.names]
            else:
                target, names = node.module or "", [f"{node.module}.{a.name}" for a in node.names]
            # `from . import x` and `from ..pkg import module` name modules; else the target module itself
            found.update(n for n in names if (PACKAGE.parent / (n.replace(".", "/") + ".py")).exists())
            found.add(target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("ddp_ft")}


def import_graph() -> dict[str, set[str]]:
    """Each module (a package's ``__init__`` under the package's name) and the ddp_ft modules it imports."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {m: {t for t in imports(p, m) if t in modules and t != m} for m, p in modules.items()}
