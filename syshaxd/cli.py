"""`syshax`: the command-line tool — plugins, config files, the default model, benchmarks."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from syshaxd import __version__
from syshaxd.config import KEYS, ConfigError, coerce, from_mapping

PACKAGED_CONFIG = Path(__file__).resolve().parent.parent / "etc" / "syshax.toml"


def _default_config_file() -> Path:
    from syshaxd.daemon import find_config

    return find_config(None) or Path("etc/syshax.toml")


def cmd_plugins(args: argparse.Namespace) -> int:
    from syshaxd.plugins import all_backends, make_plugin_manager

    pm = make_plugin_manager()
    rows = []
    for b in all_backends(pm):
        a = b.availability()
        rows.append({"name": b.name, "device": b.device, "roles": sorted(b.roles), "available": a.available,
                     "reason": a.reason, "description": b.description})
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
    import tomlkit

    path = Path(args.file) if args.file else _default_config_file()
    try:
        doc = tomlkit.parse(path.read_text()) if path.exists() else tomlkit.document()
    except tomlkit.exceptions.ParseError as exc:
        print(f"syshax: {path}: not valid TOML: {exc}", file=sys.stderr)
        return 1
    if args.key is None:
        print(f"# {path}")
        current = from_mapping({k: v for k, v in doc.unwrap().items()}, source=str(path))
        for key in KEYS:
            print(f"{key} = {json.dumps(getattr(current, key))}")
        return 0
    try:
        if args.value is None:
            current = from_mapping(doc.unwrap(), source=str(path))
            if args.key not in KEYS:
                coerce(args.key, "")  # raises the unknown-key error
            print(json.dumps(getattr(current, args.key)))
            return 0
        value = coerce(args.key, args.value)
        from_mapping(doc.unwrap() | {args.key: value}, source=str(path))  # validate before writing
    except ConfigError as exc:
        print(f"syshax: {exc}", file=sys.stderr)
        return 2
    doc[args.key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(tomlkit.dumps(doc))
    print(f"{path}: {args.key} = {json.dumps(value)} (restart syshaxd to apply)")
    return 0


def cmd_model(args: argparse.Namespace) -> int:
    from syshaxd.model import ModelError, prepare_default_model

    try:
        path = prepare_default_model(Path(args.model_dir))
    except ModelError as exc:
        print(f"syshax: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="syshax", description="syshax command-line tool")
    p.add_argument("--version", action="version", version=f"syshax {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    s = sub.add_parser("plugins", help="list installed backends, their roles and whether they run here")
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.set_defaults(func=cmd_plugins)

    s = sub.add_parser("init", help="write a documented config file")
    s.add_argument("path", nargs="?", default="etc/syshax.toml", help="where to write it (default etc/syshax.toml)")
    s.add_argument("--force", action="store_true", help="overwrite an existing file")
    s.set_defaults(func=cmd_init)

    s = sub.add_parser("config", help="show or edit one key of a config file, keeping its comments",
                       description="syshax config             show every key\n"
                                   "syshax config KEY         show one key\n"
                                   "syshax config KEY VALUE   set it (validated), e.g. syshax config cpu_max_batch_size 8",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("key", nargs="?", help=f"one of: {', '.join(KEYS)}")
    s.add_argument("value", nargs="?", help="new value")
    s.add_argument("--file", help="config file (default: the one syshaxd would read, else etc/syshax.toml)")
    s.set_defaults(func=cmd_config)

    s = sub.add_parser("model", help="prepare the embedded default model (SmolLM2-135M-Instruct)")
    s.add_argument("action", choices=["prepare"])
    s.add_argument("--model-dir", default="models", help="where to put it (default ./models)")
    s.set_defaults(func=cmd_model)

    try:
        from syshaxd.bench.command import add_arguments as bench_arguments
        from syshaxd.bench.command import run as bench_run
    except ImportError:
        pass
    else:
        s = sub.add_parser("benchmark", help="benchmark syshaxd modes (or any OpenAI server) side by side")
        bench_arguments(s)
        s.set_defaults(func=bench_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
