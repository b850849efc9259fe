"""Imports only point down: each module of ddp_ft imports only from the layers below its own (docs/design.md, Layout),
and the library never imports the measurement tools (``ddp_ft.tools``)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ddp_ft"

# Lowest first; the layout table of docs/design.md states the same floors. A module may import from any layer below its own,
# and within its own layer without a cycle.
LAYERS = [
    {
        "ddp_ft.ddp",
        "ddp_ft.precision",
        "ddp_ft.distributed",
        "ddp_ft.preemption",
        "ddp_ft.records",
        "ddp_ft.synthetic",
        "ddp_ft.ranges",
    },
    {
        "ddp_ft.model",
        "ddp_ft.kernels",
        "ddp_ft.compilation",
        "ddp_ft.memory",
        "ddp_ft.probe",
        "ddp_ft.tokenizer",
        "ddp_ft.data",
        "ddp_ft.metrics",
        "ddp_ft.faults",
        "ddp_ft.integrations.launch",
        "ddp_ft.integrations.checkpointing",
        "ddp_ft.perf_traps",
    },
    {"ddp_ft.config", "ddp_ft.defaults", "ddp_ft.checkpoint", "ddp_ft.shared_fs"},
    {"ddp_ft.setup", "ddp_ft.report", "ddp_ft.embedded", "ddp_ft.model_source"},
    {
        "ddp_ft.loop",
        "ddp_ft.steps",
        "ddp_ft.integrations.accelerate",
        "ddp_ft.integrations.trainer",
        "ddp_ft.integrations.trainer_plan",
        "ddp_ft.integrations.trainer_checkpoints",
        "ddp_ft.integrations.settings",
        "ddp_ft.integrations.comm_hook_kwargs",
        "ddp_ft.integrations.callbacks",
    },
    {
        "ddp_ft.integrations.recipe",
        "ddp_ft.integrations.stock",
        "ddp_ft.integrations",
    },
    # The measurement tools: one package apart from the library, above all of it; only the CLI and scripts/ import it.
    {
        "ddp_ft.tools",
        "ddp_ft.tools.bench",
        "ddp_ft.tools.ladder",
        "ddp_ft.tools.bench_e2e",
        "ddp_ft.tools.gpu_check",
        "ddp_ft.tools.gpu_report",
    },
    {
        "ddp_ft.commands",
        "ddp_ft.launcher",
        "ddp_ft.cli",
    },
]

# The library never imports the measurement tools, whatever its layer (the layers alone would let a new module placed
# above the tools, beside the CLI, import them). Only the tools themselves and the CLI do (and scripts/, outside).
TOOLS = "ddp_ft.tools"
TOOL_USERS = (TOOLS, "ddp_ft.cli", "ddp_ft.commands")


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _unit(module: str) -> str | None:
    """The layer entry a module belongs to: itself, or the nearest enclosing package listed."""
    while module:
        if any(module in layer for layer in LAYERS):
            return module
        module = module.rpartition(".")[0]
    return None


def _layer(unit: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if unit in layer)


def _imports(path: Path, module: str) -> set[str]:
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


def _graph() -> dict[str, set[str]]:
    """Each module (a package's ``__init__`` under the package's name) and the ddp_ft modules it imports."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {m: {t for t in _imports(p, m) if t in modules and t != m} for m, p in modules.items()}


def test_every_module_imports_only_from_layers_below_its_own():
    graph = _graph()
    unplaced = [m for m in graph if m != "ddp_ft" and _unit(m) is None]
    assert not unplaced, f"modules missing from LAYERS (and the layout table of docs/design.md): {unplaced}"
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module != "ddp_ft"
        for target in targets
        if _layer(_unit(target)) > _layer(_unit(module))
    ]
    assert not upward, upward


def test_the_library_never_imports_the_measurement_tools():
    """Imports inside functions count too: a tool imported lazily is still imported."""
    graph = _graph()
    assert any(_within(m, (TOOLS,)) for m in graph), f"{TOOLS} not found: the test would pass on nothing"
    library = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if not _within(module, TOOL_USERS)
        for target in targets
        if _within(target, (TOOLS,))
    ]
    assert not library, f"library modules importing {TOOLS} (move what they need into the library): {library}"


def test_no_import_cycle_between_modules():
    """A package's ``__init__`` re-exporting its modules is not a cycle: its modules import each other, not it."""
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycles.append(path[path.index(target) :] + [target])
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles
