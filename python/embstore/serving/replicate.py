"""Keep LOCAL a copy of the checkpoint a trainer publishes at SOURCE (a
directory, or a URL: ``http(s)://``, ``s3://``, ... through fsspec), for
``MappedTable(LOCAL, follow=...)`` readers on this host: each new version
is fetched once, every file checked against the manifest (size, CRC-32C)
before the local manifest names it, then published locally as a save
publishes. Runs until interrupted (``--once``: one poll); prints one line
per version published. LOCAL can be the SOURCE of further replicas."""

from __future__ import annotations

import sys
import time

from embstore._cli import Parser, positive_int, require


def _seconds(text: str) -> float:
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected seconds > 0, got {value}")
    return value


def main(argv: list[str]) -> int:
    p = Parser("python -m embstore replicate", __doc__)
    p.add_argument("source", metavar="SOURCE", help="the trainer's checkpoint: a path or URL")
    p.add_argument("local", metavar="LOCAL", help="the directory this host serves from")
    p.add_argument("--period", type=_seconds, default=1.0, help="seconds between polls")
    p.add_argument("--workers", type=positive_int, default=4, help="files fetched at a time")
    p.add_argument("--retries", type=positive_int, default=5, help="tries of a file per poll")
    p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds an HTTP read waits")
    p.add_argument("--once", action="store_true", help="poll once and exit")
    args = p.parse_args(argv)
    if "://" in args.source and not args.source.startswith("file://"):
        require(p, "fsspec", "replicate", "a SOURCE URL")
        if args.source.startswith(("http://", "https://")):
            require(p, "aiohttp", "replicate", "an http(s) SOURCE")

    from embstore.serving.replica import Replica

    replica = Replica(
        args.source,
        args.local,
        period=args.period,
        workers=args.workers,
        retries=args.retries,
        timeout=args.timeout,
        start=False,
    )
    with replica:
        publishes = 0

        def report() -> None:
            nonlocal publishes
            s = replica.stats()
            if s["publishes"] > publishes:
                publishes = s["publishes"]
                lag = (
                    ""
                    if s["lag_seconds"] is None
                    else f", {s['lag_seconds']:.2f} s after the source"
                )
                print(
                    f"published version {s['version']:08x} at {s['last_publish']:.3f} "
                    f"(fetched in {s['fetch_seconds']:.3f} s; {s['files_fetched']} files, "
                    f"{s['bytes_fetched']} bytes fetched so far, {s['retries']} retries{lag})",
                    flush=True,
                )

        if args.once:
            replica.poll()
            report()
            return 0
        while True:
            try:
                replica.poll()
            except Exception as e:
                print(f"poll failed (tried again in {args.period} s): {e}", file=sys.stderr)
            report()
            time.sleep(args.period)
