"""Run and node configuration: presets, schema errors, precedence, env parsing, fingerprints, cross-field checks."""

import dataclasses
from pathlib import Path

import pytest

from peerd.config import ConfigError, NodeConfig, load_node_config
from peerd.run_config import AveragingConfig, RunConfig, load_run_config
from protocols.diloco import DiLoCoHyperparams

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
RUN_PRESETS = sorted((REPO / "node_configs" / "runs").glob("*.toml"))
MACHINE_PRESETS = sorted((REPO / "node_configs" / "machines").glob("*.toml"))
#: Real PeerIDs (Ed25519 keys): initial_peers are checked to end with a well-formed /p2p/<PeerID>.
PEER_A = "12D3KooWKbVaxDqFciM1PngLgGXCskoJKt22WxpPdZ7JMvqUPyVe"
PEER_B = "12D3KooWDptq23arqsipaxkBVToiQZPCgYnmBUo2eYGMRa9FzXeq"
PEER_C = "12D3KooWPEqR8gNoASfa4FWphmfn8iFzfrthqAFxFhYunqvgMVGp"


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------------------ defaults


def test_defaults_are_valid():
    run = RunConfig()
    assert run.model == "small" and run.averaging == AveragingConfig() and run.diloco == DiLoCoHyperparams()
    assert run.averaging.allreduce().reducer_timeout_s > run.averaging.allreduce().sender_timeout_s
    node = NodeConfig()
    assert node.status_ttl_s > node.status_interval_s
    assert load_node_config(None, environ={}) == node
    # the averaging config builds the protocol configs it stands for
    assert run.averaging.matchmaking().request_timeout_s > 0
    assert run.averaging.allreduce().compression == "fp16"


def test_presets_exist():
    assert len(RUN_PRESETS) >= 3 and len(MACHINE_PRESETS) >= 3


@pytest.mark.parametrize("path", RUN_PRESETS, ids=lambda p: p.name)
def test_every_run_preset_loads(path):
    run = load_run_config(path)
    assert isinstance(run, RunConfig)
    # presets set values that differ from the defaults somewhere, and they survive the DHT round trip
    assert run != RunConfig()
    assert RunConfig.from_dict(run.to_dict()) == run
    assert RunConfig.from_dict(run.to_dict()).fingerprint() == run.fingerprint()


@pytest.mark.parametrize("path", MACHINE_PRESETS, ids=lambda p: p.name)
def test_every_machine_preset_loads(path):
    node = load_node_config(str(path), environ={})
    assert isinstance(node, NodeConfig)
    assert node != NodeConfig()


def test_tiny_test_preset_values(tmp_path):
    run = load_run_config(REPO / "node_configs" / "runs" / "tiny-test.toml")
    assert (run.model, run.seq_len, run.max_outer_rounds) == ("tiny", 64, 2)
    assert run.diloco.inner_steps == 10
    # TOML integers given for float fields become floats
    assert run.averaging.allreduce().sender_timeout_s == 10.0
    assert isinstance(run.averaging.allreduce().sender_timeout_s, float)


# ------------------------------------------------------------------------------------------------------ schema errors


@pytest.mark.parametrize(
    "text, key",
    [
        ('modle = "tiny"\n', "modle"),
        ('[averaging]\ncompresion = "fp16"\n', "compresion"),
        ("[diloco]\ninner_step = 3\n", "inner_step"),
        ("[extra]\nx = 1\n", "extra"),
    ],
)
def test_unknown_run_key_names_key_and_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert key in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("text", ['treads = 2\n', '[node]\ntreads = 2\n'])
def test_unknown_node_key_names_key_and_file(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_node_config(str(path), environ={})
    assert "treads" in str(info.value) and str(path) in str(info.value)


def test_top_level_keys_beside_a_node_table_are_not_silently_dropped(tmp_path):
    """A key written above the ``[node]`` header is neither used nor reported today: it must be refused."""
    path = write(tmp_path, 'threads = 3\n[node]\ndevice = "cpu"\n')
    with pytest.raises(ConfigError) as info:
        load_node_config(str(path), environ={})
    assert "threads" in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(
    "text, key",
    [
        ('seq_len = "64"\n', "seq_len"),
        ("seq_len = 64.5\n", "seq_len"),
        ("seq_len = true\n", "seq_len"),
        ("model = 1\n", "model"),
        ('[averaging]\nsender_timeout_s = "10"\n', "sender_timeout_s"),
        ("[averaging]\nmin_group_size = false\n", "min_group_size"),
        ('[diloco]\ninner_lr = "fast"\n', "inner_lr"),
    ],
)
def test_wrong_run_type_names_key_and_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert key in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize(
    "text, key",
    [
        ('[node]\nthreads = "2"\n', "threads"),
        ("[node]\nthreads = true\n", "threads"),
        ("[node]\ndevice = 0\n", "device"),
        ('[node]\nnat_port_map = "yes"\n', "nat_port_map"),
        ("[node]\ninitial_peers = [1, 2]\n", "initial_peers"),
        ("[node]\ndata = 5\n", "data"),
        ('[node]\nstatus_ttl_s = "30"\n', "status_ttl_s"),
    ],
)
def test_wrong_node_type_names_key_and_file(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_node_config(str(path), environ={})
    assert key in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("text, key", [("averaging = 5\n", "averaging"), ('diloco = "x"\n', "diloco")])
def test_a_section_that_is_not_a_table_is_a_config_error(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert key in str(info.value) and str(path) in str(info.value)


def test_a_node_section_that_is_not_a_table_is_a_config_error(tmp_path):
    path = write(tmp_path, "node = 5\n")
    with pytest.raises(ConfigError) as info:
        load_node_config(str(path), environ={})
    assert str(path) in str(info.value)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_run_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not found"):
        load_node_config(str(tmp_path / "nope.toml"), environ={})
    bad = write(tmp_path, "model = \n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_run_config(bad)


def test_out_of_range_values_name_the_file(tmp_path):
    path = write(tmp_path, 'model = "huge"\n')
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert "model" in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ConfigError, match="device"):
        load_node_config(str(write(tmp_path, '[node]\ndevice = "tpu"\n', "n.toml")), environ={})
    with pytest.raises(ConfigError, match="dht must be one of process, inline"):
        load_node_config(str(write(tmp_path, '[node]\ndht = "remote"\n', "d.toml")), environ={})
    assert load_node_config(str(write(tmp_path, '[node]\ndht = "inline"\n', "i.toml")), environ={}).dht == "inline"


def test_string_given_for_a_list_becomes_a_one_element_tuple(tmp_path):
    path = write(tmp_path, f'[node]\ninitial_peers = "/ip4/127.0.0.1/tcp/1/p2p/{PEER_A}"\n')
    assert load_node_config(str(path), environ={}).initial_peers == (f"/ip4/127.0.0.1/tcp/1/p2p/{PEER_A}",)


# ---------------------------------------------------------------------------------------------------------- precedence


def test_precedence_defaults_file_env_overrides(tmp_path):
    path = str(write(tmp_path, '[node]\nthreads = 2\ndevice = "cpu"\nlog_every_steps = 7\n'))
    assert NodeConfig().threads == 0
    from_file = load_node_config(path, environ={})
    assert (from_file.threads, from_file.device, from_file.log_every_steps) == (2, "cpu", 7)
    from_env = load_node_config(path, environ={"PEERD_THREADS": "3"})
    assert (from_env.threads, from_env.device, from_env.log_every_steps) == (3, "cpu", 7)
    from_flags = load_node_config(path, environ={"PEERD_THREADS": "3"}, overrides={"threads": 4, "device": None})
    # a None override means "flag not given": the lower layers stand
    assert (from_flags.threads, from_flags.device, from_flags.log_every_steps) == (4, "cpu", 7)
    # env alone (no file) beats the defaults
    assert load_node_config(None, environ={"PEERD_DEVICE": "cuda:1"}).device == "cuda:1"


def test_environ_defaults_to_os_environ_and_ignores_other_variables(monkeypatch):
    monkeypatch.setenv("PEERD_THREADS", "5")
    monkeypatch.setenv("PEERD_NOT_A_FIELD", "whatever")
    monkeypatch.setenv("THREADS", "9")
    assert load_node_config().threads == 5


def test_unknown_override_is_a_config_error():
    with pytest.raises(ConfigError, match="bogus"):
        load_node_config(None, environ={}, overrides={"bogus": 1})


# -------------------------------------------------------------------------------------------------------- env parsing


def test_env_parsing_of_lists_bools_ints_floats_and_strings():
    env = {
        "PEERD_INITIAL_PEERS": (f"/ip4/1.2.3.4/tcp/1/p2p/{PEER_A}, /ip4/5.6.7.8/tcp/2/p2p/{PEER_B}"
                                f"  /dns/x/tcp/3/p2p/{PEER_C}"),
        "PEERD_HOST_MADDRS": "/ip4/127.0.0.1/tcp/0",
        "PEERD_ANNOUNCE_MADDRS": "",
        "PEERD_NAT_PORT_MAP": "yes",
        "PEERD_THREADS": "8",
        "PEERD_STATUS_INTERVAL_S": "2.5",
        "PEERD_STATUS_TTL_S": "10",
        "PEERD_DATA": "/data/*.txt",
        "PEERD_IDENTITY": "/keys/id.key",
    }
    node = load_node_config(None, environ=env)
    assert node.initial_peers == (f"/ip4/1.2.3.4/tcp/1/p2p/{PEER_A}", f"/ip4/5.6.7.8/tcp/2/p2p/{PEER_B}",
                                  f"/dns/x/tcp/3/p2p/{PEER_C}")
    assert node.host_maddrs == ("/ip4/127.0.0.1/tcp/0",)
    assert node.announce_maddrs == ()
    assert node.nat_port_map is True
    assert node.threads == 8 and isinstance(node.threads, int)
    assert node.status_interval_s == 2.5 and node.status_ttl_s == 10.0 and isinstance(node.status_ttl_s, float)
    assert node.data == "/data/*.txt" and node.identity == "/keys/id.key"


@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), ("TRUE", True), ("Yes", True),
                                           ("0", False), ("false", False), ("no", False), ("NO", False)])
def test_env_bools(raw, expected):
    assert load_node_config(None, environ={"PEERD_NAT_PORT_MAP": raw}).nat_port_map is expected


@pytest.mark.parametrize(
    "var, raw",
    [
        ("PEERD_THREADS", "two"),
        ("PEERD_THREADS", "1.5"),
        ("PEERD_THREADS", ""),
        ("PEERD_NAT_PORT_MAP", "maybe"),
        ("PEERD_NAT_PORT_MAP", ""),
        ("PEERD_STATUS_TTL_S", "soon"),
        ("PEERD_LOG_EVERY_STEPS", "1e3"),
    ],
)
def test_bad_env_value_names_the_variable(var, raw):
    with pytest.raises(ConfigError) as info:
        load_node_config(None, environ={var: raw})
    assert var in str(info.value)


def test_env_value_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match="threads"):
        load_node_config(None, environ={"PEERD_THREADS": "-1"})


# --------------------------------------------------------------------------------------- serialization, fingerprint


def test_run_config_dict_round_trip():
    run = RunConfig(
        model="tiny", seq_len=32, batch_size=4, dataset="local", seed=3, max_outer_rounds=5, eval_batches=0,
        diloco=DiLoCoHyperparams(inner_steps=7, inner_lr=1e-3, inner_betas=(0.8, 0.9), outer_nesterov=False),
        averaging=AveragingConfig.from_flat(compression="int8", min_group_size=2, matchmaking_timeout_s=9.0,
                                  request_timeout_s=2.0, sender_timeout_s=4.0, reducer_timeout_s=8.0),
    )
    data = run.to_dict()
    assert data["diloco"]["inner_betas"] == [0.8, 0.9]
    assert data["averaging"]["allreduce"]["compression"] == data["averaging"]["gossip"]["compression"] == "int8"
    back = RunConfig.from_dict(data)
    assert back == run
    assert back.fingerprint() == run.fingerprint()
    # to_dict is plain data: it survives msgpack-like JSON-ish handling untouched
    assert RunConfig.from_dict(back.to_dict()).to_dict() == data


def test_fingerprint_is_deterministic_short_hex():
    a, b = RunConfig(), RunConfig()
    assert a.fingerprint() == b.fingerprint()
    assert len(a.fingerprint()) == 16 and int(a.fingerprint(), 16) >= 0


@pytest.mark.parametrize(
    "change",
    [
        {"seq_len": 128},
        {"seed": 1},
        {"model": "tiny"},
        {"diloco": DiLoCoHyperparams(inner_lr=1e-3)},
        {"diloco": DiLoCoHyperparams(outer_nesterov=False)},
        {"averaging": AveragingConfig.from_flat(compression="int8")},
        {"averaging": AveragingConfig.from_flat(min_group_size=2)},
    ],
    ids=lambda c: next(iter(c)),
)
def test_any_change_changes_the_fingerprint(change):
    base = RunConfig()
    changed = dataclasses.replace(base, **change)
    assert changed != base
    assert changed.fingerprint() != base.fingerprint()


def test_equal_configs_have_equal_fingerprints_whatever_the_number_types():
    """Integers given for float fields: the config compares equal to its DHT round trip, so must its fingerprint.

    DiLoCoHyperparams converts ints to floats at construction; AveragingConfig does not, so the fingerprint of a
    directly built config differs from the one a peer computes after reading it back from the DHT.
    """
    direct = RunConfig(averaging=AveragingConfig.from_flat(sender_timeout_s=10, reducer_timeout_s=20),
                       diloco=DiLoCoHyperparams(outer_lr=1))
    published = RunConfig.from_dict(direct.to_dict())
    assert published == direct
    assert published.fingerprint() == direct.fingerprint()


# -------------------------------------------------------------------------------------------- cross-field validation


@pytest.mark.parametrize("sender, reducer", [(30.0, 30.0), (30.0, 10.0)])
def test_reducer_timeout_must_exceed_sender_timeout(sender, reducer):
    with pytest.raises(ConfigError, match="reducer_timeout_s"):
        AveragingConfig.from_flat(sender_timeout_s=sender, reducer_timeout_s=reducer)
    with pytest.raises(ConfigError, match="reducer_timeout_s"):
        RunConfig.from_dict({"averaging": {"sender_timeout_s": sender, "reducer_timeout_s": reducer}})
    AveragingConfig.from_flat(sender_timeout_s=sender, reducer_timeout_s=sender + 0.5)


@pytest.mark.parametrize("request_s, matchmaking_s", [(5.0, 5.0), (10.0, 5.0)])
def test_request_timeout_must_be_below_matchmaking_timeout(request_s, matchmaking_s):
    with pytest.raises(ConfigError, match="request_timeout_s"):
        AveragingConfig.from_flat(request_timeout_s=request_s, matchmaking_timeout_s=matchmaking_s)
    AveragingConfig.from_flat(request_timeout_s=matchmaking_s - 0.5, matchmaking_timeout_s=matchmaking_s)


@pytest.mark.parametrize(
    "kwargs",
    [{"method": "ring"}, {"group_size": 1}, {"gossip_partners": 0}, {"compression": "zstd"}, {"min_group_size": 0}, {"sender_timeout_s": 0.0},
     {"matchmaking_timeout_s": -1.0}],
)
def test_other_invalid_averaging_values(kwargs):
    with pytest.raises(ConfigError):
        AveragingConfig.from_flat(**kwargs)


def test_run_config_errors_name_the_source(tmp_path):
    path = write(tmp_path, "[averaging]\nsender_timeout_s = 30\nreducer_timeout_s = 30\n")
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert str(path) in str(info.value) and "reducer_timeout_s" in str(info.value)


@pytest.mark.parametrize("interval, ttl", [(5.0, 5.0), (5.0, 1.0), (0.0, 10.0), (-1.0, 10.0)])
def test_status_ttl_must_exceed_status_interval(interval, ttl):
    with pytest.raises(ConfigError, match="status_ttl_s"):
        NodeConfig(status_interval_s=interval, status_ttl_s=ttl)
    with pytest.raises(ConfigError, match="status_ttl_s"):
        load_node_config(None, environ={"PEERD_STATUS_INTERVAL_S": str(interval), "PEERD_STATUS_TTL_S": str(ttl)})


@pytest.mark.parametrize("kwargs", [{"device": "gpu"}, {"threads": -1}, {"log_every_steps": 0}])
def test_other_invalid_node_values(kwargs):
    with pytest.raises(ConfigError):
        NodeConfig(**kwargs)


def test_node_paths_expand_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    node = NodeConfig(identity="~/id.key", checkpoint_dir="~/ckpt")
    assert node.identity_path == tmp_path / "id.key"
    assert node.checkpoint_path == tmp_path / "ckpt"
    assert NodeConfig(device="cuda:3").device == "cuda:3"


def test_data_plane_choices_and_port_range():
    assert NodeConfig().data_plane == "direct"  # TLS 1.3 between the processes; p2pd for peers not dialable
    assert load_node_config(environ={"PEERD_DATA_PLANE": "direct", "PEERD_DATA_PORT": "31338"}).data_port == 31338
    with pytest.raises(ConfigError, match="data_plane must be p2p or direct"):
        NodeConfig(data_plane="udp")
    with pytest.raises(ConfigError, match="data_port"):
        NodeConfig(data_port=70000)


# ----------------------------------------------------------------------------------------- multiaddrs, identity, paths


@pytest.mark.parametrize("key, value, needle", [
    ("initial_peers", "notamaddr", "notamaddr"),
    ("initial_peers", "/ip4/1.2.3.4/tcp/31337", "/p2p/<PeerID>"),  # reachable, but whom to expect there?
    ("initial_peers", "/ip4/1.2.3.4/tcp/31337/p2p/12D3KooWtruncated", "PeerID"),
    ("initial_peers", f"/ip4/1.2.3/tcp/31337/p2p/{PEER_A}", "1.2.3"),
    ("host_maddrs", "/ip4/0.0.0.0/tcp/99999", "99999"),
    ("host_maddrs", "/ip4/0.0.0.0/tpc/1", "tpc"),
    ("announce_maddrs", "203.0.113.7:31337", "203.0.113.7:31337"),
])
def test_malformed_multiaddrs_are_config_errors_naming_the_key(key, value, needle):
    with pytest.raises(ConfigError) as info:
        NodeConfig(**{key: (value,)})
    assert key in str(info.value) and needle in str(info.value) and info.value.key == key


@pytest.mark.parametrize("maddr", [
    f"/ip4/203.0.113.7/tcp/31337/p2p/{PEER_A}", f"/ip6/::1/tcp/1/p2p/{PEER_B}",
    f"/dns4/boot.example.org/tcp/1/p2p/{PEER_C}",
    f"/ip4/1.2.3.4/udp/1/quic-v1/p2p/{PEER_A}", "/ip4/1.2.3.4/tcp/1/p2p/QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N",
])
def test_well_formed_initial_peers_pass(maddr):
    assert NodeConfig(initial_peers=(maddr,), host_maddrs=("/ip4/127.0.0.1/tcp/0", "/ip6/::/tcp/0")).initial_peers


def test_a_bad_multiaddr_from_a_flag_or_variable_names_the_flag_or_variable(tmp_path):
    path = str(write(tmp_path, f'[node]\ninitial_peers = ["/ip4/1.2.3.4/tcp/1/p2p/{PEER_A}"]\n'))
    with pytest.raises(ConfigError, match="^--initial-peers: invalid multiaddr 'nope'"):
        load_node_config(path, environ={}, overrides={"initial_peers": ("nope",)})
    with pytest.raises(ConfigError, match="^PEERD_HOST_MADDRS: invalid multiaddr 'nope'"):
        load_node_config(path, environ={"PEERD_HOST_MADDRS": "nope"})
    bad_file = str(write(tmp_path, '[node]\nannounce_maddrs = ["nope"]\n', "bad.toml"))
    with pytest.raises(ConfigError, match="announce_maddrs: invalid multiaddr 'nope'") as info:
        load_node_config(bad_file, environ={})
    assert str(info.value).startswith(bad_file)


def test_identity_defaults_to_the_checkpoint_dir_with_one_file_per_kind_of_daemon(tmp_path):
    a, b = NodeConfig(checkpoint_dir=str(tmp_path / "a")), NodeConfig(checkpoint_dir=str(tmp_path / "b"))
    assert a.identity is None
    assert a.identity_path == tmp_path / "a" / "identity.key" and b.identity_path == tmp_path / "b" / "identity.key"
    assert a.identity_path_for("bootstrap") == tmp_path / "a" / "bootstrap.key"
    given = NodeConfig(checkpoint_dir=str(tmp_path / "a"), identity=str(tmp_path / "me.key"))
    assert given.identity_path == given.identity_path_for("bootstrap") == tmp_path / "me.key"


def test_paths_of_the_wrong_kind_are_config_errors(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="checkpoint_dir.*not a folder"):
        NodeConfig(checkpoint_dir=str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="identity.*is a folder"):
        NodeConfig(identity=str(tmp_path))


def test_a_bootstrap_node_and_a_worker_sharing_the_default_checkpoint_dir_get_their_own_control_sockets():
    node = NodeConfig(checkpoint_dir="/tmp/shared")
    assert node.control_socket_path_for("worker") == node.control_socket_path == Path("/tmp/shared/peerd.sock")
    assert node.control_socket_path_for("bootstrap") == Path("/tmp/shared/bootstrap.sock")
    assert node.identity_path_for("worker") != node.identity_path_for("bootstrap")
    pinned = NodeConfig(checkpoint_dir="/tmp/shared", control_socket="/tmp/x.sock")
    assert pinned.control_socket_path_for("bootstrap") == pinned.control_socket_path_for("worker") == Path("/tmp/x.sock")


@pytest.mark.parametrize("table, match", [
    ({"parallelism": "swarm", "model": "tiny", "swarm": {"stages": 5}}, "cannot exceed the 4 blocks"),
    ({"swarm": {"stagez": 2}}, "unknown key 'stagez'"),
    ({"swarm": {"codec": "zip"}}, "codec"),
    ({"swarm": 3}, r"\[swarm\]: expected a table"),
])
def test_bad_swarm_table_is_one_clear_error(table, match):
    from peerd.run_config import RunConfig

    with pytest.raises(ConfigError, match=match):
        RunConfig.from_dict(table)


@pytest.mark.parametrize("table", ["outer_momentum = 0.9", "outer_lr = 0.7", "outer_lr = 0.7\nouter_momentum = 0.0"])
def test_a_swarm_run_config_with_an_outer_step_is_refused(tmp_path, table):
    """A swarm's stage rounds average the replicas (SWARM): a [diloco] outer step there would be ignored, and the
    one it names made the loss climb back, so the file is refused naming the key."""
    path = write(tmp_path, f'parallelism = "swarm"\nmodel = "tiny"\n[diloco]\n{table}\n')
    with pytest.raises(ConfigError) as info:
        load_run_config(path)
    assert str(path) in str(info.value) and "outer_" in str(info.value) and "average" in str(info.value)


def test_a_swarm_run_config_may_spell_out_plain_averaging(tmp_path):
    path = write(tmp_path, 'parallelism = "swarm"\nmodel = "tiny"\n[diloco]\nouter_lr = 1.0\nouter_momentum = 0\n')
    assert load_run_config(path).parallelism == "swarm"
    diloco = write(tmp_path, 'model = "tiny"\n[diloco]\nouter_lr = 0.5\nouter_momentum = 0.5\n', name="diloco.toml")
    assert load_run_config(diloco).diloco.outer_lr == 0.5  # DiLoCo runs keep their outer step
