"""Layering: the node config imports nothing above it, production code never imports the test harness, and the
role's name (not a fixed one) reaches the volunteer services."""

import ast
import asyncio
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from peerd.config import NodeConfig
from peerd.roles.base import CONTEXT_HOOK_ENV, wrap_context
from peerd.service.volunteer import VolunteerServices

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _loaded_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sorted(m for m in sys.modules if m.startswith('peerd'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                         timeout=100)
    return set(out.stdout.split())


def test_the_node_config_imports_no_layer_above_it():
    loaded = _loaded_after("peerd.config")
    layers_above = ("service", "dashboard", "testing", "roles", "transport")
    above = {m for m in loaded if m.partition(".")[2].split(".")[0] in layers_above}
    assert "peerd.config" in loaded and not above, above


def test_no_production_module_imports_the_test_harness():
    assert not {m for m in _loaded_after("peerd.daemon") if m.startswith("peerd.testing")}
    for path in [*(ROOT / "peerd").rglob("*.py"), *(ROOT / "protocols").rglob("*.py")]:
        if "testing" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("peerd.testing") for n in names), f"{path}:{node.lineno}"


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            out.append((node.lineno, node.module or ""))
    return out


def test_transport_knows_no_status_records_roles_or_commands():
    above = ("peerd.status", "peerd.roles", "peerd.worker", "peerd.commands", "peerd.dashboard", "peerd.service")
    found = [f"{path.name}:{line} {name}" for path in (ROOT / "peerd" / "transport").rglob("*.py")
             for line, name in _imports(path) if name.startswith(above)]
    assert found == [], found


def test_every_package_folder_is_a_regular_package():
    # `packages = find:` installs only folders with an __init__.py: a folder without one works from the checkout and
    # is missing from a `pip install .` (peerd.commands once was)
    folders = [d for top in ("peerd", "protocols") for d in [ROOT / top, *(ROOT / top).rglob("*")]
               if d.is_dir() and d.name not in ("__pycache__", "static") and any(d.glob("*.py"))]
    assert [str(d.relative_to(ROOT)) for d in folders if not (d / "__init__.py").exists()] == []


def _tag(ctx):
    return ("wrapped", ctx)


def test_the_context_hook_is_applied_only_when_named():
    ctx = object()
    assert wrap_context(ctx, {}) is ctx
    assert wrap_context(ctx, {CONTEXT_HOOK_ENV: f"{__name__}:_tag"}) == ("wrapped", ctx)
    with pytest.raises(ValueError, match=CONTEXT_HOOK_ENV):
        wrap_context(ctx, {CONTEXT_HOOK_ENV: "no-function-named"})


def test_the_fault_schedule_names_its_hook():
    from peerd.testing.faults import ENV, Faults, instrument_from_env

    env = Faults().kill(at_round=2, phase="matchmaking").environ()
    assert set(env) == {ENV, CONTEXT_HOOK_ENV}
    module, _, attr = env[CONTEXT_HOOK_ENV].partition(":")
    assert getattr(importlib.import_module(module), attr) is instrument_from_env


def test_the_services_report_the_role_the_run_chose(tmp_path):
    async def main():
        services = VolunteerServices(NodeConfig(checkpoint_dir=str(tmp_path)), "worker", asyncio.Event(),
                                     run_id="r", environ={})
        services.set_role("swarm")
        reply = await services.handle({"cmd": "status"})
        assert reply["role"] == "swarm" and services.state.role == "swarm"
        with pytest.raises(ValueError):
            services.set_role("bootstrap")

    asyncio.run(main())
