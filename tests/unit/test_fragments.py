"""Parameter fragments: the whole model as one fragment is today's flat vector and today's group keys."""

import pytest
import torch

from peerd.models import build_model
from peerd.identity.namespace import RunNamespace, RunRef
from peerd.roles.base import ROLES, parallelism, role_class
from peerd.roles.fragments import fragment, whole_model
from peerd.run_config import RunConfig
from protocols.diloco import flatten_parameters

pytestmark = pytest.mark.timeout(60)


def test_whole_model_fragment_is_bit_identical_to_the_flat_parameters_and_keeps_the_keys():
    model = build_model("tiny", 32, 0)
    ns = RunNamespace(run=RunRef.parse("demo@12D3KooWQ4s6d1Yvb2tnUfSx"))  # keys derive from the run name alone
    whole = whole_model(model, ns, "diloco")
    assert whole.scope == "peerd.demo.diloco" and ns.status_key == "peerd.demo.status"
    flat = whole.flatten(model)  # (P,)
    assert torch.equal(flat, flatten_parameters(model)) and whole.numel(model) == flat.numel()
    whole.load_(model, flat + 1.0)
    assert torch.equal(flatten_parameters(model), flat + 1.0)
    with pytest.raises(ValueError):
        whole.load_(model, flat[:-1])


def test_a_scoped_fragment_covers_its_parameters_only_under_its_own_group_keys():
    model = build_model("tiny", 32, 0)
    ns = RunNamespace(run=RunRef.parse("demo"))
    names = tuple(n for n, _ in model.named_parameters())[:2]
    part = fragment(model, "stage0", names, ns, "diloco")
    assert part.scope != ns.prefix("diloco") and part.scope.startswith("peerd.demo.") and "stage0" in part.scope
    before = flatten_parameters(model)
    part.load_(model, torch.zeros(part.numel(model)))
    after = flatten_parameters(model)
    assert torch.count_nonzero(after[:part.numel(model)]) == 0
    assert torch.equal(after[part.numel(model):], before[part.numel(model):])  # the rest is untouched
    with pytest.raises(KeyError):
        fragment(model, "bad", ("no.such.weight",), ns, "diloco")


def test_role_registry_picks_the_runs_parallelism():
    from peerd.roles.diloco import DiLoCoRole

    assert parallelism(RunConfig(model="tiny")) == "diloco" and set(ROLES) >= {"diloco"}
    assert role_class("diloco") is DiLoCoRole
    with pytest.raises(KeyError, match="unknown parallelism 'no-such-role'"):
        role_class("no-such-role")
