"""A method's declared settings (trainyard/methods/) as the server resolves them: the request checked against the
declaration, then against the model it trains (the checks that need the model directory), stored as JSON on the job
row and rebuilt by the worker.

Torch-free: the model checks read config.json alone (models.lora_targets, models.model_dir).
"""
from __future__ import annotations

from typing import Any, ClassVar

from models.lora_targets import DEFAULT_TARGETS, check_targets_for_config
from models.model_dir import ModelDirError, read_config
from services.common.errors import InvalidArgument, Violation
from trainyard.methods.spec import as_dict, declared, resolve


class Resolved:
    """Mixed into a method's settings dataclass (before it, so __post_init__ runs): an empty LoRA target list
    becomes the default menu, and requests and stored JSON convert through the declaration."""

    request_prefix: ClassVar[str]  # e.g. "spec.sft.": violations name request fields under it

    def __post_init__(self) -> None:
        if getattr(self, "target_modules", None) == ():
            object.__setattr__(self, "target_modules", DEFAULT_TARGETS)

    @classmethod
    def check_request(cls, given: dict[str, Any], *, prefix: str | None = None) -> tuple[Any, list[Violation]]:
        """(settings, violations): defaults for the keys not given (or None), every value checked against the
        declaration; a value that does not fit is a violation naming its request field, and keeps its default."""
        settings, problems = resolve(cls, given, prefix=cls.request_prefix if prefix is None else prefix)
        return settings, [Violation(field=p.field, reason=p.reason) for p in problems]

    @classmethod
    def from_request(cls, given: dict[str, Any], *, prefix: str | None = None):
        """The checked settings of a request; InvalidArgument naming every field that does not fit."""
        settings, violations = cls.check_request(given, prefix=prefix)
        if violations:
            raise InvalidArgument(violations=violations)
        return settings

    def job_violations(self, s, account_id: str, base_model: str) -> list[Violation]:
        """The method's checks that need the database (s: a session), e.g. that a named object is the account's."""
        return []

    def to_json(self) -> dict[str, Any]:
        return as_dict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]):
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def lora_target_problem(model_dir: str, targets: tuple[str, ...]) -> str | None:
    """Why these LoRA targets do not fit the model in model_dir (None when they do): the model's module names from
    its config.json (models.lora_targets), so no weights are read and no torch is needed."""
    try:
        check_targets_for_config(read_config(model_dir), targets)
    except (ModelDirError, ValueError) as exc:
        return str(exc)
    return None


def model_violations(settings: Resolved, model_dir: str, context_length: int, *, prefix: str) -> list[Violation]:
    """What the settings ask of this model that it cannot do: LoRA targets it lacks, a max_seq_len beyond its
    context length. Each violation names the request field of the setting."""
    proto = {f.name: prefix + f.setting.proto for f in declared(type(settings))}
    out = []
    if "target_modules" in proto:
        problem = lora_target_problem(model_dir, settings.target_modules)
        if problem:
            out.append(Violation(field=proto["target_modules"], reason=problem))
    if "max_seq_len" in proto and settings.max_seq_len > context_length:
        out.append(Violation(field=proto["max_seq_len"], reason=f"must be at most the model's context length "
                                                                f"{context_length}, got {settings.max_seq_len}"))
    return out
