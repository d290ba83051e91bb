"""Every choice the CLI offers comes from the registry the configs validate against."""

import argparse

import pytest

from peerd import config
from peerd.commands.parser import build_parser
from peerd.commands.export import WEIGHTS
from peerd.models.registry import MODEL_PRESETS
from peerd.roles.registry import OUTER_SYNCS, ROLES
from peerd.run_config import AVERAGING_METHODS, MODEL_NAMES, MOE_MODEL_NAMES, PARALLELISMS
from peerd.runtime.telemetry import LOG_FORMATS

pytestmark = pytest.mark.timeout(60)

#: CLI destination -> the registry its choices must equal.
REGISTRIES = {
    "transport": config.TRANSPORTS,
    "dht": config.DHT_MODES,
    "relay": config.RELAY_MODES,
    "swarm_role": config.SWARM_ROLES,
    "precision": config.PRECISIONS,
    "host_memory_check": config.HOST_MEMORY_CHECKS,
    "log_format": LOG_FORMATS,
    "weights": WEIGHTS,
}


#: Flags whose registry lives in a module the CLI must not import (torch): a copy, kept equal by this test.
COPIES = {"weights"}


def _actions(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _actions(sub)
        elif action.choices is not None:
            yield action


def test_every_cli_choice_list_is_its_registry():
    actions = list(_actions(build_parser()))
    assert {a.dest for a in actions} == set(REGISTRIES), "a flag with choices has no registry (or lost its choices)"
    for action in actions:
        if action.dest in COPIES:
            assert tuple(action.choices) == REGISTRIES[action.dest], action.dest
        else:  # the very object the config validates against, not an equal list that could drift
            assert action.choices is REGISTRIES[action.dest], action.dest


def test_run_config_names_are_the_registries():
    assert MODEL_NAMES == tuple(MODEL_PRESETS)
    assert set(MOE_MODEL_NAMES) == {n for n, p in MODEL_PRESETS.items() if p.family == "moe"} != set()
    assert AVERAGING_METHODS == tuple(OUTER_SYNCS)
    assert PARALLELISMS == tuple(ROLES)


def test_each_registered_outer_sync_answers_to_its_name():
    from peerd.roles.registry import resolve

    for method in OUTER_SYNCS:
        assert resolve(OUTER_SYNCS, method, "averaging method").method == method
    with pytest.raises(KeyError, match="known: \\['allreduce', 'gossip', 'moshpit'\\]"):
        resolve(OUTER_SYNCS, "carrier-pigeon", "averaging method")
