"""Managed RFT's settings on the server: the declaration (trainyard/methods/rft.py) resolved (resolved.py), plus the
checks that need more than one setting: an evaluator is required, a built-in one must exist
(services/trainer/rl/rewards.py names them; torch-free) and an uploaded one must be the account's reward_fn
(account_violations, with the scheduler's database session).

The scheduler validates a request with ``RftHyperparams.from_request`` (violations name the request field, e.g.
"spec.rft.group_size") and stores ``to_json()``; the worker rebuilds it with ``from_json`` and the RL loop
(services/trainer/rl/) reads its fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from services.common.errors import InvalidArgument, NotFound, Violation
from services.common.methods.resolved import Resolved
from services.trainer.rl.rewards import BUILTIN_PREFIX, BUILTINS
from trainyard.methods import METHODS
from trainyard.methods.rft import RftSettings


@dataclass(frozen=True)
class RftHyperparams(Resolved, RftSettings):
    request_prefix: ClassVar[str] = METHODS["rft"].prefix

    @classmethod
    def check_request(cls, given: dict[str, Any], *, prefix: str | None = None) -> tuple[Any, list[Violation]]:
        settings, violations = super().check_request(given, prefix=prefix)
        field = (cls.request_prefix if prefix is None else prefix) + "evaluator"
        if not settings.evaluator:
            violations.append(Violation(field=field, reason="required: the reward, an evaluator 'name' or "
                                                            f"'name@version' or one of {', '.join(BUILTINS)}"))
        elif settings.evaluator.startswith(BUILTIN_PREFIX) and settings.evaluator not in BUILTINS:
            violations.append(Violation(field=field, reason=f"no built-in evaluator {settings.evaluator!r}; known: "
                                                            f"{', '.join(BUILTINS)}"))
        return settings, violations

    def account_violations(self, session, account_id: str, *, prefix: str) -> list[Violation]:
        """An uploaded evaluator must be the account's, and a reward_fn (an Environment scores episodes, not
        single completions)."""
        if not self.evaluator or self.evaluator.startswith(BUILTIN_PREFIX):
            return []
        from services.evaluators.store import find

        field = prefix + "evaluator"
        try:
            row = find(session, account_id, self.evaluator)
        except NotFound as exc:
            return [Violation(field=field, reason=f"{exc.message}: upload it first")]
        except InvalidArgument as exc:
            return [Violation(field=field, reason=v.reason) for v in exc.violations]
        if row.kind != "reward_fn":
            return [Violation(field=field, reason=f"evaluator {self.evaluator!r} is an Environment; an RFT job needs "
                                                  "a reward_fn(completion, row)")]
        return []

    @property
    def dynamic(self) -> bool:
        """Whether constant-reward groups are dropped: the setting, or (unset) on for dapo only."""
        return self.loss == "dapo" if self.dynamic_sampling is None else self.dynamic_sampling
