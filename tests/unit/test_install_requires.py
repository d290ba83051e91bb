"""Every module peerd and protocols import comes from the package's own requirements (setup.cfg), so `pip install .`
alone gives a daemon that starts; the real install is tested in tests/integration/test_fresh_install.py."""

import ast
import configparser
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[2]
#: Modules that run only where their extra is installed (transport = libp2p runs them in a process of their own,
#: after checking the import): they may import the extra's distributions at module level.
EXTRA_MODULES = {"peerd/transport/libp2p_daemon.py", "peerd/transport/libp2p_control.py",
                 "peerd/transport/libp2p_relay.py"}


def _requirements(text: str) -> set[str]:
    names = set()
    for line in text.strip().splitlines():
        name = re.match(r"\s*([A-Za-z0-9_.-]+)", line)
        if name:
            names.add(name.group(1).lower().replace("_", "-"))
    return names


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level module, imported at module level) for each absolute import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    top = {id(node) for node in tree.body} | {id(n) for node in tree.body if isinstance(node, ast.If)
                                             for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name.split(".")[0], id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module.split(".")[0], id(node) in top))
    return out


def test_every_import_is_a_requirement_of_the_package():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    required = _requirements(cfg["options"]["install_requires"])
    extras = set().union(*(_requirements(v) for v in cfg["options.extras_require"].values()))
    dists = {module: {d.lower().replace("_", "-") for d in names} for module, names in packages_distributions().items()}
    missing, eager_extras = [], []
    for path in sorted([*ROOT.glob("peerd/**/*.py"), *ROOT.glob("protocols/**/*.py")]):
        rel = str(path.relative_to(ROOT))
        if "/testing/" in rel:  # the test harness: its imports are the test extra's
            continue
        for module, module_level in _imports(path):
            if module in sys.stdlib_module_names or module in ("peerd", "protocols"):
                continue
            provided = dists.get(module, {module.lower()})
            if provided & required:
                continue
            if provided & extras and (not module_level or rel in EXTRA_MODULES):
                continue  # an extra, imported where it is used (the code says what to install if it is missing)
            (eager_extras if provided & extras else missing).append(f"{rel}: {module} ({', '.join(provided)})")
    assert not missing, "imported but not in install_requires:\n" + "\n".join(missing)
    assert not eager_extras, "an extra imported at module level:\n" + "\n".join(eager_extras)
