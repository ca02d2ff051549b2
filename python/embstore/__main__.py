"""Command line: ``python -m embstore demo`` (the main job), ``bench``,
``inspect`` and ``cache-curve``; ``--help`` lists them, ``--version``."""

from __future__ import annotations

import sys

#: Command -> (module with a ``main(argv) -> int``, one line on what it does).
COMMANDS = {
    "demo": (
        "embstore.demo",
        "train a factorization-machine CTR model on synthetic Criteo-like data (the main job)",
    ),
    "bench": ("embstore.bench", "the peer comparison: embstore against torch, dict, SparseAdam"),
    "inspect": ("embstore.inspect", "what a checkpoint holds, and whether every check holds"),
    "cache-curve": (
        "embstore.gpu.curve",
        "device-cache hit rate per cache size for a recorded key stream",
    ),
}


def usage() -> str:
    width = max(len(c) for c in COMMANDS)
    lines = [
        "usage: python -m embstore COMMAND [options]",
        "",
        "An embedding store for huge sparse features. Commands:",
        *(f"  {name:<{width}}  {line}" for name, (_, line) in COMMANDS.items()),
        "",
        "python -m embstore COMMAND --help   options of one command",
        "python -m embstore --version        the installed version",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        print(usage(), file=sys.stderr)
        return 2
    if args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        from embstore import __version__

        print(f"embstore {__version__}")
        return 0
    if args[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        print(
            f"\nerror: unknown command {args[0]!r} (commands: {', '.join(COMMANDS)})",
            file=sys.stderr,
        )
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[args[0]][0])
    return int(module.main(args[1:]))


if __name__ == "__main__":
    sys.exit(main())
