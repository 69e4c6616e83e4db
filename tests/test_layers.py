"""The package's shape: layers that import only the layers below them, no import circle, small modules, a short
README. Read from the code's own imports (ast), every import counted: at module level, inside functions, and
under `if TYPE_CHECKING:` alike."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "multicard"

# Bottom to top. A module may import its own layer and the layers before it, never one after it.
LAYERS = ["errors", "rules", "safefs", "jobs", "strategies", "data", "models", "checkpoints", "yourloop", "trainer",
          "tools", "cli", "__main__", "__init__"]
MOST_LINES = 320
MOST_TOP_LEVEL = 12
README_MOST = 10_000


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that `name` imports (relative or absolute), wherever the import stands."""
    package = name.split(".") if path.name == "__init__.py" and name != "__init__" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] if node.level > 1 else package
                base = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "multicard":
                base = node.module.split(".")[1:]
            else:
                continue
            names = [".".join([*base, alias.name]) for alias in node.names]
            # `from . import x` reads module x; `from .x import name` reads module x (the package only if nothing else)
            targets = [n for n in names if n in known] or [".".join(base)]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".", 1)[1] for a in node.names if a.name.startswith("multicard.")]
        found.update(t for t in targets if t in known)
    found.discard(name)
    return {f for f in found if f}


def layer(name: str) -> int:
    return LAYERS.index(name.split(".")[0])


def graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imported(name, path, known) for name, path in found.items()}


def test_every_module_belongs_to_a_layer():
    assert [n for n in modules() if n.split(".")[0] not in LAYERS] == []


def test_no_module_imports_a_layer_above_its_own():
    up = [f"{a} -> {b}" for a, targets in graph().items() for b in targets if layer(b) > layer(a)]
    assert up == []


def test_no_import_circle():
    edges = graph()
    circles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
    assert circles == []


def test_the_checker_sees_a_circle_and_an_import_up_a_layer(tmp_path, monkeypatch):
    fake = tmp_path / "multicard"
    (fake / "jobs").mkdir(parents=True)
    (fake / "yourloop").mkdir()
    (fake / "jobs" / "__init__.py").write_text("")
    (fake / "yourloop" / "__init__.py").write_text("")
    (fake / "jobs" / "a.py").write_text("def f():\n    from ..yourloop import b\n")
    (fake / "yourloop" / "b.py").write_text("from ..jobs.a import f\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    edges = graph()
    assert edges["jobs.a"] == {"yourloop.b"} and edges["yourloop.b"] == {"jobs.a"}
    assert [f"{a} -> {b}" for a, t in edges.items() for b in t if layer(b) > layer(a)] == ["jobs.a -> yourloop.b"]


def test_modules_stay_small():
    assert {n: lines for n, p in modules().items() if (lines := len(p.read_text().splitlines())) > MOST_LINES} == {}


def test_few_modules_at_the_top_and_each_subpackage_says_what_it_holds():
    assert len(list(PACKAGE.glob("*.py"))) <= MOST_TOP_LEVEL
    for init in PACKAGE.glob("*/__init__.py"):
        assert ast.get_docstring(ast.parse(init.read_text())), init


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text()) <= README_MOST


MUTATORS = {"append", "add", "update", "pop", "clear", "extend", "insert", "remove", "setdefault", "discard",
            "popitem", "appendleft"}
MOST_MODULE_STATE = 6  # what a signal handler, the excepthook or the process group must reach; each says so


def changed_at_run_time(tree: ast.Module) -> set[str]:
    """The module's top-level names that a function changes: item assignment, a mutating method, `global`, next()."""
    top = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    found = set()
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        own = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)} | \
              {a.arg for a in ast.walk(fn) if isinstance(a, ast.arg)}
        for node in ast.walk(fn):
            if isinstance(node, ast.Global):
                found.update(node.names)
                own -= set(node.names)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
                found.update(t.value.id for t in targets if isinstance(t, ast.Subscript)
                             and isinstance(t.value, ast.Name) and t.value.id not in own)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name):
                found.update({node.func.value.id} - own)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "next" and \
                    node.args and isinstance(node.args[0], ast.Name):
                found.update({node.args[0].id} - own)
    return found & top


def test_few_names_of_module_state_and_none_in_a_lower_layer_reads_the_front_object():
    texts = {name: path.read_text() for name, path in modules().items()}
    state = {f"{name}.{n}" for name, text in texts.items() for n in changed_at_run_time(ast.parse(text))}
    assert len(state) <= MOST_MODULE_STATE, sorted(state)
    lower = [name for name, text in texts.items() if name.split(".")[0] in ("checkpoints", "data", "strategies", "jobs")
             and ("mc._" in text or "mc: Any" in text)]
    assert lower == []


def test_the_module_state_count_sees_what_functions_change():
    tree = ast.parse("A = []\nB = {}\nC = 0\nD = []\ndef f():\n    A.append(1)\n    B['k'] = 1\n"
                     "    global C\n    C = 1\ndef g(D):\n    D.append(1)\n")
    assert changed_at_run_time(tree) == {"A", "B", "C"}
