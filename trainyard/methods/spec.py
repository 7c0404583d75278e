"""How a job method's settings are declared: a frozen dataclass whose fields carry a `Setting` (help, bounds,
choices, unit, the proto field, the CLI flag, the dashboard label) next to their type and default.

Everything else reads the declaration: `resolve` (defaults filled, every value checked, each problem naming the
request field), trainyard.methods.proto (proto <-> settings), the SDK's keywords, the CLI's flags and the dashboard's
form. So a bound or a default is written once, here or in the method's own module, and nowhere else.

Standard library only: the SDK, the CLI and the torch-free scheduler all import it.
"""
from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

KEY = "setting"  # the dataclass field metadata key holding a Setting
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")  # a module name (LoRA targets) as peft writes it


@dataclass(frozen=True)
class Setting:
    help: str
    label: str  # the dashboard's input label
    proto: str  # the field in the method's config message, dotted for nested messages ("lora.rank")
    flag: str  # the CLI's flag
    aliases: tuple[str, ...] = ()  # more CLI flags for the same setting (kept for scripts that use them)
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] = ()
    unit: str = ""
    advanced: bool = False  # the dashboard folds these away
    names: bool = False  # a list of module names (checked against NAME)

    def bounds_text(self) -> str:
        """The bounds in words ("1..1024", "> 0 and < 1"), '' when unbounded."""
        if self.ge is not None and self.le is not None:
            return f"{_num(self.ge)}..{_num(self.le)}"
        return " and ".join(f"{op} {_num(x)}" for op, x in ((">=", self.ge), (">", self.gt), ("<=", self.le),
                                                            ("<", self.lt)) if x is not None)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def setting(default: Any, *, help: str, label: str, proto: str | None = None, flag: str | None = None,
            aliases: tuple[str, ...] = (), **checks: Any) -> Any:
    """A dataclass field of a method's settings. proto defaults to the field's name, flag to --field-name (both
    filled in by `declared` once the name is known)."""
    meta = Setting(help=help, label=label, proto=proto or "", flag=flag or "", aliases=aliases, **checks)
    return dataclasses.field(default=default, metadata={KEY: meta})


@dataclass(frozen=True)
class Field:
    """One declared setting: its name, Python type (int, float, str, bool or tuple of str), default and Setting.
    A default of None (type `int | None`) means "unset": the method derives the value (max_steps from epochs), so
    every set value is checked against the bounds, 0 included."""

    name: str
    type: type
    default: Any
    setting: Setting

    @property
    def is_list(self) -> bool:
        return self.type is tuple

    def describe(self) -> str:
        """Help with the default, bounds and unit, as the CLI and the dashboard show it."""
        s = self.setting
        extra = [f"default {format_value(self.default)}"] if self.default not in ((), None, "") else []
        if s.choices:
            extra.append("one of " + ", ".join(s.choices))
        elif s.bounds_text():
            extra.append(s.bounds_text() + (f" {s.unit}" if s.unit else ""))
        return f"{s.help} ({'; '.join(extra)})" if extra else s.help


def format_value(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return ", ".join(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def declared(cls: type) -> tuple[Field, ...]:
    """The declared settings of a settings dataclass, in field order. A class may carry the settings of others in
    nested proto messages: `proto_nesting = {"training.": DpoSettings}` (a ClassVar) prefixes the proto field of
    every setting it has from DpoSettings with "training." (the loop job's settings reuse the training method's)."""
    cached = cls.__dict__.get("_declared")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    nesting = {f.name: prefix for prefix, inner in getattr(cls, "proto_nesting", {}).items()
               for f in declared(inner)}
    out = []
    for f in dataclasses.fields(cls):
        meta: Setting | None = f.metadata.get(KEY)
        if meta is None:
            continue
        hint = hints[f.name]
        if isinstance(hint, types.UnionType):  # `int | None`: an optional setting of type int
            (hint,) = (a for a in typing.get_args(hint) if a is not type(None))
        kind = typing.get_origin(hint) or hint
        meta = dataclasses.replace(meta, proto=nesting.get(f.name, "") + (meta.proto or f.name),
                                   flag=meta.flag or "--" + f.name.replace("_", "-"))
        out.append(Field(f.name, kind, f.default, meta))
    fields = tuple(out)
    cls._declared = fields
    return fields


def declared_field(cls: type, name: str) -> Field:
    return next(f for f in declared(cls) if f.name == name)


@dataclass(frozen=True)
class Problem:
    """A value that does not fit its declaration; field is the request path (e.g. "spec.sft.lora.rank")."""

    field: str
    reason: str


def check_value(f: Field, value: Any) -> tuple[Any, str]:
    """(the value coerced to the declared type, '' or why it does not fit)."""
    s = f.setting
    if s.choices and value not in s.choices:
        return value, f"must be one of {', '.join(s.choices)}, got {value!r}"
    if f.type is bool:
        return (value, "") if isinstance(value, bool) else (value, f"must be true or false, got {value!r}")
    if f.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            return value, f"must be a whole number, got {value!r}"
    elif f.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, f"must be a number, got {value!r}"
        value = float(value)
        if not math.isfinite(value):
            return value, f"must be a finite number, got {value}"
    elif f.type is str:
        if not isinstance(value, str):
            return value, f"must be a string, got {value!r}"
    elif f.is_list:
        if isinstance(value, str) or not all(isinstance(v, str) for v in value):
            return value, f"must be a list of names, got {value!r}"
        value = tuple(value)
        bad = [v for v in value if s.names and not NAME.fullmatch(v)]
        return value, (f"not module names: {bad}" if bad else "")
    below = (s.ge is not None and value < s.ge) or (s.gt is not None and value <= s.gt)
    above = (s.le is not None and value > s.le) or (s.lt is not None and value >= s.lt)
    if below or above:
        bounds = s.bounds_text()
        if ".." in bounds:
            bounds = "between " + bounds.replace("..", " and ")
        return value, f"must be {bounds}, got {format_value(value)}"
    return value, ""


def resolve(cls: type, given: dict[str, Any], *, prefix: str) -> tuple[Any, list[Problem]]:
    """The settings of a request and what is wrong with it: declared defaults for the keys not given (or given as
    None), every value checked; a value that does not fit is reported and its default kept, so checks that need
    whole settings (the server's model checks) can still run. Each problem names prefix + the proto field (e.g.
    "spec.sft.lora.rank"); a key that is not declared is a problem too."""
    fields = {f.name: f for f in declared(cls)}
    problems = [Problem(prefix + k, f"unknown setting; known: {', '.join(fields)}") for k in given if k not in fields]
    values = {}
    for name, f in fields.items():
        if given.get(name) is None:
            continue
        value, reason = check_value(f, given[name])
        if reason:
            problems.append(Problem(prefix + f.setting.proto, reason))
        else:
            values[name] = value
    return cls(**values), problems


def as_dict(settings: Any) -> dict[str, Any]:
    """Declared name -> value (tuples as lists, JSON-ready)."""
    return {f.name: list(v) if isinstance(v := getattr(settings, f.name), tuple) else v
            for f in declared(type(settings))}
