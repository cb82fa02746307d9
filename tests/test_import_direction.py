"""Imports between the benchmarks and the tests run one way: a test may import ``benchmarks`` (the benchmarks' own
tests, and the helpers both use: benchmarks/common.py), a benchmark never imports ``tests``. Every ``import``/``from``
of every .py under benchmarks/, function-local ones included, read from the source with ``ast`` (nothing is
imported)."""

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _imported(path: str) -> set:
    """The top-level package of every absolute import in the file (relative imports stay in their own package)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def _offenders(folder: str, package: str) -> list:
    out = []
    for root, _, names in os.walk(os.path.join(REPO, folder)):
        for name in sorted(names):
            path = os.path.join(root, name)
            if name.endswith(".py") and package in _imported(path):
                out.append(os.path.relpath(path, REPO))
    return sorted(out)


def test_the_reader_sees_every_kind_of_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import os\nimport tests.helpers.e2e\nfrom tests.helpers import ports\nfrom . import sibling\n\n\n"
        "def f():\n    from tests.helpers.e2e import tiny_args\n"
    )
    assert _imported(str(path)) == {"os", "tests"}


def test_benchmarks_never_import_tests():
    offenders = _offenders("benchmarks", "tests")
    assert not offenders, (
        f"{offenders} import tests: move what they need into benchmarks/common.py (the tests import it from there)"
    )
