"""A method's settings <-> its proto config message (e.g. SftConfig), from the declaration alone.

Each declared setting names its proto field ("lora.rank": field rank of the nested lora message). Unset is what the
proto says it is: an optional scalar without presence, enum value 0 (UNSPECIFIED), an empty repeated field. A choice
maps to the enum value of the same name (lr_scheduler "cosine" <-> LR_SCHEDULER_COSINE).
"""
from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from trainyard.methods.spec import Field, declared


def _locate(msg: Message, path: str) -> tuple[Message, FieldDescriptor]:
    *parents, leaf = path.split(".")
    for name in parents:
        msg = getattr(msg, name)
    return msg, msg.DESCRIPTOR.fields_by_name[leaf]


def _enum_prefix(fd: FieldDescriptor) -> str:
    """'LR_SCHEDULER_' for LrScheduler: what precedes the choice in a value's name (the name of value 0 shows it)."""
    return fd.enum_type.values_by_number[0].name.removesuffix("UNSPECIFIED")


def read(settings_cls: type, msg: Message) -> dict[str, Any]:
    """The settings a config message sets, by declared name (unset ones left out). An enum value the declaration
    does not know comes back as its number, so the declaration's check names the field."""
    given = {}
    for f in declared(settings_cls):
        owner, fd = _locate(msg, f.setting.proto)
        value = getattr(owner, fd.name)
        if fd.is_repeated:
            if value:
                given[f.name] = tuple(value)
        elif fd.enum_type is not None:
            if value:
                name = fd.enum_type.values_by_number[value].name if value in fd.enum_type.values_by_number else ""
                choice = name.removeprefix(_enum_prefix(fd)).lower()
                given[f.name] = choice if choice in f.setting.choices else value
        elif owner.HasField(fd.name):
            given[f.name] = value
    return given


def write(settings_cls: type, values: dict[str, Any], msg: Message) -> Message:
    """Set the given values (None: leave unset) on a config message and return it. ValueError naming the setting
    for a choice the declaration does not list or a value the proto field cannot hold."""
    fields = {f.name: f for f in declared(settings_cls)}
    for name, value in values.items():
        if value is None:
            continue
        f: Field = fields[name]
        owner, fd = _locate(msg, f.setting.proto)
        if fd.is_repeated:
            getattr(owner, fd.name)[:] = list(value)
        elif fd.enum_type is not None:
            if value not in f.setting.choices:
                raise ValueError(f"{name} must be one of {', '.join(f.setting.choices)}, got {value!r}")
            setattr(owner, fd.name, fd.enum_type.values_by_name[_enum_prefix(fd) + value.upper()].number)
        else:
            try:
                setattr(owner, fd.name, value)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}: {exc}") from None
    return msg


def check_declaration(settings_cls: type, msg_cls: type) -> list[str]:
    """Where a declaration and its proto message disagree (empty when they match): a declared setting without a
    proto field, an optional scalar without presence, a choice without an enum value, a proto field not declared."""
    problems, covered = [], set()
    msg = msg_cls()
    for f in declared(settings_cls):
        try:
            _, fd = _locate(msg, f.setting.proto)
        except KeyError:
            problems.append(f"{f.name}: no proto field {f.setting.proto}")
            continue
        covered.add(f.setting.proto)
        if not fd.is_repeated and fd.enum_type is None and not fd.has_presence:
            problems.append(f"{f.name}: proto field {f.setting.proto} is not optional (unset is undetectable)")
        if fd.enum_type is not None:
            missing = [c for c in f.setting.choices if _enum_prefix(fd) + c.upper() not in fd.enum_type.values_by_name]
            problems += [f"{f.name}: no enum value for {c!r}" for c in missing]

    def walk(desc, prefix: str) -> None:
        for fd in desc.fields:
            path = prefix + fd.name
            if fd.message_type is not None and not fd.is_repeated:
                walk(fd.message_type, path + ".")
            elif path not in covered:
                problems.append(f"proto field {path} has no declared setting")

    walk(msg_cls.DESCRIPTOR, "")
    return problems
