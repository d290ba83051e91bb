"""The worker core and its round strategies: chosen once from the run config, shared by every training role."""

import ast
import pathlib

import pytest

from peerd.config import NodeConfig
from peerd.roles.base import ROLES, RunContext
from peerd.roles.diloco import DiLoCoRole
from peerd.roles.spes import SpesRole
from peerd.run_config import AveragingConfig, RunConfig
from peerd.transport.inprocess import Hub
from peerd.worker.core import WorkerCore
from peerd.worker.rounds import DelayedRounds, FragmentRounds, WholeModelRounds
from protocols.diloco import DiLoCoHyperparams

pytestmark = pytest.mark.timeout(60)

ROLES_DIR = pathlib.Path(__file__).resolve().parents[2] / "peerd" / "roles"


def _imported_modules(path: pathlib.Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return modules


def test_no_role_module_imports_another_role():
    role_modules = {target.partition(":")[0] for target in ROLES.values()}
    assert len(role_modules) == len(ROLES) >= 3
    offenders = {}
    for module in role_modules:
        path = ROLES_DIR / (module.rpartition(".")[2] + ".py")
        others = (_imported_modules(path) & role_modules) - {module}
        if others:
            offenders[module] = sorted(others)
    assert offenders == {}


def test_the_training_roles_share_the_worker_core():
    assert issubclass(DiLoCoRole, WorkerCore) and issubclass(SpesRole, WorkerCore)
    for name in ("run", "wait_while_paused", "evaluate", "evaluate_and_publish", "load_checkpoint"):
        assert name not in vars(DiLoCoRole) and name not in vars(SpesRole), name  # inherited, not re-implemented


@pytest.mark.parametrize("overlap, fragments, strategy", [
    ("none", 1, WholeModelRounds), ("none", 2, FragmentRounds), ("delayed", 1, DelayedRounds)])
def test_the_round_strategy_is_chosen_once_from_the_run_config(tmp_path, overlap, fragments, strategy):
    run = RunConfig(model="tiny", seq_len=32, batch_size=4, eval_batches=0,
                    diloco=DiLoCoHyperparams(inner_steps=4, warmup_steps=2, overlap=overlap, fragments=fragments),
                    averaging=AveragingConfig.from_flat(compression="none"))
    node = NodeConfig(checkpoint_dir=str(tmp_path), threads=1, device="cpu")
    worker = DiLoCoRole(RunContext.build("unit", run, node, Hub().transport("peer-a")))
    assert type(worker.rounds) is strategy
    assert len(worker.parts) == len(worker.syncs) == fragments
    assert worker.outer is worker.parts[-1].outer and worker.sync is worker.syncs[-1]
    assert worker.rounds.local_differs == (overlap == "delayed" or fragments > 1)


def test_a_training_role_freezes_the_heap_once_after_joining_before_its_first_inner_step(tmp_path, monkeypatch):
    """The long-lived heap (modules, model, state) leaves the garbage collector's walk once it exists: after the
    join (catch-up, evaluation), before the first inner step, and not again per round."""
    import asyncio

    import peerd.worker.core as core

    order: list[str] = []
    monkeypatch.setattr(core, "freeze_heap", lambda: order.append("freeze") or 1)
    run = RunConfig(model="tiny", seq_len=32, batch_size=4, eval_batches=0, max_outer_rounds=2,
                    diloco=DiLoCoHyperparams(inner_steps=2, warmup_steps=1),
                    averaging=AveragingConfig.from_flat(compression="none", min_group_size=1))
    node = NodeConfig(checkpoint_dir=str(tmp_path), threads=1, device="cpu")
    worker = DiLoCoRole(RunContext.build("unit", run, node, Hub().transport("peer-a")))
    join, step = worker.join, worker._inner_step

    async def joined():
        await join()
        order.append("join")

    def stepped():
        order.append("step")
        return step()

    worker.join, worker._inner_step = joined, stepped
    asyncio.run(worker.run())
    assert worker.outer_round == 2
    assert order[:3] == ["join", "freeze", "step"] and order.count("freeze") == 1, order
