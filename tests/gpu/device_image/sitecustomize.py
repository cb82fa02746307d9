"""The device image, simulated on a full environment: only torch, transformers and pytest (with what they require)
import; every other installed package (psutil, vLLM, Ray, DeepSpeed, OpenRLHF, pytest's plugins, ...) is as if not
installed. Put this folder first on PYTHONPATH; it applies to every Python process started under it (the ranks of
checks 1, 5 and 6 too):

    PYTHONPATH=tests/gpu/device_image PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python -m pytest -q tests/gpu -k cpu

``GPU_IMAGE_ALLOW`` (comma-separated distribution names) adds distributions to the three (e.g. ``deepspeed`` for an
image with the wheel folder installed). The repository's own packages (openrlhf_ess, tests, benchmarks) are on the
device machine's copy of the working tree and stay importable. Self-contained: it runs before the repository is on
sys.path."""

import importlib.metadata as _md
import os as _os
import re as _re
import sys as _sys

_ROOTS = {"torch", "transformers", "pytest"} | {
    d.strip() for d in _os.environ.get("GPU_IMAGE_ALLOW", "").split(",") if d.strip()
}
_REPO_PACKAGES = {"openrlhf_ess", "tests", "benchmarks"}


def _norm(name: str) -> str:
    return _re.sub(r"[-_.]+", "-", name).lower()


def _requires(dist: str) -> list:
    """The distributions ``dist`` requires on this platform, without extras."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # packaging is a dependency of both pytest and transformers
        Requirement = None
    out = []
    for line in _md.requires(dist) or []:
        if Requirement is None:
            if "extra ==" not in line:
                out.append(_re.split(r"[\s;<>=!~\[(]", line, maxsplit=1)[0])
            continue
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            out.append(req.name)
    return out


def _allowed() -> set:
    seen, todo = set(), [_norm(r) for r in _ROOTS]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            todo.extend(_norm(r) for r in _requires(name))
        except _md.PackageNotFoundError:
            continue
    return seen


def _hidden():
    """(top-level modules, distributions) to hide: those of every installed distribution outside the closure."""
    allowed = _allowed()
    hidden, dists_hidden = set(), set()
    for top, dists in _md.packages_distributions().items():
        if top in _REPO_PACKAGES or top in _sys.stdlib_module_names or top.startswith("_"):
            continue
        if not any(_norm(d) in allowed for d in dists):
            hidden.add(top)
            dists_hidden.update(_norm(d) for d in dists)
    return hidden, dists_hidden


class _Hidden:
    """A meta-path finder wrapper: the hidden top-level packages are not found (as if not installed)."""

    def __init__(self, finder, hidden):
        self.finder, self.hidden = finder, hidden

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.hidden:
            return None
        find = getattr(self.finder, "find_spec", None)
        return find(name, path, target) if find else None

    def find_distributions(self, *args, **kwargs):
        """importlib.metadata's view: a hidden distribution is not installed either (torch and transformers decide
        what is available from the metadata as well as from imports)."""
        find = getattr(self.finder, "find_distributions", None)
        if find is None:
            return iter(())
        return (d for d in find(*args, **kwargs) if _norm(d.metadata["Name"] or "") not in HIDDEN_DISTS)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


HIDDEN, HIDDEN_DISTS = _hidden()
_sys.meta_path[:] = [_Hidden(f, HIDDEN) for f in _sys.meta_path]
_os.environ["GPU_IMAGE_HIDDEN"] = ",".join(sorted(HIDDEN))
