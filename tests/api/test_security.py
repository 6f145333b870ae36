"""Who may talk to syshaxd and what a request can reach: API keys, loopback, shared memory, templates, logs."""

from __future__ import annotations

import json
import os
import secrets
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import psutil
import pytest

from conftest import MODEL_NAME, http_json, start_daemon
from syshaxd.api.admin.client import AdminClient
from syshaxd.api.core.auth import KeyCheck, configured_keys
from syshaxd.config import Config, ConfigError, from_mapping

KEY = "sk-syshax-" + secrets.token_hex(16)  # in the config file
FILE_KEY = "sk-file-" + secrets.token_hex(16)  # in api_key_file, found through an environment variable
WRONG = "sk-wrong-" + secrets.token_hex(16)
MARK = "zebra-" + secrets.token_hex(6)  # a word no log line should ever contain


def request(url: str, body: dict | None = None, headers: dict | None = None, method: str | None = None,
            timeout: float = 60.0) -> tuple[int, dict, dict]:
    """status, JSON body and headers of one request, errors included."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"} | (headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            return resp.status, (json.loads(raw) if raw.startswith(b"{") else {}), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        return exc.code, (json.loads(raw) if raw.startswith(b"{") else {}), dict(exc.headers)


@pytest.fixture(scope="module")
def keyed(default_model, tmp_path_factory):
    """A hetero daemon (so it has a KV ring) that wants API keys, on /metrics too."""
    tmp = tmp_path_factory.mktemp("keyed")
    keys = tmp / "api-keys"
    keys.write_text(f"# syshax API keys, one a line\n\n  {FILE_KEY}  \n")
    keys.chmod(0o600)
    d = start_daemon(tmp, {"model": str(default_model), "model_name": MODEL_NAME, "mode": "hetero",
                           "prefill_cpu_affinity": "0", "ring_size_mb": 16, "n_ctx": 1024,
                           "api_keys": [KEY], "api_key_file": "$SYSHAX_TEST_KEYS/api-keys",
                           "metrics_require_key": True, "admin_socket": str(tmp / "admin.sock")},
                     env={"SYSHAX_TEST_KEYS": str(tmp)})
    d.admin_socket = tmp / "admin.sock"
    yield d
    assert d.stop() == 0, d.log()


def authed(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# --- API keys ---------------------------------------------------------------------------------


def test_the_right_keys_work_with_the_openai_client(keyed):
    for key in (KEY, FILE_KEY):
        client = openai.OpenAI(base_url=keyed.base_url, api_key=key, max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [MODEL_NAME]
        r = client.completions.create(model=MODEL_NAME, prompt="The sky is", max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        chunks = list(client.chat.completions.create(model=MODEL_NAME, max_tokens=4, stream=True,
                                                     messages=[{"role": "user", "content": "Hi"}]))
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_a_wrong_or_missing_key_is_an_authentication_error(keyed):
    client = openai.OpenAI(base_url=keyed.base_url, api_key=WRONG, max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert exc.value.body["code"] == "invalid_api_key" and exc.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    # a near miss: the right key with one character changed, or with a suffix
    for near in (KEY[:-1] + ("0" if KEY[-1] != "0" else "1"), KEY + "x", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.base_url, api_key=near, max_retries=0).models.list()


@pytest.mark.parametrize("path, method, body", [
    ("/v1/models", "GET", None),
    (f"/v1/models/{MODEL_NAME}", "GET", None),
    ("/v1/syshax/status", "GET", None),
    ("/v1/completions", "POST", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}),
    ("/v1/chat/completions", "POST", {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/no-such-thing", "GET", None),  # nothing about the API shows without a key, not even what exists
    ("/metrics", "GET", None),  # metrics_require_key = true
])
def test_every_protected_path_answers_401_in_openai_shape(keyed, path, method, body):
    for headers in ({}, authed(WRONG), {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer "},
                    {"Authorization": KEY}):
        status, answer, head = request(keyed.url + path, body, headers, method=method)
        assert status == 401, (path, headers, status, answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"}
        assert answer["error"]["type"] == "authentication_error" and answer["error"]["code"] == "invalid_api_key"
        assert head["WWW-Authenticate"].startswith("Bearer")
        assert KEY not in answer["error"]["message"] and WRONG not in answer["error"]["message"]


def test_probes_and_the_api_document_need_no_key(keyed):
    assert request(keyed.url + "/health")[0] == 200
    status, doc, _ = request(keyed.url + "/openapi.json")
    assert status == 200 and doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert request(keyed.url + "/metrics", headers=authed(KEY))[0] == 200
    assert request(keyed.url + "/v1/syshax/status", headers=authed(FILE_KEY))[0] == 200


def test_which_paths_a_key_protects():
    keys = KeyCheck(("k1",), metrics_require_key=False)
    assert keys.protects("/v1/models") and keys.protects("/v1/completions") and keys.protects("/v1")
    assert not keys.protects("/health") and not keys.protects("/metrics") and not keys.protects("/openapi.json")
    assert not keys.protects("/v1x") and KeyCheck(("k1",), True).protects("/metrics")
    assert not KeyCheck((), True).protects("/v1/completions")  # no keys: an open API
    assert keys.protects("/rerank") and keys.protects("/v1/rerank")  # llama-server's second path runs a model too


def test_every_key_is_compared_in_constant_time(monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append((len(a), len(b))) or real(a, b))
    keys = KeyCheck(("first-key", "second-key-longer", "third"), False)
    assert keys.accepts("first-key") and not keys.accepts("first-ke") and not keys.accepts("")
    # every key, every time, on digests of one length: the match position and the key lengths do not show
    assert len(calls) == 9 and set(calls) == {(32, 32)}


def test_keys_never_reach_the_log_nor_the_admin_socket(keyed):
    request(keyed.url + "/v1/models", headers=authed(WRONG))
    request(keyed.url + "/v1/models", headers=authed(KEY))
    with AdminClient(keyed.admin_socket) as admin:
        values = admin.call("config.get")["values"]
        assert values["api_keys"] == "<1 secret value>" and values["api_key_file"].endswith("api-keys")
        assert admin.call("config.get", key="api_keys")["value"] == "<1 secret value>"
        with pytest.raises(Exception, match="restart"):
            admin.call("config.set", key="api_keys", value=json.dumps([WRONG]))
    # a reload that changes the keys says so without showing them
    config = keyed.log_path.with_suffix(".toml")
    config.write_text(config.read_text().replace(f'api_keys = ["{KEY}"]', f'api_keys = ["{KEY}", "{WRONG}"]'))
    keyed.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "SIGHUP: reloaded" not in keyed.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    log = keyed.log()
    assert "api_keys <1 secret value> -> <2 secret values>" in log
    for secret in (KEY, FILE_KEY, WRONG):
        assert secret not in log


def test_config_errors_name_the_key_not_its_value(tmp_path):
    for data in ({"api_keys": KEY}, {"api_keys": [KEY, 3]}, {"api_keys": [f"{KEY} with space"]}):
        with pytest.raises(ConfigError) as exc:
            from_mapping(data)
        assert str(exc.value).startswith("api_keys") and KEY not in str(exc.value)
    # validation never reads api_key_file (a `syshax mode` must not touch the disk); the daemon does, once
    missing = from_mapping({"api_key_file": str(tmp_path / "not-yet")})
    assert missing.replace(mode="hetero").api_key_file == str(tmp_path / "not-yet")
    with pytest.raises(ConfigError, match="api_key_file: cannot read"):
        configured_keys(missing)
    empty = tmp_path / "keys"
    empty.write_text("# no key yet\n\n")
    with pytest.raises(ConfigError, match="holds no key"):  # fail closed, never silently open
        configured_keys(from_mapping({"api_key_file": str(empty)}))
    empty.write_text(f"{KEY}\n")
    empty.chmod(0)
    if os.geteuid() != 0:  # root reads it anyway
        with pytest.raises(ConfigError, match="api_key_file: cannot read"):
            configured_keys(from_mapping({"api_key_file": str(empty)}))
    done = subprocess.run([sys.executable, "-m", "syshaxd", "--port", "0"], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path,
                          env=os.environ | {"SYSHAX_CONFIG": str(_write(tmp_path / "c.toml",
                                                                        'api_key_file = "/nonexistent/keys"\n'))})
    assert done.returncode == 2 and "api_key_file: cannot read /nonexistent/keys" in done.stderr


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --- where the daemon listens, and what it leaves on the host ------------------------------------------


def test_http_binds_loopback_unless_configured(daemon):
    assert Config().host == "127.0.0.1"
    listening = [c.laddr for c in psutil.Process(daemon.proc.pid).net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and {addr.ip for addr in listening} == {"127.0.0.1"}, listening
    assert f"listening on http://127.0.0.1:{daemon.port}" in daemon.log()


def test_shared_memory_ring_is_0600_and_the_daemons(keyed):
    # the KV ring and the prefix cache's block store
    segments = {Path(f"/dev/shm/syshax-{keyed.proc.pid}-{kind}") for kind in ("kv", "prefix")}
    for segment in segments:
        st = segment.stat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == psutil.Process(keyed.proc.pid).uids().effective == os.geteuid()
    # the workers map those files and no other segment
    for child in psutil.Process(keyed.proc.pid).children():
        maps = {m.path for m in child.memory_maps() if "/dev/shm/" in m.path}
        assert maps <= {str(s) for s in segments}, maps


# --- what a request can reach ---------------------------------------------------------------------


def _chat_template(model_path: Path) -> str:
    """The GGUF's own chat template, as the engine reads it (llama.cpp's loader chatter kept off stderr)."""
    import llama_cpp

    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            llm = llama_cpp.Llama(model_path=str(model_path), vocab_only=True, verbose=False)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    return llm.metadata["tokenizer.chat_template"]


HOSTILE = ("{{ 7*7 }} {% for x in range(3) %}X{% endfor %} {{ ''.__class__.__mro__ }} "
           "{% raw %}{{ raw }}{% endraw %} {{ config }} {# comment #} ${HOME} $(id) `id`")


def test_chat_messages_are_text_not_template(default_model):
    from syshaxd.sdk.gguf.chat import ChatTemplate

    template = ChatTemplate(_chat_template(default_model), "", "<|im_end|>")
    prompt = template.render([{"role": "system", "content": HOSTILE}, {"role": "user", "content": HOSTILE}])
    assert prompt.count(HOSTILE) == 2  # verbatim: nothing evaluated, nothing escaped away
    assert "49" not in prompt and "XXX" not in prompt and "<class" not in prompt


def test_the_daemon_renders_jinja_in_messages_literally(keyed, default_model):
    from syshaxd.sdk.gguf.chat import ChatTemplate

    client = openai.OpenAI(base_url=keyed.base_url, api_key=KEY, max_retries=0, timeout=120)
    messages = [{"role": "user", "content": HOSTILE}]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=8, temperature=0)
    literal = ChatTemplate(_chat_template(default_model), "", "<|im_end|>").render(messages)
    same = client.completions.create(model=MODEL_NAME, prompt=literal, max_tokens=8, temperature=0)
    assert chat.usage.prompt_tokens == same.usage.prompt_tokens
    assert chat.choices[0].message.content == same.choices[0].text
    evaluated = client.chat.completions.create(model=MODEL_NAME, max_tokens=1, temperature=0,
                                               messages=[{"role": "user", "content": "49"}])
    assert evaluated.usage.prompt_tokens < chat.usage.prompt_tokens


@pytest.mark.parametrize("name", ["../../../../etc/passwd", "/etc/passwd", f"{MODEL_NAME}/../{MODEL_NAME}",
                                  f"./{MODEL_NAME}", f"{MODEL_NAME}.gguf", "models/" + MODEL_NAME, "$(id)",
                                  "%2e%2e%2fetc"])
def test_model_names_are_compared_never_opened(daemon, name):
    status, body = http_json(f"{daemon.base_url}/completions", {"model": name, "prompt": "hi", "max_tokens": 1})
    assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
    quoted = urllib.request.quote(name, safe="")
    status, body = http_json(f"{daemon.base_url}/models/{quoted}")
    assert status == 404 and "error" in body


def test_prompts_never_reach_the_log(daemon):
    client = openai.OpenAI(base_url=daemon.base_url, api_key="unused", max_retries=0, timeout=120)
    client.completions.create(model=MODEL_NAME, prompt=f"Tell me about {MARK}.", max_tokens=4)
    client.chat.completions.create(model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": MARK}])
    with pytest.raises(openai.BadRequestError):  # a refused prompt is not logged either
        client.completions.create(model=MODEL_NAME, prompt=f"{MARK} " * 5000, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=MARK, max_tokens=4, temperature=9)
    stream = client.completions.create(model=MODEL_NAME, prompt=f"{MARK} story", max_tokens=200, stream=True)
    next(iter(stream))
    stream.close()  # a client that leaves mid-stream is logged by request id only
    time.sleep(1.5)
    assert MARK not in daemon.log()
    print(f"\n[security] keys: {len(KEY)}-char keys never logged; prompts with a marker word: 0 log lines")
