"""How a request names one of the account's evaluators (services/evaluators/): its name (the latest version),
"name@N" (version N) or a version's id ("ev_..."). Here, beside the schema, so that job checks in services/common
and the evaluator store share one rule without services/common importing the sandbox's package."""
from __future__ import annotations

from sqlalchemy import select

from services.common.errors import InvalidArgument, not_found
from services.common.schema import Evaluator

ID_PREFIX = "ev_"


def parse_ref(ref: str) -> tuple[str, int | None, str]:
    """(name, version or None for the latest, id): exactly one of name and id is set."""
    ref = ref.strip()
    if not ref:
        raise InvalidArgument("required: an evaluator name, name@version or id", field="evaluator")
    if ref.startswith(ID_PREFIX):
        return "", None, ref
    name, at, version = ref.partition("@")
    if at:
        if not version.isdigit() or int(version) < 1:
            raise InvalidArgument(f"'{ref}': the version after '@' must be a number >= 1", field="evaluator")
        return name, int(version), ""
    return name, None, ""


def find(session, account_id: str, ref: str) -> Evaluator:
    """The account's evaluator version ref names; NotFound (the same for another account's) otherwise."""
    name, version, ident = parse_ref(ref)
    if ident:
        row = session.get(Evaluator, ident)
        if row is None or row.account_id != account_id:
            raise not_found("evaluator", ref)
        return row
    query = select(Evaluator).where(Evaluator.account_id == account_id, Evaluator.name == name)
    query = query.where(Evaluator.version == version) if version else query.order_by(Evaluator.version.desc())
    row = session.scalars(query.limit(1)).first()
    if row is None:
        raise not_found("evaluator", ref)
    return row
