"""Hostile requests for any RPC, built from its message descriptor.

Two sources. mutations(): a valid request (templates.py) with exactly one field changed to each hostile value of its
type, for every field down through nested messages, lists and maps, so every check behind the first is reached: a
NUL byte, thirty 9s (past a bigint), 20000 characters, an empty string; the integer bounds of the field's width; NaN,
infinities and float32's maximum; unknown enum values; bytes empty, too short, or of the right length holding NaN or
float32's maximum; a tensor shape whose element count overflows int64. request(): hypothesis strategies drawing
whole messages, every field unset or hostile for its type (strings with NULs, control characters, unicode, SQL and
path fragments; integers at and beyond every width's bounds; NaN and infinities; unknown enum values; nested
messages, lists and maps), references drawn from real objects of the fuzzing account and of another account as
well, so requests get past the lookup.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from google.protobuf.descriptor import Descriptor
from google.protobuf.descriptor import FieldDescriptor as F
from hypothesis import strategies as st

from tests.reliability.references import is_ours, kind_of
from tests.reliability.rpcs import Rpc, message_class

# Long enough that an error message repeating it exceeds gRPC's hard 16 KiB limit on a response's metadata (a
# shorter one lands between the soft and the hard limit, where a client drops the answer only sometimes).
LONG = 20000
NASTY_STRINGS = [
    "", "\x00", "a\x00b", "9" * 30, "-1", "0", " ", "\t\n\r", "../../../../etc/passwd", "/", "/dev/zero",
    "%s%n%x", "'; DROP TABLE jobs; --", "\" OR 1=1 --", "\u202e\u200b\ufeff", "\U0001f600" * 8, "x" * LONG,
    "null", "{}", "[]", "NaN", "trainyard://weights/", "trainyard://state/", "trainyard://weights/\x00",
    "{{ 7 * 7 }}", "{% for i in range(10**10) %}{% endfor %}", "\\", "*", "?", "#", "..",
]
INT_BOUNDS = {
    F.TYPE_INT32: (-2**31, 2**31 - 1), F.TYPE_SINT32: (-2**31, 2**31 - 1), F.TYPE_SFIXED32: (-2**31, 2**31 - 1),
    F.TYPE_INT64: (-2**63, 2**63 - 1), F.TYPE_SINT64: (-2**63, 2**63 - 1), F.TYPE_SFIXED64: (-2**63, 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
FLOAT_EDGES = [math.nan, math.inf, -math.inf, 0.0, -0.0, 3e38, -3e38, 1e-45, 1.0, -1.0]
DOUBLE_EDGES = FLOAT_EDGES + [1e308, -1e308, 5e-324]
BYTES_EDGES = [b"", b"\x00", b"\xff" * 64, b"{\n", b'{"messages": []}\n', b"\n" * 100, bytes(range(256))]
# seq_id: 0 (the next one), negative or already used only. A call with a future seq_id waits for the calls before
# it, which a fuzzer never sends: such calls are issue 10's starvation defect (they hold the trainer's threads for
# the ordering timeout), checked on their own, not sprayed here.
FIELD_OVERRIDES: dict[str, st.SearchStrategy] = {
    "seq_id": st.one_of(st.just(0), st.integers(min_value=-2**63, max_value=1)),
}
MAX_DEPTH = 4


def _edges(lo: int, hi: int) -> list[int]:
    return sorted({x for x in (lo, hi, hi - 1, 0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1)
                   if lo <= x <= hi})


def integers(ftype: int, name: str) -> st.SearchStrategy:
    lo, hi = INT_BOUNDS[ftype]
    small = st.integers(min_value=max(lo, -300), max_value=min(hi, 300))  # token ids and counts that mean something
    return st.one_of(st.sampled_from(_edges(lo, hi)), small, st.integers(min_value=lo, max_value=hi))


def scalar(field: F, pools: Callable[[str], list[str]]) -> st.SearchStrategy:
    if field.name in FIELD_OVERRIDES:
        return FIELD_OVERRIDES[field.name]
    t = field.type
    if t == F.TYPE_STRING:
        base = st.one_of(st.sampled_from(NASTY_STRINGS), st.text(max_size=40))
        kind = None if field.containing_type.GetOptions().map_entry else kind_of(field)
        refs = pools(kind) if kind else []
        if refs:  # an object's reference: mostly real ones (of both accounts), with a NUL or garbage now and then
            return st.one_of(st.sampled_from(refs), st.sampled_from(refs), base,
                             st.sampled_from(refs).map(lambda r: r + "\x00"))
        return base
    if t == F.TYPE_BYTES:
        return st.one_of(st.sampled_from(BYTES_EDGES), st.binary(max_size=256))
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_FLOAT:
        return st.one_of(st.sampled_from(FLOAT_EDGES), st.floats(width=32))
    if t == F.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(DOUBLE_EDGES), st.floats())
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([-1, max(known) + 1, 99, 2**31 - 1]))
    if t in INT_BOUNDS:
        return integers(t, field.name)
    raise TypeError(f"no strategy for field {field.full_name} of type {t}")


def message(d: Descriptor, pools: Callable[[str], list[str]], depth: int = 0) -> st.SearchStrategy:
    """A message of type d with each field unset or drawn from its strategy (one member of each oneof at most)."""
    cls = message_class(d)
    if depth > MAX_DEPTH or not is_ours(d):
        return st.just(cls())
    fields = {}
    for f in d.fields:
        fields[f.name] = st.one_of(st.none(), field_values(f, pools, depth))
    oneofs = [[f.name for f in o.fields] for o in d.oneofs if not o.name.startswith("_")]

    def build(drawn: dict) -> object:
        for members in oneofs:  # keep the first drawn member of each oneof (setting another clears it anyway)
            chosen = next((m for m in members if drawn.get(m) is not None), None)
            for m in members:
                if m != chosen:
                    drawn[m] = None
        msg = cls()
        for name, value in drawn.items():
            if value is None:
                continue
            f = d.fields_by_name[name]
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                target = getattr(msg, name)
                for k, v in value.items():
                    if f.message_type.fields_by_name["value"].message_type is not None:
                        target[k].CopyFrom(v)
                    else:
                        target[k] = v
            elif f.is_repeated:
                getattr(msg, name).extend(value)
            elif f.message_type is not None:
                getattr(msg, name).CopyFrom(value)
            else:
                setattr(msg, name, value)
        return msg

    return st.fixed_dictionaries(fields).map(build)


def field_values(f: F, pools, depth: int) -> st.SearchStrategy:
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        key_f, value_f = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        keys = st.one_of(st.sampled_from(["target_tokens", "weights", "advantages", "logprobs", "mask",
                                          "clip_low_threshold", "clip_high_threshold", "beta"]), scalar(key_f, pools))
        vals = message(value_f.message_type, pools, depth + 1) if value_f.message_type else scalar(value_f, pools)
        return st.dictionaries(keys, vals, max_size=3)
    one = message(f.message_type, pools, depth + 1) if f.message_type is not None else scalar(f, pools)
    return st.lists(one, max_size=4) if f.is_repeated else one


def request(rpc: Rpc, pools: Callable[[str], list[str]]) -> st.SearchStrategy:
    """A request for rpc: one message, or for a client stream a list whose first message is usually the header."""
    one = message(rpc.input, pools)
    if not rpc.client_streaming:
        return one
    header = next((f for o in rpc.input.oneofs for f in o.fields if f.name == "header"), None)
    if header is None:
        return st.lists(one, max_size=5)
    cls = message_class(rpc.input)
    headed = message(header.message_type, pools, 1).map(lambda h: cls(**{header.name: h}))
    return st.one_of(st.lists(one, max_size=4),
                     st.tuples(headed, st.lists(one, max_size=4)).map(lambda t: [t[0], *t[1]]))


# -- single-field mutations of a valid request ------------------------------------------------------------------
def hostile(f: F, base) -> list:
    """Values for one field of a valid request, each of which the server must refuse or handle."""
    t = f.type
    if f.name == "seq_id":
        return [-1, -2**63]  # a future seq_id waits for calls that never come (see FIELD_OVERRIDES)
    if f.is_repeated:
        if t == F.TYPE_STRING:
            return [["a\x00b"], ["x" * LONG] * 3]
        if f.name == "shape":  # element counts that overflow int64: to 0, and to the count the data holds
            wraps = [2**32 + 1, 2**32 - 1] * 2  # product 2**128 - 2**65 + 1, which is 1 modulo 2**64
            return [[2**32, 2**32], wraps + list(base), [-1], []]
        if t in INT_BOUNDS:
            lo, hi = INT_BOUNDS[t]
            return [[hi], [lo], []]
        if t in (F.TYPE_FLOAT, F.TYPE_DOUBLE):
            return [[math.nan], [math.inf]]
        return [[]]
    if t == F.TYPE_STRING:
        return ["a\x00b", "9" * 30, "x" * LONG, ""]
    if t == F.TYPE_BYTES:
        same = len(base) - len(base) % 4
        return [b"", b"\x00" * 7, b"\xff" * same, b"\xff\xff\x7f\x7f" * (same // 4)]  # NaN, float32 max
    if t == F.TYPE_BOOL:
        return [not base]
    if t == F.TYPE_FLOAT:
        return [math.nan, math.inf, -math.inf, 3e38]
    if t == F.TYPE_DOUBLE:
        return [math.nan, math.inf, 1e308]
    if t == F.TYPE_ENUM:
        return [-1, 2**31 - 1]
    lo, hi = INT_BOUNDS[t]
    return sorted({lo, hi, -1} & set(_edges(lo, hi)))


def mutators(d: Descriptor, base) -> Iterator[tuple[str, Callable]]:
    """(field label, function applying one hostile value to a copy of base) for every field of base's message, down
    through nested messages, the first element of repeated ones and every entry of maps; oneof members other than
    the one base sets are left alone (the random cases switch them)."""
    for f in d.fields:
        if f.containing_oneof is not None and not f.containing_oneof.name.startswith("_"):
            chosen = base.WhichOneof(f.containing_oneof.name)
            if chosen is not None and chosen != f.name:
                continue
        entry = f.message_type if f.message_type is not None and f.message_type.GetOptions().map_entry else None
        if entry is not None:
            value_f = entry.fields_by_name["value"]
            mapping = getattr(base, f.name)
            for key in ["a\x00b", "x" * LONG]:
                yield f"{f.name}[{key[:8]!r}]", _put_key(f.name, key, value_f)
            for key in list(mapping.keys()):
                if value_f.message_type is not None:
                    for label, fn in mutators(value_f.message_type, mapping[key]):
                        yield f"{f.name}[{key!r}].{label}", _in_entry(f.name, key, fn)
                else:
                    for v in hostile(value_f, mapping[key]):
                        yield f"{f.name}[{key!r}]={show(v)}", _set_entry(f.name, key, v)
        elif f.message_type is not None and is_ours(f.message_type):
            if f.is_repeated:
                items = getattr(base, f.name)
                sub = items[0] if len(items) else message_class(f.message_type)()
                for label, fn in mutators(f.message_type, sub):
                    yield f"{f.name}[0].{label}", _in_first(f.name, fn)
            else:
                for label, fn in mutators(f.message_type, getattr(base, f.name)):
                    yield f"{f.name}.{label}", _in_field(f.name, fn)
        elif f.message_type is None:
            for v in hostile(f, getattr(base, f.name)):
                yield f"{f.name}={show(v)}", _set(f.name, v, f.is_repeated)


def show(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else f"{text[:16]}...({len(value)})"


def _set(name: str, value, repeated: bool):
    def apply(m):
        if repeated:
            del getattr(m, name)[:]
            getattr(m, name).extend(value)
        else:
            setattr(m, name, value)
    return apply


def _in_field(name: str, fn):
    return lambda m: fn(getattr(m, name))


def _in_first(name: str, fn):
    def apply(m):
        items = getattr(m, name)
        fn(items[0] if len(items) else items.add())
    return apply


def _put_key(name: str, key: str, value_f: F):
    def apply(m):
        if value_f.message_type is not None:
            getattr(m, name)[key].SetInParent()
        else:
            getattr(m, name)[key] = value_f.default_value
    return apply


def _set_entry(name: str, key, value):
    def apply(m):
        getattr(m, name)[key] = value
    return apply


def _in_entry(name: str, key, fn):
    return lambda m: fn(getattr(m, name)[key])


def mutations(rpc: Rpc, baseline) -> Iterator[tuple[str, object]]:
    """(label, request): baseline with one field changed to one hostile value, for every field; for a client stream,
    the fields of its first two messages (the header and the first data message)."""
    messages = baseline if isinstance(baseline, list) else [baseline]
    for i, msg in enumerate(messages[:2]):
        for label, fn in mutators(rpc.input, msg):
            changed = [type(m)() for m in messages]
            for c, m in zip(changed, messages):
                c.CopyFrom(m)
            fn(changed[i])
            yield (f"[{i}].{label}" if rpc.client_streaming else label), (changed if rpc.client_streaming
                                                                          else changed[0])
