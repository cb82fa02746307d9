"""The package's import graph has no circle: every ``import``/``from`` of an ``openrlhf_ess`` module,
function-local ones included, read from the source with ``ast`` (nothing is imported)."""

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "openrlhf_ess")


def _modules():
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = path
    return out


def _imports(path, module, known):
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name in known and name != module:
                found.add(name)
    return found


def _cycle(graph):
    state = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt, stack + [nxt])
                if found:
                    return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_the_checker_finds_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_between_modules():
    modules = _modules()
    # a package's __init__ importing its own submodules is not a circle of two rooms: only module -> module edges
    graph = {m: {d for d in _imports(p, m, modules) if not m.startswith(d + ".")} for m, p in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_layout_map_names_every_top_level_room():
    """docs/layout.md's one-screen map names each top-level module and package of openrlhf_ess, and nothing that is
    not there: a room added or moved without the map fails here."""
    doc = open(os.path.join(os.path.dirname(ROOT), "docs", "layout.md")).read()
    block = doc.split("```")[1]
    rooms = [line.split()[0] for line in block.splitlines() if line.startswith("  ") and line[2] != " "]
    mapped = {room.split("/")[0].removesuffix(".py") for room in rooms}
    present = {
        name.removesuffix(".py")
        for name in os.listdir(ROOT)
        if (name.endswith(".py") and name != "__init__.py") or os.path.isfile(os.path.join(ROOT, name, "__init__.py"))
    }
    assert mapped == present, (sorted(mapped - present), sorted(present - mapped))
