"""Reading the shipped Dockerfile and compose file, for the tests of their contract (no Docker engine here)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
COMPOSE = REPO / "deploy" / "docker" / "compose.yaml"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` in order, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    current = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        current += line
        keyword, _, rest = current.partition(" ")
        out.append((keyword.upper(), rest.strip()))
        current = ""
    return out


def image_env(path: Path = DOCKERFILE) -> dict[str, str]:
    """The image's environment (every ENV instruction, later ones winning), ``$PATH`` references left as is."""
    env: dict[str, str] = {}
    for keyword, rest in instructions(path):
        if keyword == "ENV":
            for token in shlex.split(rest):
                key, _, value = token.partition("=")
                env[key] = value
    return env


def exec_form(path: Path, keyword: str) -> list[str]:
    """The JSON exec form of the last ``keyword`` instruction (for HEALTHCHECK: the part after ``CMD``)."""
    rest = [r for k, r in instructions(path) if k == keyword][-1]
    if keyword == "HEALTHCHECK":
        rest = rest[rest.index("CMD") + 3:].strip()
    return json.loads(rest)
