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

RESULT_KIND = "eval_results"  # the checkpoint kind holding an evaluation's per-row results (results.jsonl)


@dataclass(frozen=True)
class EvalHyperparams(Resolved, EvalSettings):
    request_prefix: ClassVar[str] = METHODS["eval"].prefix

    def job_violations(self, s, account_id: str, base_model: str) -> list[Violation]:
        from services.common.evaluator_refs import find  # the reference rules (name, name@N, id)

        out = []
        if not self.evaluator.strip():
            out.append(Violation(self.request_prefix + "evaluator", "required: the name (or name@version) of one of "
                                                                    "your evaluators"))
        else:
            try:
                find(s, account_id, self.evaluator)
            except (InvalidArgument, NotFound) as exc:
                out.append(Violation(self.request_prefix + "evaluator", exc.message))
        if self.checkpoint_id:
            ckpt = s.get(Checkpoint, self.checkpoint_id)
            if ckpt is None or ckpt.account_id != account_id or ckpt.kind == RESULT_KIND:
                out.append(Violation(self.request_prefix + "checkpoint_id",
                                     f"no checkpoint '{self.checkpoint_id}' of yours to evaluate"))
            elif ckpt.base_model != base_model:
                out.append(Violation(self.request_prefix + "checkpoint_id",
                                     f"checkpoint '{ckpt.id}' is of model '{ckpt.base_model}', not of spec.base_model "
                                     f"'{base_model}'"))
        return out
