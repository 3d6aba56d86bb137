"""The floors of the layout (docs/architecture.md, "Layout"): every import of an eagle3d package
points down, never up or sideways between capture and drafter. Read from the source with `ast`,
so an import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What each package may import of eagle3d, besides itself: the floors below it.
MAY_IMPORT = {
    "statemachine": set(),
    "dataset": {"statemachine"},
    "target": {"statemachine"},
    "capture": {"statemachine", "dataset", "target"},
    "drafter": {"statemachine", "dataset", "target"},
    "daemon": {"statemachine", "dataset", "target", "capture"},
    # eagle3ctl, a process of its own: it reads what the daemon writes and speaks its protocols
    # (control requests, run selection, budgets).
    "ctl": {"statemachine", "dataset", "target", "capture", "daemon"},
}
# An entry point sits above every floor: `eagle3d run --until` ends with eagle3ctl's summary.
ENTRY_POINTS = {"daemon/main.py": {"ctl"}}
# Besides the floors: the daemon's process never holds torch or a model.
HEAVY = {"torch", "transformers", "safetensors.torch", "numpy.linalg"}


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
    return found


def test_every_import_points_down_the_floors():
    wrong = []
    for package, allowed in MAY_IMPORT.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for line, module in imports(path):
                parts = module.split(".")
                also = ENTRY_POINTS.get(str(path.relative_to(REPO)), set())
                if parts[0] == "eagle3d" and len(parts) > 1 and parts[1] != package \
                        and parts[1] not in allowed | also:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not wrong, "imports running up or across the floors:\n" + "\n".join(wrong)


def test_the_daemons_modules_import_no_model_library():
    """The daemon and eagle3ctl stay light: torch and transformers live in the children."""
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for package in ("daemon", "ctl") for path in sorted((REPO / package).rglob("*.py"))
             for line, module in imports(path) if module.split(".")[0] in HEAVY or module in HEAVY]
    assert not wrong, "\n".join(wrong)


# Inside the daemon, the loop drives the stages (daemon/stages/): a stage never imports the loop
# that steps it, nor another stage; beside a stage lie only the mechanics named after it
# (extract_spool.py for extract.py).
LOOP = {"eagle3d.daemon.main", "eagle3d.daemon.reconcile", "eagle3d.daemon.pipeline",
        "eagle3d.daemon.snapshot"}
STAGES = "eagle3d.daemon.stages"


def stage_imports(path: Path) -> list[tuple[int, str]]:
    """`imports`, with `from eagle3d.daemon.stages import x` read as the module it names."""
    found = imports(path)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == STAGES:
            found += [(node.lineno, f"{STAGES}.{alias.name}") for alias in node.names]
    return found


def test_a_stage_imports_neither_the_loop_nor_another_stage():
    wrong = []
    for path in sorted((REPO / "daemon" / "stages").glob("*.py")):
        own = path.stem.split("_")[0]
        for line, module in stage_imports(path):
            other = module.removeprefix(f"{STAGES}.")
            if module in LOOP or (other != module and other.split("_")[0] != own):
                wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not wrong, "a stage reaching up to the loop or across to another stage:\n" + \
        "\n".join(wrong)
