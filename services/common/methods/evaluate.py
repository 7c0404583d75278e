"""Evaluation jobs' settings on the server: the declaration (trainyard/methods/evaluate.py) resolved (resolved.py),
plus the checks that need the database: an evaluator is named, and the checkpoint (if any) is one of the account's,
of the job's base model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from services.common.errors import InvalidArgument, NotFound, Violation
from services.common.methods.resolved import Resolved
from services.common.schema import Checkpoint
from trainyard.methods import METHODS
from trainyard.methods.evaluate import EvalSettings
from trainyard.methods.spec import declared

RESULT_KIND = "eval_results"  # the checkpoint kind holding an evaluation's per-row results (results.jsonl)


@dataclass(frozen=True)
class EvalHyperparams(Resolved, EvalSettings):
    request_prefix: ClassVar[str] = METHODS["eval"].prefix

    def job_violations(self, s, account_id: str, base_model: str) -> list[Violation]:
        return evaluation_violations(self, s, account_id, base_model, self.request_prefix)


def evaluation_violations(settings, s, account_id: str, base_model: str, prefix: str) -> list[Violation]:
    """The evaluation settings' database checks (an evaluation job's, a loop job's): the evaluator is one of the
    account's, the checkpoint (if any) one of its checkpoints of the base model. Fields by their declared proto
    path under prefix (e.g. "spec.eval.evaluator", "spec.loop.eval.evaluator")."""
    from services.common.evaluator_refs import find  # the reference rules (name, name@N, id)

    field = {f.name: prefix + f.setting.proto for f in declared(type(settings))}
    out = []
    if not settings.evaluator.strip():
        out.append(Violation(field["evaluator"], "required: the name (or name@version) of one of your evaluators"))
    else:
        try:
            find(s, account_id, settings.evaluator)
        except (InvalidArgument, NotFound) as exc:
            out.append(Violation(field["evaluator"], exc.message))
    if settings.checkpoint_id:
        ckpt = s.get(Checkpoint, settings.checkpoint_id)
        if ckpt is None or ckpt.account_id != account_id or ckpt.kind == RESULT_KIND:
            out.append(Violation(field["checkpoint_id"], f"no checkpoint '{settings.checkpoint_id}' of yours to "
                                                         "evaluate"))
        elif ckpt.base_model != base_model:
            out.append(Violation(field["checkpoint_id"], f"checkpoint '{ckpt.id}' is of model '{ckpt.base_model}', "
                                                         f"not of spec.base_model '{base_model}'"))
    return out
