"""The admin socket as an operator uses it: `syshax status|config|drain|resume|mode|version` against a live daemon."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import MODEL_DIR, MODEL_NAME, Daemon, free_port, http_json
from syshax_llamacpp.kernels import read_cpu_flags, tiles_decode_cheaply

REPO = Path(__file__).resolve().parents[2]
ADMIN_GROUP = "syshaxtestadm"  # the daemon's admin_group in this module (root only: the test creates it)
OUTSIDER = "syshaxtest"  # a system user outside the admin group
MEMBER = "syshaxtestin"  # a system user in it

CONFIG = """\
# syshaxd config for the admin tests; comments must survive `syshax config set --save`.
model = "{model}"
model_name = "{model_name}"
model_dir = "{model_dir}"

# Requests allowed to wait for a batch slot; past it new requests get HTTP 429.
max_queue_size = 64
admin_socket = "{socket}"
admin_group = "{group}"
"""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture(scope="module")
def accounts():
    """A group and two system users for the peer checks (root only); removed afterwards."""
    if os.geteuid() != 0:
        yield None
        return
    made: list[tuple[str, str]] = []
    try:
        grp.getgrnam(ADMIN_GROUP)
    except KeyError:
        _run("groupadd", "-r", ADMIN_GROUP)
        made.append(("groupdel", ADMIN_GROUP))
    for user, extra in ((OUTSIDER, []), (MEMBER, ["-G", ADMIN_GROUP])):
        try:
            pwd.getpwnam(user)
        except KeyError:
            _run("useradd", "-r", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", *extra, user)
            made.append(("userdel", user))
    yield {"group": ADMIN_GROUP, "outsider": OUTSIDER, "member": MEMBER}
    for tool, name in reversed(made):
        _run(tool, name, check=False)


@pytest.fixture(scope="module")
def admin(default_model, accounts, tmp_path_factory):
    """A daemon with a commented config file and its admin socket in a directory other users may traverse."""
    tmp = tmp_path_factory.mktemp("admin")
    sock_dir = Path(tempfile.mkdtemp(prefix="syshax-admin-", dir="/tmp"))  # short: sun_path holds 107 bytes
    sock_dir.chmod(0o755)
    socket_path = sock_dir / "admin.sock"
    config = tmp / "syshax.toml"
    config.write_text(CONFIG.format(model=default_model, model_name=MODEL_NAME, model_dir=MODEL_DIR,
                                    socket=socket_path, group=ADMIN_GROUP if accounts else "syshax"))
    port = free_port()
    log_path = tmp / "syshaxd.log"
    proc = subprocess.Popen([sys.executable, "-m", "syshaxd", "--config", str(config), "--port", str(port)],
                            cwd=tmp, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    d = Daemon(proc, port, log_path)
    try:
        d.wait_healthy()
        d.socket = socket_path
        d.config = config
        yield d
    finally:
        code = d.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    assert code == 0, d.log()
    assert not socket_path.exists(), "the daemon removes its admin socket when it stops"


def syshax(d: Daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "syshaxd.cli", *args, "--socket", str(d.socket)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


def syshax_json(d: Daemon, *args: str):
    done = syshax(d, *args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_status_shows_mode_engines_and_queue(admin):
    st = syshax_json(admin, "status")
    assert st["mode"] == "cpu" and st["ready"] is True and st["draining"] is False
    assert st["pid"] == admin.proc.pid and st["model"] == MODEL_NAME
    assert st["config_source"] == str(admin.config)
    assert [w["state"] for w in st["workers"]] == ["ready"]
    assert st["capacity"] == 8 + st["max_queue_size"]  # cpu_max_batch_size slots plus the queue
    table = syshax(admin, "status")
    assert table.returncode == 0, table.stderr
    assert "mode cpu" in table.stdout and "WORKER" in table.stdout
    # the GGUF served, its type and what was done with it (the conftest's q4_0 copy of the default: as it is)
    assert st["model_file"]["file_type"] == "Q4_0" and st["model_file"]["quantized_to"] is None
    assert f"model file {st['model_file']['path']} (Q4_0): already q4_0: loaded as it is" in table.stdout
    assert any(line.split()[:3] == ["cpu0", "generate", "ready"] for line in table.stdout.splitlines())
    # which CPU kernels the worker runs, and why (the llama.cpp engine's choice: tests/plugins/test_kernels.py)
    kernels = st["workers"][0]["kernels"]
    assert kernels and f"kernels: {kernels} ({st['workers'][0]['kernels_why']})" in table.stdout
    # and whether the prefix cache keeps what it generates (the default keep_generated_tokens, proved at its
    # warm-up where this CPU tiles a decode step's attention cheaply)
    keeps = st["workers"][0]["keeps_generated"]
    assert keeps == tiles_decode_cheaply(read_cpu_flags())
    assert ("; keeps generated tokens" in table.stdout) == keeps


def test_version_names_client_and_daemon(admin, tmp_path):
    done = syshax(admin, "version")
    assert done.returncode == 0, done.stderr
    client, daemon = done.stdout.splitlines()
    assert client == "syshax 0.1.0" and daemon.startswith(f"syshaxd 0.1.0 (pid {admin.proc.pid},")
    assert syshax_json(admin, "version")["daemon"]["pid"] == admin.proc.pid
    gone = subprocess.run([sys.executable, "-m", "syshaxd.cli", "version", "--socket", str(tmp_path / "none.sock")],
                          capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "syshax 0.1.0" in gone.stdout and "not reachable" in gone.stdout
    assert "is syshaxd running?" in gone.stdout


def test_the_config_file_a_daemon_was_started_with_finds_its_socket(admin, tmp_path):
    # no --socket, no $SYSHAX_ADMIN_SOCKET, no ./etc/syshax.toml: only --config says where the daemon listens
    env = {k: v for k, v in os.environ.items() if k not in ("SYSHAX_ADMIN_SOCKET", "SYSHAX_CONFIG")}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "syshaxd.cli", *args], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=env)

    found = cli("status", "--json", "--config", str(admin.config))
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["pid"] == admin.proc.pid
    missing = cli("status", "--config", str(tmp_path / "none.toml"))
    assert missing.returncode == 1
    assert f"--config {tmp_path / 'none.toml'}: cannot tell where the daemon listens" in missing.stderr
    assert "does not exist" in missing.stderr


def test_config_get_and_set_change_the_live_daemon(admin):
    assert syshax(admin, "config", "get", "max_queue_size").stdout.strip() == "64"
    try:
        done = syshax(admin, "config", "set", "max_queue_size", "5")
        assert done.returncode == 0, done.stderr
        assert "applied to the running syshaxd" in done.stdout and "not saved" in done.stdout
        st = admin.status()
        assert st["max_queue_size"] == 5 and st["capacity"] == 8 + 5
        listing = syshax(admin, "config", "get").stdout
        assert "max_queue_size = 5   *" in listing and 'mode = "cpu"   *' in listing
        assert "max_queue_size = 64" in admin.config.read_text()  # not saved without --save

        for value, words in (("-1", "must be at least 0, got -1"), ("many", "expected an integer, got 'many'")):
            bad = syshax(admin, "config", "set", "max_queue_size", value)
            assert bad.returncode == 2 and "max_queue_size" in bad.stderr and words in bad.stderr, bad.stderr
        unknown = syshax(admin, "config", "set", "no_such_key", "1")
        assert unknown.returncode == 2 and "unknown key 'no_such_key'" in unknown.stderr
        restart = syshax(admin, "config", "set", "n_ctx", "2048")
        assert restart.returncode == 1 and "cannot change while syshaxd runs" in restart.stderr
        assert "--save" in restart.stderr
        assert admin.status()["max_queue_size"] == 5  # refusals changed nothing
        assert http_json(f"{admin.url}/health")[0] == 200
    finally:
        syshax(admin, "config", "set", "max_queue_size", "64")


def test_config_set_save_writes_the_file_keeping_comments(admin):
    before = admin.config.read_text()
    try:
        done = syshax(admin, "config", "set", "max_queue_size", "32", "--save")
        assert done.returncode == 0, done.stderr
        assert f"saved to {admin.config}" in done.stdout
        assert admin.status()["max_queue_size"] == 32
        text = admin.config.read_text()
        assert "max_queue_size = 32" in text and "max_queue_size = 64" not in text
        assert "# Requests allowed to wait for a batch slot" in text and text.startswith("# syshaxd config")
        assert len(text.splitlines()) == len(before.splitlines())

        later = syshax(admin, "config", "set", "n_ctx", "2048", "--save")
        assert later.returncode == 0, later.stderr
        assert "restart syshaxd to apply it" in later.stdout
        assert "n_ctx = 2048" in admin.config.read_text()
        assert syshax(admin, "config", "get", "n_ctx").stdout.strip() == "4096"  # still the running value
        # the file form reads the file, no daemon needed
        file_form = subprocess.run([sys.executable, "-m", "syshaxd.cli", "config", "n_ctx", "--file", str(admin.config)],
                                   capture_output=True, text=True, timeout=60)
        assert file_form.stdout.strip() == "2048", file_form.stderr
        mixed = syshax(admin, "config", "get", "n_ctx", "--file", str(admin.config))
        assert mixed.returncode == 2 and "--file is for editing a file" in mixed.stderr
    finally:
        admin.config.write_text(before)
        syshax(admin, "config", "set", "max_queue_size", "64")


def test_drain_refuses_new_requests_until_resume(admin):
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    done = syshax(admin, "drain", "--wait", "5")
    try:
        assert done.returncode == 0, done.stderr
        assert "draining" in done.stdout and "none in progress" in done.stdout
        status, refused = http_json(f"{admin.base_url}/completions", body)
        assert status == 503 and refused["error"]["code"] == "draining", refused
        health = http_json(f"{admin.url}/health")
        assert health[0] == 503 and health[1]["status"] == "draining"
        st = syshax_json(admin, "status")
        assert st["draining"] is True and "syshax drain" in st["drain_reason"]
        assert "draining: drained by an operator" in syshax(admin, "status").stdout
    finally:
        resumed = syshax(admin, "resume")
    assert resumed.returncode == 0 and "admitting requests" in resumed.stdout
    status, answer = http_json(f"{admin.base_url}/completions", body)
    assert status == 200 and answer["usage"]["completion_tokens"] == 2


def test_mode_switches_only_to_what_this_daemon_serves(admin):
    same = syshax(admin, "mode", "cpu")
    assert same.returncode == 0 and "mode cpu (unchanged)" in same.stdout
    gpu = syshax(admin, "mode", "gpu")
    assert gpu.returncode == 1 and "'gpu' is not available" in gpu.stderr and "GPU engine" in gpu.stderr
    hetero = syshax(admin, "mode", "hetero")
    assert hetero.returncode == 1 and "no prefill engine" in hetero.stderr and "restart" in hetero.stderr
    warp = syshax(admin, "mode", "warp")
    assert warp.returncode == 2 and "invalid choice: 'warp'" in warp.stderr
    assert admin.status()["mode"] == "cpu"


def test_protocol_is_one_json_line_per_request(admin):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(str(admin.socket))
        sock.sendall(b'{"cmd": "help"}\nnot json\n{"cmd": "no_such"}\n{"cmd": "plugins"}\n'
                     b'{"cmd": "config.get", "key": "max_queue_size"}\n')
        reader = sock.makefile("rb")
        replies = [json.loads(reader.readline()) for _ in range(5)]
    assert replies[0]["ok"] and "status" in replies[0]["result"]["commands"]
    assert replies[1] == {"ok": False, "error": {"code": "bad_request", "message": replies[1]["error"]["message"]}}
    assert "one JSON object per line" in replies[1]["error"]["message"]
    assert replies[2]["error"]["code"] == "unknown_command" and "config.set" in replies[2]["error"]["message"]
    assert "llamacpp" in {p["name"] for p in replies[3]["result"]}
    assert replies[4]["result"]["value"] == 64 and replies[4]["result"]["live"] is True


def _interpreter_for(user: str) -> str | None:
    """A Python 3.11+ this user may run (the venv's may sit under /root); None if there is none."""
    for candidate in (sys.executable, "/usr/bin/python3", shutil.which("python3") or ""):
        if not candidate:
            continue
        try:
            probe = subprocess.run([candidate, "-c", "import tomllib"], user=user, cwd="/", capture_output=True,
                                   timeout=30)
        except PermissionError:
            continue
        if probe.returncode == 0:
            return candidate
    return None


def syshax_as(user: str, d: Daemon, *args: str) -> subprocess.CompletedProcess:
    entry = pwd.getpwnam(user)
    groups = os.getgrouplist(user, entry.pw_gid)
    python = _interpreter_for(user)
    if python is None:
        pytest.skip(f"no Python interpreter here is executable by {user}, so the CLI cannot run as that user")
    return subprocess.run([python, "-m", "syshaxd.cli", *args, "--socket", str(d.socket)], capture_output=True,
                          text=True, timeout=60, cwd="/", user=entry.pw_uid, group=entry.pw_gid,
                          extra_groups=groups, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})


def test_peers_outside_root_and_the_admin_group_are_refused(admin, accounts):
    if accounts is None:
        pytest.skip("needs root: it creates system users to connect as another uid")
    sock = admin.socket
    assert sock.stat().st_mode & 0o777 == 0o660
    assert sock.stat().st_gid == grp.getgrnam(ADMIN_GROUP).gr_gid

    # a member of admin_group gets through the file mode and the SO_PEERCRED check
    member = syshax_as(MEMBER, admin, "status", "--json")
    assert member.returncode == 0, member.stderr
    assert json.loads(member.stdout)["pid"] == admin.proc.pid

    # an outsider: first the file mode stops it...
    outsider = syshax_as(OUTSIDER, admin, "status")
    assert outsider.returncode == 1 and f"permission denied on {sock}" in outsider.stderr
    # ...and with the mode opened up by mistake, the daemon's own peer check still does
    sock.chmod(0o666)
    try:
        refused = syshax_as(OUTSIDER, admin, "config", "set", "max_queue_size", "1")
    finally:
        sock.chmod(0o660)
    uid = pwd.getpwnam(OUTSIDER).pw_uid
    assert refused.returncode == 1, refused.stdout
    assert f"uid {uid} ({OUTSIDER}) may not use the syshaxd admin socket" in refused.stderr
    assert f"members of group '{ADMIN_GROUP}'" in refused.stderr and "usermod -aG" in refused.stderr
    assert admin.status()["max_queue_size"] == 64  # nothing changed
    assert "admin socket: refused pid" in admin.log()
