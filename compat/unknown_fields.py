"""Fields a request body has but its type does not know, found by JSON path and dropped.

Clients written for vLLM, SGLang or llama.cpp send fields of their own (`chat_template_kwargs`,
a message's `reasoning_content`, ...). vLLM accepts and logs them, and so do we unless
UNKNOWN_FIELDS=reject. The body, already parsed into Python objects, is walked against its
msgspec type (structs by their JSON names, optionals, unions, tagged unions, lists, dicts):
what survives is exactly what the strict decoder accepts, and every dropped key is named, e.g.
`messages[0].reasoning_content`. Values typed Any (a JSON schema, metadata) are never walked.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from msgspec import inspect as mi

# UNKNOWN_FIELDS: drop and log them (vLLM), or refuse the request naming the first (OpenAI).
UnknownFields = Literal["ignore", "reject"]
_ARRAYS = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)


def drop_unknown_fields(value: Any, type_: Any) -> tuple[Any, list[str]]:
    """`value` without the object keys `type_` does not declare, and their JSON paths."""
    dropped: list[str] = []
    return _walk(value, _type_info(type_), "", dropped), dropped


@functools.cache
def _type_info(type_: Any) -> mi.Type:
    return mi.type_info(type_)


def _unwrap(info: mi.Type) -> mi.Type:
    while isinstance(info, mi.Metadata):  # Annotated with extra JSON schema
        info = info.type
    return info


def _walk(value: Any, info: mi.Type, path: str, dropped: list[str]) -> Any:
    info = _unwrap(info)
    if isinstance(info, mi.UnionType):
        branch = _branch(value, info.types)
        if branch is None:  # no branch fits: the decoder reports the value as it is
            return value
        info = branch
    if isinstance(value, dict):
        if isinstance(info, mi.StructType) and not info.array_like:
            return _struct(value, info, path, dropped)
        if isinstance(info, mi.DictType) and _has_objects(info.value_type):
            return {
                key: _walk(item, info.value_type, f"{path}.{key}", dropped)
                for key, item in value.items()
            }
    elif isinstance(value, list):
        if isinstance(info, _ARRAYS) and _has_objects(info.item_type):
            return [
                _walk(item, info.item_type, f"{path}[{i}]", dropped) for i, item in enumerate(value)
            ]
        if isinstance(info, mi.TupleType) and len(value) == len(info.item_types):
            return [
                _walk(item, item_info, f"{path}[{i}]", dropped)
                for i, (item, item_info) in enumerate(zip(value, info.item_types, strict=True))
            ]
    return value


def _struct(
    value: dict[str, Any], info: mi.StructType, path: str, dropped: list[str]
) -> dict[str, Any]:
    fields = {field.encode_name: field.type for field in info.fields}
    kept: dict[str, Any] = {}
    for key, item in value.items():
        where = f"{path}.{key}" if path else key
        if key in fields:
            kept[key] = _walk(item, fields[key], where, dropped)
        elif key == info.tag_field:
            kept[key] = item
        else:
            dropped.append(where)
    return kept


def _branch(value: Any, types: tuple[mi.Type, ...]) -> mi.Type | None:
    """The union member a JSON object or array decodes as (msgspec allows one object-like
    member unless they are tagged structs, and one array-like member)."""
    members = [_unwrap(t) for t in types]
    if isinstance(value, dict):
        for member in members:
            if isinstance(member, mi.StructType) and member.tag_field is not None:
                if value.get(member.tag_field) == member.tag:
                    return member
            elif isinstance(member, mi.StructType | mi.DictType):
                return member
    elif isinstance(value, list):
        for member in members:
            if isinstance(member, (*_ARRAYS, mi.TupleType)):
                return member
    return None


def _has_objects(info: mi.Type) -> bool:
    """Whether values of this type can hold a struct: arrays of plain values (token ids) are
    not walked item by item."""
    info = _unwrap(info)
    if isinstance(info, mi.StructType):
        return True
    if isinstance(info, mi.UnionType):
        return any(_has_objects(t) for t in info.types)
    if isinstance(info, _ARRAYS):
        return _has_objects(info.item_type)
    if isinstance(info, mi.DictType):
        return _has_objects(info.value_type)
    if isinstance(info, mi.TupleType):
        return any(_has_objects(t) for t in info.item_types)
    return False
