"""What a weight-cache pod needs from the cluster, checked before anything in it starts.

The Kubernetes manifests (deploy/kubernetes) run this as a pod's first init container, from the
daemon's image: ``python3 /opt/weight-cache/check_prerequisites.py --token-file ... [--checkpoint
DIR] [--writable DIR]...``. Whatever is missing is named in one line each, with the command that
provides it, and the pod stops at ``Init:Error`` (``kubectl logs POD -c prerequisites``) instead of
starting a daemon that refuses its bind or an engine that falls back for a reason the operator
must dig for. Standard library only: it runs before anything else of the image is trusted to work.
Exit status 0 when everything is there, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# service/settings.py: MIN_EXPOSED_TOKEN_CHARS, what the daemon asks of a token before it binds
# anything but loopback (tests/deploy/test_prerequisites.py keeps the two equal).
MIN_TOKEN_CHARS = 16
PREFIX = "weight-cache prerequisites"


def namespace() -> str:
    """The pod's namespace (the downward API's ``metadata.namespace`` in ``POD_NAMESPACE``)."""
    return os.environ.get("POD_NAMESPACE") or "NAMESPACE"


def node() -> str:
    """The pod's node (the downward API's ``spec.nodeName`` in ``NODE_NAME``)."""
    return os.environ.get("NODE_NAME") or "this node"


def token_problem(path: Path, secret: str, key: str) -> str | None:
    """Why the token file from the Secret is not one the daemon accepts, or ``None``."""
    create = (
        f"kubectl -n {namespace()} create secret generic {secret} "
        f'--from-literal={key}="$(openssl rand -hex 32)"'
    )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return (
            f"the Secret {secret} (key {key}) is missing in namespace {namespace()}, so "
            f"{path} is not there: {create}"
        )
    except OSError as exc:
        return f"cannot read the token {path} (Secret {secret}): {exc.strerror}"
    strength = sum(1 for c in text if not c.isspace())
    if strength < MIN_TOKEN_CHARS:
        return (
            f"the Secret {secret} (key {key}) in namespace {namespace()} holds a token of "
            f"{strength} characters, and the daemon needs at least {MIN_TOKEN_CHARS}: "
            f"kubectl -n {namespace()} delete secret {secret} && {create}"
        )
    return None


def checkpoint_problem(path: Path, claim: str) -> str | None:
    """Why ``path`` is not a checkpoint directory (a ``config.json`` in it), or ``None``."""
    if (path / "config.json").is_file():
        return None
    found = "is not there" if not path.exists() else "holds no config.json"
    return (
        f"the checkpoint {path} {found} on the volume of the PersistentVolumeClaim {claim}: "
        f"copy the checkpoint there, or point the manifests at one it holds"
    )


def directory_problem(path: Path) -> str | None:
    """Why this process (the images' uid 10001) cannot create files in ``path``, or ``None``."""
    if not path.is_dir():
        return f"{path} on {node()} is not a directory: create it, owned by uid and gid 10001"
    if not os.access(path, os.W_OK | os.X_OK):
        return (
            f"{path} on {node()} is not writable by uid {os.getuid()}: on the node, "
            f"`chown 10001:10001 {path} && chmod 0770 {path}`, or in the node image "
            f"`d {path} 0770 10001 10001 -` in /etc/tmpfiles.d/weight-cache.conf"
        )
    return None


def problems(args: argparse.Namespace) -> list[str]:
    found = [token_problem(args.token_file, args.secret, args.secret_key)]
    found += [checkpoint_problem(path, args.claim) for path in args.checkpoint]
    found += [directory_problem(path) for path in args.writable]
    return [p for p in found if p is not None]


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parse.add_argument("--token-file", type=Path, required=True, help="the Secret's token file")
    parse.add_argument("--secret", default="weight-cache-token", help="the Secret's name")
    parse.add_argument("--secret-key", default="token", help="the Secret's key for the token")
    parse.add_argument(
        "--checkpoint", type=Path, action="append", default=[], help="a checkpoint directory"
    )
    parse.add_argument(
        "--claim", default="weight-cache-models", help="the claim whose volume holds checkpoints"
    )
    parse.add_argument(
        "--writable", type=Path, action="append", default=[], help="a directory of the node's"
    )
    return parse


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    found = problems(args)
    for problem in found:
        print(f"{PREFIX}: {problem}", file=sys.stderr)
    if found:
        return 1
    checked = ["the token"] + [str(p) for p in (*args.checkpoint, *args.writable)]
    print(f"{PREFIX}: present: {', '.join(checked)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
