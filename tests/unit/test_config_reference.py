"""docs/configuration.md is generated from the config dataclasses' field docstrings and must match the code."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
from typing import Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference",
                                                  os.path.join(REPO, "scripts", "gen_config_reference.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module's string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass(frozen=True)
class _Inner:
    """An inner table."""

    depth: int = 3
    """How deep, in ``levels`` (:mod:`some.module`)."""


@dataclasses.dataclass(frozen=True)
class _Outer:
    """A toy config."""

    name: Optional[str] = None
    """Who it is:
    a | b."""
    sizes: tuple[int, ...] = (1, 2)
    undocumented: bool = False
    inner_config: _Inner = dataclasses.field(default_factory=_Inner)
    """The inner table."""


@pytest.mark.timeout(60)
def test_the_committed_configuration_reference_is_what_the_code_says():
    gen = _generator()
    with open(os.path.join(REPO, "docs", "configuration.md")) as f:
        committed = f.read()
    assert committed == gen.render(), (
        "docs/configuration.md is out of date with the config dataclasses' docstrings: "
        f"run `{gen.COMMAND}` and commit the result")


@pytest.mark.timeout(60)
def test_each_field_is_rendered_with_its_docstring_type_default_and_table():
    gen = _generator()
    parts = list(gen.sections(_Outer, "top", env_prefix="X_"))
    assert [s.heading for s in parts] == ["top", "top.inner"]
    outer, inner = (gen.render_section(s) for s in parts)
    assert "- **`name`** (string or unset, default `unset`, `X_NAME`): Who it is: a | b." in outer
    assert "- **`sizes`** (list of integers, default `[1, 2]`, `X_SIZES`): (undocumented)" in outer
    assert not any("inner_config" in line for line in outer)  # a nested table gets its own section
    assert inner[0] == "### `[top.inner]`"
    assert "- **`depth`** (integer, default `3`): How deep, in `levels` (`some.module`)." in inner


@pytest.mark.timeout(60)
def test_check_mode_reports_a_stale_file_and_the_command_that_regenerates_it(tmp_path, capsys):
    gen = _generator()
    stale = tmp_path / "configuration.md"
    stale.write_text(gen.render().replace("Multiaddrs to listen on", "Addresses to listen on"))
    assert gen.main(["--check", "--out", str(stale)]) == 1
    assert gen.COMMAND in capsys.readouterr().err
    fresh = tmp_path / "fresh.md"
    assert gen.main(["--out", str(fresh)]) == 0
    assert gen.main(["--check", "--out", str(fresh)]) == 0
