"""``daybreak credentials``: print the credential scoped to one kvNamespace, derived from the pool secret."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from daybreak.pool.credentials import CredentialError, agent_credential, namespace_credential


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool-secret-file", required=True, help="file holding the pool secret (the agents' "
                        "--token-file)")
    scope = parser.add_mutually_exclusive_group(required=True)
    scope.add_argument("--namespace", help="the kvNamespace the credential may use")
    scope.add_argument("--agent", action="store_true", help="print the agent credential (for pool peers only)")


def run(args: argparse.Namespace) -> int:
    try:
        secret = Path(args.pool_secret_file).read_text().strip().encode()
    except OSError as exc:
        print(f"daybreak credentials: --pool-secret-file: {exc}", file=sys.stderr)
        return 2
    if not secret:
        print(f"daybreak credentials: --pool-secret-file: {args.pool_secret_file} is empty", file=sys.stderr)
        return 2
    try:
        print(agent_credential(secret) if args.agent else namespace_credential(secret, args.namespace))
    except CredentialError as exc:
        print(f"daybreak credentials: --namespace: {exc}", file=sys.stderr)
        return 2
    return 0
