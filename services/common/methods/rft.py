"""Managed RFT's settings on the server: the declaration (trainyard/methods/rft.py) resolved (resolved.py), plus the
checks that need more than one setting: an evaluator is required and a built-in one must exist (BUILTINS; their
code is services/trainer/rl/rewards.py); job_violations checks that an uploaded one is the account's, and that
max_turns > 1 comes with an Environment (multi-turn episodes), not a reward_fn.

The scheduler validates a request with ``RftHyperparams.from_request`` (violations name the request field, e.g.
"spec.rft.group_size") and stores ``to_json()``; the worker rebuilds it with ``from_json`` and the RL loop
(services/trainer/rl/) reads its fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from services.common.errors import InvalidArgument, NotFound, Violation
from services.common.methods.resolved import Resolved
from trainyard.methods import METHODS
from trainyard.methods.rft import RftSettings

BUILTIN_PREFIX = "builtin:"
# The built-in rewards' names (their code: services/trainer/rl/rewards.py).
BUILTINS = tuple(BUILTIN_PREFIX + name for name in ("first_number", "exact_match", "digit_share"))


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
        elif settings.evaluator.startswith(BUILTIN_PREFIX) and settings.max_turns > 1:
            violations.append(_single_turn(cls.request_prefix if prefix is None else prefix, settings))
        return settings, violations

    def job_violations(self, s, account_id: str, base_model: str) -> list[Violation]:
        """An uploaded evaluator must be the account's; a reward_fn scores one completion (max_turns 1), an
        Environment runs episodes of up to max_turns actions. A built-in one was checked with the request."""
        from services.common.evaluator_refs import find  # the reference rules (name, name@N, id)

        if not self.evaluator or self.evaluator.startswith(BUILTIN_PREFIX):
            return []
        field = self.request_prefix + "evaluator"
        try:
            row = find(s, account_id, self.evaluator)
        except (InvalidArgument, NotFound) as exc:
            return [Violation(field, f"{exc.message}: upload it first")]
        if row.kind == "reward_fn" and self.max_turns > 1:
            return [_single_turn(self.request_prefix, self)]
        return []

    @property
    def dynamic(self) -> bool:
        """Whether constant-reward groups are dropped: the setting, or (unset) on for dapo only."""
        return self.loss == "dapo" if self.dynamic_sampling is None else self.dynamic_sampling


def _single_turn(prefix: str, settings) -> Violation:
    return Violation(prefix + "max_turns", f"{settings.max_turns} turns need an Environment evaluator (reset / step); "
                                           f"{settings.evaluator!r} is a reward_fn, which scores one completion: "
                                           "use max_turns 1")
