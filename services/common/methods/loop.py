"""Loop jobs' settings on the server: the declaration (trainyard/methods/loop.py) resolved (resolved.py), plus the
checks that need the database: the evaluation's (evaluate.py), the training datasets (the account's, in the training
method's format) and the deployment name. The worker splits the settings back into the training method's and an
evaluation's (training(), evaluation())."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from services.common.errors import Violation
from services.common.registry import DEPLOYMENT_NAME_RE, find_deployment
from services.common.methods.dpo import DpoHyperparams
from services.common.methods.evaluate import EvalHyperparams, evaluation_violations
from services.common.methods.resolved import Resolved
from services.common.methods.sft import SftHyperparams
from services.common.schema import Dataset
from trainyard.methods import METHODS
from trainyard.methods.evaluate import EvalSettings
from trainyard.methods.loop import LoopSettings
from trainyard.methods.spec import as_dict, declared

TRAINING = {"sft": SftHyperparams, "dpo": DpoHyperparams}  # a loop's training method -> its resolved settings


@dataclass(frozen=True)
class LoopHyperparams(Resolved, LoopSettings):
    request_prefix: ClassVar[str] = METHODS["loop"].prefix

    def field(self, name: str) -> str:
        """The request field of a setting, e.g. "spec.loop.eval.evaluator"."""
        return self.request_prefix + next(f.setting.proto for f in declared(type(self)) if f.name == name)

    def training(self):
        """The training method's settings (SftHyperparams or DpoHyperparams): the fields it declares."""
        cls = TRAINING[self.training_method]
        values = as_dict(self)
        return cls.from_json({f.name: values[f.name] for f in declared(cls)})

    def evaluation(self, checkpoint_id: str) -> EvalHyperparams:
        """An evaluation's settings for one of the loop's checkpoints."""
        values = as_dict(self) | {"checkpoint_id": checkpoint_id}
        return EvalHyperparams.from_json({f.name: values[f.name] for f in declared(EvalSettings)})

    def job_violations(self, s, account_id: str, base_model: str) -> list[Violation]:
        out = evaluation_violations(self, s, account_id, base_model, self.request_prefix)
        if self.checkpoint_id:
            out = [v for v in out if v.field != self.field("checkpoint_id")]
            out.append(Violation(self.field("checkpoint_id"), "a loop evaluates its own checkpoints; leave it unset"))
        if not DEPLOYMENT_NAME_RE.fullmatch(self.deployment):
            out.append(Violation(self.field("deployment"), "required: 1-128 letters, digits, '.', '_' or '-', "
                                                           "starting with a letter or digit"))
        elif find_deployment(s, account_id, self.deployment) is not None:
            out.append(Violation(self.field("deployment"), f"a deployment named '{self.deployment}' exists; the loop "
                                                           "creates its own (delete that one or choose another name)"))
        if not self.train_datasets:
            out.append(Violation(self.field("train_datasets"), "required: one dataset id per iteration"))
        formats = METHODS[self.training_method].dataset_formats
        for i, ds_id in enumerate(self.train_datasets):
            ds = s.get(Dataset, ds_id)
            if ds is None or ds.account_id != account_id or ds.deleted_at is not None:
                out.append(Violation(f"{self.field('train_datasets')}[{i}]", f"no dataset '{ds_id}' of yours"))
            elif ds.format not in formats:
                out.append(Violation(f"{self.field('train_datasets')}[{i}]",
                                     f"dataset '{ds_id}' is in {ds.format} format; {self.training_method} trains on "
                                     f"{' or '.join(formats)} rows"))
        if self.full_parameter:
            out.append(Violation(self.field("full_parameter"), "a loop deploys LoRA adapters; full-parameter "
                                                               "checkpoints cannot be served"))
        if self.training_method != "dpo":  # settings only DPO reads, set for another method
            only_dpo = {f.name for f in declared(DpoHyperparams)} - {f.name for f in
                                                                      declared(TRAINING[self.training_method])}
            defaults = DpoHyperparams()
            out += [Violation(self.field(n), f"only a dpo loop reads it; training_method is {self.training_method}")
                    for n in sorted(only_dpo - {"full_parameter"}) if getattr(self, n) != getattr(defaults, n)]
        return out


__all__ = ["LoopHyperparams", "TRAINING"]
