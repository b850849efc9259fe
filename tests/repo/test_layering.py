"""Imports only point down, at two scales (docs/design.md, Layout): each room of the package (a top-level name:
``ddp/``, ``distributed/``, ``report/``, ``training/``, ...) imports only from its own room and the rooms below it, and
each module imports only from the layers below its own. The library never imports the measurement tools
(``ddp_ft.tools``), and a room's index (``ddp_ft.training``, ``ddp_ft.report``) imports nothing."""

from ..helpers.imports import import_graph

# The rooms, lowest first: what docs/design.md draws. A module may import from its own room and any room below it.
ROOMS = ["ddp", "distributed", "report", "training", "integrations", "embedded", "tools", "commands", "__main__"]

# A room's index: a docstring that maps the room, importing nothing, so that importing one piece of the room (the
# Trainer path imports ``ddp_ft.training.model.qlora``) loads no other.
INDEXES = {"ddp_ft.training", "ddp_ft.training.model", "ddp_ft.report"}

# Module by module, lowest first; the layout table of docs/design.md states the same floors. A module may import from
# any layer below its own, and within its own layer without a cycle.
LAYERS = [
    {
        "ddp_ft.ddp",
        "ddp_ft.distributed",
        "ddp_ft.training.model.precision",
        "ddp_ft.training.preemption",
        "ddp_ft.report.records",
        "ddp_ft.training.data.synthetic",
        "ddp_ft.training.data.tokenizer",
        "ddp_ft.training.ranges",
        "ddp_ft.training.batch",
    },
    {
        "ddp_ft.training.model.qlora",
        "ddp_ft.training.model.positions",
        "ddp_ft.training.model.kernels",
        "ddp_ft.training.model.attention",
        "ddp_ft.training.model.compilation",
        "ddp_ft.training.model.memory",
        "ddp_ft.training.model.probe",
        "ddp_ft.training.model.probe_step",
        "ddp_ft.training.data",
        "ddp_ft.report.metrics",
        "ddp_ft.training.hooks",
        "ddp_ft.integrations.checkpointing",
        "ddp_ft.training.perf_traps",
    },
    {"ddp_ft.training.config", "ddp_ft.training.resolve", "ddp_ft.training.checkpoint", "ddp_ft.report.forecast"},
    {
        "ddp_ft.training.setup",
        "ddp_ft.report.comparison",
        "ddp_ft.embedded",
        "ddp_ft.training.model.source",
        "ddp_ft.training.model.merge",
        "ddp_ft.training.predict",
    },
    {
        "ddp_ft.training.loop",
        "ddp_ft.training.run",
        "ddp_ft.training.run_log",
        "ddp_ft.training.steps",
        "ddp_ft.integrations.accelerate",
        "ddp_ft.integrations.trainer",
        "ddp_ft.integrations.trainer_plan",
        "ddp_ft.integrations.trainer_rows",
        "ddp_ft.integrations.trainer_checkpoints",
        "ddp_ft.integrations.settings",
        "ddp_ft.integrations.comm_hook_kwargs",
        "ddp_ft.integrations.callbacks",
    },
    {
        "ddp_ft.integrations.recipe",
        "ddp_ft.integrations.recipe_eval",
        "ddp_ft.integrations.stock",
        "ddp_ft.integrations.bucketed",
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
    {"ddp_ft.commands", "ddp_ft.commands.launcher", "ddp_ft.commands.cli", "ddp_ft.__main__"},
]

# The library never imports the measurement tools, whatever its layer (the layers alone would let a new module placed
# above the tools, beside the CLI, import them). Only the tools themselves and the CLI do (and scripts/, outside).
TOOLS = "ddp_ft.tools"
TOOL_USERS = (TOOLS, "ddp_ft.commands.cli", "ddp_ft.commands")


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


def _room(module: str) -> str:
    return module.split(".")[1]


def test_rooms_import_only_themselves_and_rooms_below():
    graph = import_graph()
    top = {m.split(".")[1] for m in graph if m != "ddp_ft"}
    assert top == set(ROOMS), f"top-level names not in ROOMS (and docs/design.md), or gone: {top ^ set(ROOMS)}"
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module != "ddp_ft"
        for target in targets
        if ROOMS.index(_room(target)) > ROOMS.index(_room(module))
    ]
    assert not upward, upward


def test_a_rooms_index_imports_nothing():
    graph = import_graph()
    assert INDEXES <= graph.keys(), f"indexes gone: {INDEXES - graph.keys()}"
    loaded = {index: graph[index] for index in INDEXES if graph[index]}
    assert not loaded, f"a room's index imports its modules, so one piece of the room loads them all: {loaded}"


def test_modules_import_only_from_own_or_lower_layers():
    graph = import_graph()
    unplaced = [m for m in graph if m != "ddp_ft" and m not in INDEXES and _unit(m) is None]
    assert not unplaced, f"modules missing from LAYERS (and the layout table of docs/design.md): {unplaced}"
    upward = [
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module != "ddp_ft" and module not in INDEXES
        for target in targets
        if _layer(_unit(target)) > _layer(_unit(module))
    ]
    assert not upward, upward


def test_library_never_imports_the_measurement_tools():
    """Imports inside functions count too: a tool imported lazily is still imported."""
    graph = import_graph()
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
    graph = import_graph()
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
