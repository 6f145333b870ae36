"""Config: the documented file parses, and every bad value names its key."""

from pathlib import Path

import pytest

from syshaxd.config import (KEYS, TABLES, Config, ConfigError, coerce, flat_keys_warning, from_mapping, from_tables,
                            load, table_of, toml_text)

REPO = Path(__file__).resolve().parents[2]


def test_documented_file_equals_the_defaults():
    cfg = load(REPO / "syshaxd" / "etc" / "syshax.toml")
    assert cfg == Config()


def test_documented_file_holds_every_key_in_its_table():
    import tomllib

    data = tomllib.loads((REPO / "syshaxd" / "etc" / "syshax.toml").read_text())
    assert list(data) == list(TABLES)  # the tables, in the reference's order, and nothing at the top level
    for table in TABLES:
        expected = [k for k in KEYS if table_of(k) == table and k != "routing_rules"]
        assert sorted(data[table]) == sorted(expected), table
    assert not load(REPO / "syshaxd" / "etc" / "syshax.toml").flat_keys


def test_a_file_of_before_the_tables_is_read_as_it_is_with_one_warning(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text('port = 9000\nn_ctx = 2048\nmode = "cpu"\n[[routing_rules]]\nname = "r"\npriority = 1\n'
                    'conditions = [{field = "max_tokens", operator = "gte", value = 8}]\naction = {device = "CPU"}\n')
    tables = tmp_path / "tables.toml"
    tables.write_text('[server]\nport = 9000\n[engines]\nn_ctx = 2048\nmode = "cpu"\n[[auto.routing_rules]]\n'
                      'name = "r"\npriority = 1\nconditions = [{field = "max_tokens", operator = "gte", value = 8}]\n'
                      'action = {device = "CPU"}\n')
    old, new = load(flat), load(tables)
    assert old == new and new.port == 9000 and new.routing_rules[0].name == "r"
    assert not new.flat_keys and flat_keys_warning(new) == ""
    assert old.flat_keys == ("port", "n_ctx", "mode", "routing_rules")
    assert flat_keys_warning(old) == (f"{flat}: 4 key(s) at the top level, read as before; each now lives in a table: "
                                      "move port to [server]; n_ctx, mode to [engines]; routing_rules to [auto] "
                                      "(`syshax init` writes the documented file with its tables)")


@pytest.mark.parametrize("data, message", [
    ({"engines": {"port": 1}}, "[engines] port: port belongs in [server]; move it there"),
    ({"engines": {"models": []}}, "[engines] models: models belongs in the top level, as [[models]] tables"),
    ({"port": 1, "server": {"port": 2}}, "port is set twice, at the top level and in [server]"),
    ({"server": {"port": 2}, "port": 1}, "port is set twice, at the top level and in [server]"),
    ({"server": {"prot": 2}}, "unknown key [server] prot; the keys of [server]: host, port,"),
    ({"server": 5}, "server: expected the table [server] of keys, got 5"),
    ({"engine": {"n_ctx": 1}}, "unknown table [engine]; the tables: [server], [serve], [engines],"),
])
def test_a_key_out_of_its_table_is_named(data, message):
    with pytest.raises(ConfigError) as exc:
        from_tables(data, "f.toml")
    assert message in str(exc.value) and str(exc.value).startswith("f.toml: ")


def test_a_config_written_by_the_daemon_has_its_keys_in_their_tables():  # a chat model's daemon's
    import tomllib

    values = {"port": 0, "n_ctx": 512, "mode": "cpu", "speculative_tokens": 0, "api_keys": ["k" * 20],
              "remote_nodes": [], "prefix_cache_dir": "/tmp/x"}
    flat, at_top = from_tables(tomllib.loads(toml_text(values)))
    assert flat == values and at_top == ()


@pytest.mark.parametrize(
    "data, key",
    [
        ({"mode": "turbo"}, "mode"),
        ({"port": 70000}, "port"),
        ({"port": "80"}, "port"),
        ({"cpu_max_batch_size": 0}, "cpu_max_batch_size"),
        ({"quantize": "q3_k"}, "quantize"),
        ({"cpu_affinity": "0-x"}, "cpu_affinity"),
        ({"request_timeout": True}, "request_timeout"),
        ({"log_level": "loud"}, "log_level"),
    ],
)
def test_bad_values_name_the_key(data, key):
    with pytest.raises(ConfigError) as exc:
        from_mapping(data)
    assert str(exc.value).startswith(key)


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(ConfigError, match="unknown key.*cpu_max_batchsize.*known keys"):
        from_mapping({"cpu_max_batchsize": 8})


def test_flags_override_the_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('port = 9000\nmode = "cpu"\n')
    assert load(f, {"port": 9100, "host": None}).port == 9100


def test_missing_and_broken_files_say_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="syshax init"):
        load(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("port = = 3")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(bad)


def test_coerce_turns_cli_strings_into_typed_values():
    assert coerce("cpu_max_batch_size", "8") == 8
    assert coerce("request_timeout", "2.5") == 2.5
    with pytest.raises(ConfigError, match="cpu_max_batch_size: expected an integer"):
        coerce("cpu_max_batch_size", "eight")


def test_the_daemon_says_once_where_top_level_keys_now_live(tmp_path):
    import subprocess
    import sys

    flat = tmp_path / "flat.toml"
    flat.write_text("port = 0\nn_ctx = 2048\n")
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--config", str(flat), "--model", str(tmp_path / "no.gguf")],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 2 and "no.gguf does not exist" in done.stderr  # it read the file, then the model
    warnings = [line for line in done.stderr.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and "move port to [server]; n_ctx to [engines]" in warnings[0], done.stderr


def test_a_reload_line_names_the_tables_it_changed():
    """A reload's log line gives routing_rules and [[models]] by count and by name, not their whole tables."""
    from syshaxd.api.core.state import ConfigChange
    from syshaxd.config import from_mapping

    def rule(name: str, priority: int) -> dict:
        return {"name": name, "priority": priority, "action": {"device": "CPU"},
                "conditions": [{"field": "model", "operator": "eq", "value": name}]}

    old = from_mapping({"routing_rules": [rule("kept", 1), rule("moved", 2), rule("gone", 3)]}).routing_rules
    new = from_mapping({"routing_rules": [rule("kept", 1), rule("moved", 5), rule("new", 4)]}).routing_rules
    line = ConfigChange(applied={"routing_rules": (old, new), "max_queue_size": (64, 3)}).describe()
    assert line == ("applied routing_rules 3 -> 3 (added 'new'; changed 'moved'; removed 'gone'), "
                    "max_queue_size 64 -> 3")
    assert ConfigChange(applied={"routing_rules": (old, old)}).describe() == "applied routing_rules 3 -> 3"
