import pytest

from peerd.testing.localswarm import Swarm


@pytest.fixture
def swarm(tmp_path):
    s = Swarm(tmp_path)
    try:
        yield s
    finally:
        s.close()
