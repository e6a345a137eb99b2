"""PD across two "hosts" on one machine, from the command line (pdserve.bench.hosts.two_host).

    python scripts/two_host.py up --mode write     # router + P on host a, D on host b, until Ctrl-C
    python scripts/two_host.py client ...          # inside a namespace (same as python -m pdserve.bench.hosts.two_host client)

Needs root (network and PID namespaces). `TwoHostPD` and `metric` are importable from here too.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pdserve.bench.hosts.two_host import TwoHostPD, add_client_parser, metric, run_client  # noqa: E402

__all__ = ["TwoHostPD", "metric"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up")
    up.add_argument("--mode", default="write", choices=("write", "read"))
    up.add_argument("--transport", default="auto")
    add_client_parser(sub)
    args = parser.parse_args()
    if args.command == "client":
        return run_client(args)
    with TwoHostPD(args.mode, {"prefill": args.transport, "decode": args.transport}) as pd:
        print(f"up: router {pd.router_url}, logs in {pd.log_dir}; Ctrl-C stops", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            return 0


if __name__ == "__main__":
    raise SystemExit(main())
