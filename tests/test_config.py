"""Config: the documented file parses, and every bad value names its key."""

from pathlib import Path

import pytest

from syshaxd.config import Config, ConfigError, coerce, from_mapping, load

REPO = Path(__file__).resolve().parents[1]


def test_documented_file_equals_the_defaults():
    cfg = load(REPO / "syshaxd" / "etc" / "syshax.toml")
    assert cfg == Config()


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
