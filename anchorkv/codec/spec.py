"""`CodecSpec`: which codec a field is packed with, and its parameters."""

from __future__ import annotations

from dataclasses import dataclass
import re
from typing import Any

_ID = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")
_GROUP_WHOLE = "whole"


@dataclass(frozen=True)
class CodecSpec:
    """A codec id plus its group size (`None` = the whole last axis).

    Written as a string too: ``"fp8"`` (default group), ``"int8:64"``, ``"int4:32"``,
    ``"fp8:whole"``. `params` carries options of a custom codec (JSON-serializable values).
    """

    id: str
    group: int | None = 128
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.match(self.id):
            raise ValueError(
                f"codec id must match {_ID.pattern} (lowercase letters, digits, '_', '.', '-'), "
                f"found {self.id!r}"
            )
        if self.group is not None and (not isinstance(self.group, int) or self.group <= 0):
            raise ValueError(f"codec group size must be a positive int or None, found {self.group!r}")

    @classmethod
    def parse(cls, value: "CodecSpec | str | dict") -> "CodecSpec":
        """Accept a spec, a string like ``"int8:64"``, or the dict `to_dict` wrote."""
        if isinstance(value, CodecSpec):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if not isinstance(value, str):
            raise TypeError(f"codec must be a CodecSpec, str or dict, found {type(value).__name__}")
        name, _, group = value.strip().partition(":")
        if not group:
            return cls(name)
        if group == _GROUP_WHOLE:
            return cls(name, None)
        if not group.isdigit():
            raise ValueError(f"codec {value!r}: group must be a number or 'whole', found {group!r}")
        return cls(name, int(group))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "group": self.group, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CodecSpec":
        unknown = set(data) - {"id", "group", "params"}
        if unknown or "id" not in data:
            raise ValueError(
                f"codec dict needs keys id, group?, params?; found {sorted(data)}"
            )
        return cls(data["id"], data.get("group", 128), tuple(sorted(data.get("params", {}).items())))

    def __str__(self) -> str:
        group = _GROUP_WHOLE if self.group is None else str(self.group)
        return f"{self.id}:{group}"
