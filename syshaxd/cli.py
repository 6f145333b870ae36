"""`syshax`: the command-line tool — the running daemon (admin socket), plugins, config files, the model, benchmarks."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

from syshaxd import __version__
from syshaxd.config import KEYS, MODES, ConfigError, coerce, from_document, plain, table_of

PACKAGED_CONFIG = Path(__file__).resolve().parent / "etc" / "syshax.toml"  # package data: in the wheel too


def _default_config_file() -> Path:
    from syshaxd.config import find_config

    return find_config(None) or Path("etc/syshax.toml")


def cmd_plugins(args: argparse.Namespace) -> int:
    from syshaxd.sdk.plugins import list_plugins

    rows = list_plugins()  # local: works with or without a running daemon
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no backends installed")
        return 0
    print(f"{'NAME':<12} {'DEVICE':<6} {'ROLES':<26} {'AVAILABLE':<10} DESCRIPTION")
    for r in rows:
        avail = "yes" if r["available"] else "no"
        print(f"{r['name']:<12} {r['device']:<6} {','.join(r['roles']):<26} {avail:<10} {r['description']}")
        if not r["available"]:
            print(f"{'':<12} why not: {r['reason']}")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    target = Path(args.path)
    if target.exists() and not args.force:
        print(f"syshax: {target} already exists; use --force to overwrite it", file=sys.stderr)
        return 1
    if not PACKAGED_CONFIG.is_file():
        print(f"syshax: the documented default config is missing ({PACKAGED_CONFIG})", file=sys.stderr)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(PACKAGED_CONFIG, target)
    print(f"wrote {target}; edit it or run: syshax config KEY VALUE --file {target}")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    words = list(args.words)
    if words and words[0] in ("get", "set"):
        if args.file:
            return _usage("config", f"--file is for editing a file (syshax config KEY VALUE --file PATH); "
                                    f"`syshax config {words[0]}` talks to the running daemon (--socket PATH)")
        if words[0] == "get":
            if len(words) > 2:
                return _usage("config", "usage: syshax config get [KEY]")
            return _live(args, _config_get, words[1] if len(words) > 1 else None)
        if len(words) != 3:
            return _usage("config", "usage: syshax config set KEY VALUE [--save]")
        return _live(args, _config_set, words[1], words[2])
    if args.save:
        return _usage("config", "--save goes with `syshax config set KEY VALUE` (the running daemon); "
                                "the file form writes the file anyway")
    if len(words) > 2:
        return _usage("config", "usage: syshax config [KEY [VALUE]] [--file PATH]")
    args.key = words[0] if words else None
    args.value = words[1] if len(words) > 1 else None
    return _config_file(args)


def _config_file(args: argparse.Namespace) -> int:
    import tomlkit

    path = Path(args.file) if args.file else _default_config_file()
    try:
        doc = tomlkit.parse(path.read_text()) if path.exists() else tomlkit.document()
    except tomlkit.exceptions.ParseError as exc:
        print(f"syshax: {path}: not valid TOML: {exc}", file=sys.stderr)
        return 1
    if args.key is None:
        print(f"# {path}")
        current = from_document(doc.unwrap(), str(path))
        for key in KEYS:
            print(f"{key} = {json.dumps(plain(key, getattr(current, key)))}")
        return 0
    try:
        if args.value is None:
            current = from_document(doc.unwrap(), str(path))
            if args.key not in KEYS:
                coerce(args.key, "")  # raises the unknown-key error
            print(json.dumps(plain(args.key, getattr(current, args.key))))
            return 0
        value = coerce(args.key, args.value)
        from_document(doc.unwrap(), str(path), {args.key: value})  # check first
    except ConfigError as exc:
        print(f"syshax: {exc}", file=sys.stderr)
        return 2
    set_in_document(doc, args.key, value)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomlkit.dumps(doc))
    print(f"{path}: {args.key} = {json.dumps(value)} (restart syshaxd to apply)")
    return 0


# --- the running daemon, over its admin socket -----------------------------------------------


def _usage(command: str, message: str) -> int:
    print(f"syshax {command}: {message}", file=sys.stderr)
    return 2


def _admin_client(args: argparse.Namespace):
    """A connection to the daemon: --socket, else $SYSHAX_ADMIN_SOCKET, the config's admin_socket (--config's, else
    the file the daemon finds without one), the defaults."""
    from syshaxd.api.admin.unix_socket import client_candidates
    from syshaxd.api.admin.client import AdminClient, AdminUnreachable
    from syshaxd.config import find_config, load

    if args.socket:
        return AdminClient(args.socket)
    explicit = getattr(args, "config", None)
    try:
        cfg = load(find_config(explicit))
    except (ConfigError, OSError) as exc:
        if explicit:  # named, so not passed over: its admin_socket is where the daemon listens
            raise AdminUnreachable(f"--config {explicit}: cannot tell where the daemon listens: {exc}") from None
        cfg = None
    tried = client_candidates(cfg, os.environ)
    for path in tried:
        if path.exists():
            return AdminClient(path)
    raise AdminUnreachable(f"no admin socket found (looked at {', '.join(map(str, tried))}): is syshaxd running? "
                           "(systemctl status syshaxd) Pass --socket PATH, or --config PATH (the file it was started "
                           "with), if it listens elsewhere")


def _live(args: argparse.Namespace, action, *params) -> int:
    """Run action(client, args, *params) against the daemon; turn its refusals into messages and exit codes."""
    from syshaxd.api.admin.client import AdminError, AdminUnreachable

    try:
        with _admin_client(args) as client:
            return action(client, args, *params)
    except AdminUnreachable as exc:
        print(f"syshax: {exc}", file=sys.stderr)
        return 1
    except AdminError as exc:
        print(f"syshax: {exc.message}", file=sys.stderr)
        return 2 if exc.code in ("invalid_value", "unknown_key", "bad_request") else 1


def _show(args: argparse.Namespace, result, human) -> int:
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        human(result)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from syshaxd.status_text import print_status

    return _live(args, lambda c, a: _show(a, c.call("status"), print_status))


def cmd_cache(args: argparse.Namespace) -> int:
    if args.action == "warm":
        if not args.file:
            print("syshax: cache warm needs a FILE of prompts (JSON lines: {\"prompt\": ...} or "
                  "{\"messages\": [...]})", file=sys.stderr)
            return 2
        try:
            entries = _warm_entries(Path(args.file))
        except (OSError, ValueError) as exc:
            print(f"syshax: {exc}", file=sys.stderr)
            return 2
        return _live(args, _warm, entries)
    if args.action == "clear":
        return _live(args, lambda c, a: _show(a, c.call("cache.clear"), lambda r: print(
            f"cleared {r['blocks']} blocks from shared memory and {r['files']} files from disk")))
    return _live(args, lambda c, a: _show(a, c.call("cache.stats"), _print_cache))


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _live(args, lambda c, a: _show(a, c.call("models.list"), _print_models))
    if not args.name:
        return _usage("models", f"models {args.action} needs the NAME of a [[models]] entry")

    def act(client, a) -> int:
        client.set_timeout(None)  # a load takes up to worker_start_timeout; an unload waits for the requests using it
        return _show(a, client.call(f"models.{a.action}", name=a.name), _MODEL_ANSWERS[a.action])

    return _live(args, act)


_MODEL_ANSWERS = {
    "load": lambda r: print(f"{r['name']}: {r['state']} ({'daemon' if r['kind'] == 'chat' else 'worker'} pid "
                            f"{r['pid'] if r['kind'] == 'chat' else (r['worker'] or {}).get('pid')}, "
                            f"{r['rss_mib']} MiB)"),
    "unload": lambda r: print(f"{r['name']}: unloaded" if r["unloaded"] else f"{r['name']}: was not loaded"),
}


def _print_models(models: list) -> None:
    if not models:
        print("no [[models]] entries: this daemon serves its chat model alone")
        return
    print(f"{'MODEL':<20} {'KIND':<9} {'STATE':<11} {'LOAD':<10} {'KEEP_ALIVE':>10} {'RSS_MIB':>8} {'REQUESTS':>8} "
          f"{'LOADS':>5} {'UNLOADS':>7}  FILE")
    for m in models:
        keep = "never" if m["keep_alive"] < 0 else f"{m['keep_alive']:g}s"
        print(f"{m['name']:<20} {m['kind']:<9} {m['state']:<11} {m['load']:<10} {keep:>10} {m['rss_mib']:>8} "
              f"{m['requests']:>8} {m['loads']:>5} {m['unloads']:>7}  {m['file']}"
              + (f"  ({m['error']})" if m.get("error") else ""))


def _warm_entries(path: Path) -> list[dict]:
    """The prompts of a warm file: one JSON object per line, {"prompt": ...} or {"messages": [...]}."""
    entries = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n}: not JSON ({exc.msg}); write one object per line, "
                             '{"prompt": "..."} or {"messages": [...]}') from None
        if not isinstance(entry, dict) or ("prompt" in entry) == ("messages" in entry):
            raise ValueError(f'{path}:{n}: an object with "prompt" or "messages" (one of them), e.g. '
                             '{"messages": [{"role": "system", "content": "..."}]}')
        entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no prompts in it")
    return entries


def _warm(client, args: argparse.Namespace, entries: list[dict]) -> int:
    client.set_timeout(None)  # a long prompt takes what its prefill takes; the daemon bounds it (request_timeout)
    results = []
    for n, entry in enumerate(entries, 1):
        result = client.call("cache.warm", entry=entry)
        results.append(result)
        if not args.json:
            print(f"{n}: {result['prompt_tokens']} prompt tokens, {result['cached_tokens']} of them cached already")
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


def _print_cache(status: dict) -> None:
    from syshaxd.status_text import print_prefix_cache

    print_prefix_cache(status)


def _config_get(client, args: argparse.Namespace, key: str | None) -> int:
    result = client.call("config.get", **({"key": key} if key else {}))
    if args.json:
        print(json.dumps(result, indent=2))
    elif key:
        print(json.dumps(result["value"]))
    else:
        live = set(result["live_keys"])
        print(f"# the running syshaxd's values (config file: {result['source'] or 'none'}); "
              "* = can change live with `syshax config set`")
        for k, v in result["values"].items():
            print(f"{k} = {json.dumps(v)}{'   *' if k in live else ''}")
    return 0


def _config_set(client, args: argparse.Namespace, key: str, value: str) -> int:
    if not args.save:
        result = client.call("config.set", key=key, value=value)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            print(f"{key} = {json.dumps(result['value'])} (was {json.dumps(result['old'])}; applied to the running "
                  "syshaxd, not saved: add --save to keep it across restarts)")
        return 0
    check = client.call("config.set", key=key, value=value, dry_run=True)
    source = check["source"]
    if not source:
        print("syshax: syshaxd was started without a config file, so --save has nowhere to write; "
              "start it with --config PATH (or write one: syshax config KEY VALUE --file PATH)", file=sys.stderr)
        return 1
    result = client.call("config.set", key=key, value=value) if check["live"] else check
    try:
        _save_key(Path(source), key, check["value"])
    except (OSError, ConfigError) as exc:
        note = "it is applied to the running syshaxd but " if result.get("applied") else ""
        print(f"syshax: cannot save {key} to {source}: {getattr(exc, 'strerror', None) or exc}; "
              f"{note}not saved (run as root?)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result | {"saved": source}, indent=2))
    elif check["live"]:
        print(f"{key} = {json.dumps(check['value'])} (applied to the running syshaxd; saved to {source})")
    else:
        why = check.get("why_not_live") or f"{key} is read when syshaxd starts"
        print(f"{key} = {json.dumps(check['value'])} saved to {source}; restart syshaxd to apply it "
              f"(systemctl restart syshaxd): {why}")
    return 0


def _save_key(path: Path, key: str, value) -> None:
    """Set one key in a TOML file, keeping its comments and layout; the whole file must stay valid."""
    import tomlkit

    try:
        doc = tomlkit.parse(path.read_text())
    except tomlkit.exceptions.ParseError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None
    from_document(doc.unwrap(), str(path), {key: value})
    set_in_document(doc, key, value)
    path.write_text(tomlkit.dumps(doc))  # in place: the file keeps its owner and mode


def set_in_document(doc, key: str, value) -> None:
    """Set one key in a tomlkit document where it belongs: in its table (made, at the end, where the file has
    none), or at the top level where the file already holds it there (a file written before the tables)."""
    import tomlkit

    table = table_of(key)
    if not table or key in doc:
        doc[key] = value
        return
    if table not in doc:
        doc[table] = tomlkit.table()
    doc[table][key] = value


def cmd_drain(args: argparse.Namespace) -> int:
    def drain(client, a):
        result = client.call("drain", wait=a.wait)
        if a.json:
            print(json.dumps(result, indent=2))
        elif result["drained"]:
            print("draining: new requests get 503; none in progress (syshax resume admits requests again)")
        else:
            waited = f" after waiting {a.wait:g}s" if a.wait else ""
            print(f"draining: new requests get 503; {result['in_flight']} still in progress{waited} "
                  "(syshax resume admits requests again)")
        return 0

    return _live(args, drain)


def cmd_resume(args: argparse.Namespace) -> int:
    def resume(client, a):
        result = client.call("resume")
        return _show(a, result, lambda r: print("admitting requests" + ("" if r["was_draining"] else
                                                                       " (it was not draining)")))

    return _live(args, resume)


def cmd_mode(args: argparse.Namespace) -> int:
    def mode(client, a):
        result = client.call("mode", mode=a.mode)
        return _show(a, result, lambda r: print(f"mode {r['mode']}" + (f" (was {r['previous']})" if r["changed"]
                                                                        else " (unchanged)")))

    return _live(args, mode)


def cmd_version(args: argparse.Namespace) -> int:
    from syshaxd.api.admin.client import AdminError, AdminUnreachable

    try:
        with _admin_client(args) as client:
            daemon, error = client.call("version"), ""
            where = str(client.path)
    except (AdminUnreachable, AdminError) as exc:
        daemon, error, where = None, str(exc), ""
    if args.json:
        print(json.dumps({"client": __version__, "daemon": daemon, "socket": where, "error": error or None},
                         indent=2))
    else:
        print(f"syshax {__version__}")
        if daemon:
            from syshaxd.status_text import duration

            print(f"syshaxd {daemon['version']} (pid {daemon['pid']}, up {duration(daemon['uptime_s'])}, "
                  f"mode {daemon['mode']}, on {where})")
        else:
            print(f"syshaxd: not reachable: {error}")
    return 0 if daemon else 1


def cmd_model(args: argparse.Namespace) -> int:
    from syshaxd.model import ModelError, prepare_default_model

    model_dir = Path(args.model_dir)
    try:
        path = prepare_default_model(model_dir)
        if args.hf:  # the torch/vLLM copy of the q4_0 GGUF the CPU decoders load (hf_model says why)
            from syshaxd.sdk.gguf.quantize import ensure_quantized
            from syshaxd.sdk.hf_model import HFModelError, ensure_hf_folder

            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's own loader log
            try:
                path = ensure_hf_folder(ensure_quantized(path, "q4_0", model_dir))
            except HFModelError as exc:
                raise ModelError(str(exc)) from exc
    except (ModelError, RuntimeError) as exc:
        print(f"syshax: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="syshax", description="syshax command-line tool",
                                epilog="status, config get/set, drain, resume, mode and version talk to the running "
                                       "syshaxd over its admin socket (root or the syshax group).")
    p.add_argument("--version", action="version", version=f"syshax {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    admin = argparse.ArgumentParser(add_help=False)
    admin.add_argument("--socket", metavar="PATH",
                       help="the daemon's admin socket, which it logs at start (default: $SYSHAX_ADMIN_SOCKET; "
                            "else the admin_socket of --config's file, or of the file found as the daemon finds it "
                            "without --config "
                            "($SYSHAX_CONFIG, ./etc/syshax.toml, /etc/syshax/syshax.toml); else the first that "
                            "exists of /run/syshax/admin.sock, $XDG_RUNTIME_DIR/syshax/admin.sock and "
                            "MODEL_DIR/admin.sock)")
    admin.add_argument("--config", metavar="PATH",
                       help="the config file the daemon was started with (syshaxd --config PATH): its admin_socket "
                            "is where to reach it")
    admin.add_argument("--json", action="store_true", help="print JSON instead of text")

    s = sub.add_parser("plugins", help="list installed backends, their roles and whether they run here")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_plugins)

    s = sub.add_parser("init", help="write a documented config file")
    s.add_argument("path", nargs="?", default="etc/syshax.toml", help="where to write it (default etc/syshax.toml)")
    s.add_argument("--force", action="store_true", help="overwrite an existing file")
    s.set_defaults(func=cmd_init)

    s = sub.add_parser(
        "config", parents=[admin], help="the running daemon's config (get/set), or a config file's keys",
        usage="syshax config get [KEY] | set KEY VALUE [--save]   (the running syshaxd)\n"
              "       syshax config [KEY [VALUE]] [--file PATH]          (a config file)",
        description="The running daemon, over its admin socket (--socket, --json):\n"
                    "  syshax config get               every key's live value\n"
                    "  syshax config get KEY           one key's live value\n"
                    "  syshax config set KEY VALUE     change it now (validated)\n"
                    "  syshax config set KEY VALUE --save\n"
                    "                                  ... and write it to the file the daemon was started with\n"
                    f"  Keys that change live: {', '.join(sorted(_live_keys()))}, mode.\n"
                    "  Others: set them with --save, then restart syshaxd.\n"
                    "A config file, no daemon needed (comments are kept):\n"
                    "  syshax config                   show every key of the file\n"
                    "  syshax config KEY               show one key\n"
                    "  syshax config KEY VALUE         set it (validated), e.g. syshax config cpu_max_batch_size 8",
        epilog=f"keys: {', '.join(KEYS)}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("words", nargs="*", metavar="ARG", help=argparse.SUPPRESS)
    s.add_argument("--file", help="file form: the config file (default: the one syshaxd would read, "
                                  "else etc/syshax.toml)")
    s.add_argument("--save", action="store_true", help="with `set`: also write the key to the daemon's config file")
    s.set_defaults(func=cmd_config)

    s = sub.add_parser("status", parents=[admin], help="the running daemon: mode, engines, queue, batch, KV ring")
    s.set_defaults(func=cmd_status)
    s = sub.add_parser("drain", parents=[admin], help="stop admitting requests (503); in-flight ones finish")
    s.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to SECONDS for the requests in progress to finish")
    s.set_defaults(func=cmd_drain)
    s = sub.add_parser("resume", parents=[admin], help="admit requests again after `syshax drain`")
    s.set_defaults(func=cmd_resume)
    s = sub.add_parser("mode", parents=[admin], help="switch where new requests run (cpu, gpu, hetero, auto)")
    s.add_argument("mode", choices=MODES)
    s.set_defaults(func=cmd_mode)
    s = sub.add_parser("cache", parents=[admin], help="the prefix cache: stats, clear, or warm FILE (compute and "
                       "keep its prompts ahead of traffic)",
                       description="stats: the prefix cache in shared memory and on disk. clear: forget every block "
                       "no request is using, in both tiers. warm FILE: run each prompt of FILE (JSON lines, "
                       '{"prompt": "..."} or {"messages": [...]}) for one token, so that its blocks are kept.')
    s.add_argument("action", choices=["stats", "clear", "warm"])
    s.add_argument("file", nargs="?", help="warm: the prompts, one JSON object per line")
    s.set_defaults(func=cmd_cache)
    s = sub.add_parser("models", parents=[admin], help="the models of [[models]] (chat and embedding): list, load "
                       "NAME or unload NAME",
                       description="list: each [[models]] entry, its kind, state and memory. load NAME: load it "
                       "now (one that failed to load is tried again). unload NAME: stop its worker (an embedding "
                       "model) or its daemon (a chat model) once the requests using it are done, giving its memory "
                       "back (its next request loads it again). The daemon's own model always stays loaded.")
    s.add_argument("action", choices=["list", "load", "unload"])
    s.add_argument("name", nargs="?", help="load, unload: the entry's name")
    s.set_defaults(func=cmd_models)
    s = sub.add_parser("version", parents=[admin], help="this tool's version and the running daemon's")
    s.set_defaults(func=cmd_version)

    s = sub.add_parser("model", help="prepare the embedded default model (SmolLM2-135M-Instruct)")
    s.add_argument("action", choices=["prepare"])
    s.add_argument("--model-dir", default="models", help="where to put it (default ./models)")
    s.add_argument("--hf", action="store_true",
                   help="also make its q4_0 copy and the Hugging Face folder the torch and vLLM prefill engines load "
                        "from it (else the first gpu/hetero start makes them); prints the folder")
    s.set_defaults(func=cmd_model)

    try:
        from syshaxd.benchmark.command import add_arguments as bench_arguments
        from syshaxd.benchmark.command import run as bench_run
    except ImportError:
        pass
    else:
        s = sub.add_parser("benchmark", help="benchmark syshaxd modes (or any OpenAI server) side by side")
        bench_arguments(s)
        s.set_defaults(func=bench_run)
    return p


def _live_keys() -> frozenset:
    from syshaxd.config import LIVE_KEYS

    return LIVE_KEYS


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
