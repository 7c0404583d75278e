"""The one mapping between Tinker paths and Trainyard paths (docs/gateway.md).

    training state   "trainyard://state/<checkpoint id>"   <->  "tinker://<session id>/weights/<checkpoint id>"
    sampler weights  "trainyard://weights/<version id>"    <->  "tinker://<session id>/sampler_weights/<version id>"

A Tinker path names its training run (the trainer session id); the Trainyard path does not need it (ids are global
and each service checks the caller owns what an id names), so going back only checks the path's shape.
"""
from __future__ import annotations

from trainyard.sampling_client import WEIGHTS_PREFIX
from trainyard.training import STATE_PREFIX

TINKER = "tinker://"
KINDS = {"weights": STATE_PREFIX, "sampler_weights": WEIGHTS_PREFIX}


class BadPath(ValueError):
    """A path that is not a Tinker path this gateway maps; the message names the field."""


def to_tinker(session_id: str, trainyard_path: str) -> str:
    for kind, prefix in KINDS.items():
        if trainyard_path.startswith(prefix):
            return f"{TINKER}{session_id}/{kind}/{trainyard_path[len(prefix):]}"
    raise ValueError(f"not a Trainyard state or weights path: {trainyard_path!r}")


def parse_tinker(path: str, field: str = "path") -> tuple[str, str, str]:
    """(session id, kind, id) of "tinker://<session id>/<kind>/<id>"; BadPath naming field otherwise."""
    parts = path[len(TINKER):].split("/") if isinstance(path, str) and path.startswith(TINKER) else []
    if len(parts) != 3 or not all(parts) or parts[1] not in KINDS:
        raise BadPath(f"{field}: expected 'tinker://<training run id>/weights/<id>' or "
                      f"'tinker://<training run id>/sampler_weights/<id>', got {path!r}")
    return parts[0], parts[1], parts[2]


def to_trainyard(path: str, kind: str, field: str = "path") -> str:
    """The Trainyard path of a Tinker path of this kind ("weights" or "sampler_weights")."""
    _, got, ident = parse_tinker(path, field)
    if got != kind:
        raise BadPath(f"{field}: expected a '{kind}' path (tinker://<training run id>/{kind}/<id>), got {path!r}")
    return KINDS[kind] + ident
