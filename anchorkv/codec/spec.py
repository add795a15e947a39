"""`CodecSpec`: which codec a field is packed with, and its parameters.

Three spellings, all giving the same spec:

* a string: ``"fp8"`` (default group 128), ``"int8:64"``, ``"fp8:whole"``; a plug-in with
  options: ``"lowrank:rank=16,code_dtype=float16"`` (``key=value`` pairs after the colon, values
  read as JSON numbers / true / false / null, else as strings);
* a dict: ``{"id": "lowrank", "rank": 16}`` (every key but ``id`` and ``group`` is an option),
  or the form `to_dict` writes, ``{"id": ..., "group": ..., "params": {...}}``;
* a `CodecSpec`.

A plug-in's options (`params`) are JSON values; fitted parameters travel in them too (the
example low-rank codec keeps its projection as base64), so an entry's manifest records
everything its decode needs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_ID = re.compile(r"^[a-z][a-z0-9_.-]{0,63}$")
_GROUP_WHOLE = "whole"
_DEFAULT_GROUP = 128
#: The built-in format ids (`anchorkv.kernels.quant.Quant`), spelled out here so that this
#: module needs no import; `tests/codec/test_plugin_spec.py` checks they agree.
BUILTIN_IDS = frozenset({"raw", "fp8", "int8", "int4", "bf16"})
_SHOWN_CHARS = 24  # longer option values are abbreviated in str()


def canonical_json(value: Any) -> str:
    """The one JSON text of a value (sorted keys, no spaces): what params are compared,
    hashed and checksummed by."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


@dataclass(frozen=True)
class CodecSpec:
    """A codec id, its group size (`None` = the whole last axis) and, for a plug-in, its options.

    `params` is a sorted tuple of (name, JSON value); a dict is accepted and sorted. Specs are
    hashable whatever the values (the hash is over their canonical JSON).
    """

    id: str
    group: int | None = _DEFAULT_GROUP
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not _ID.match(self.id):
            raise ValueError(
                f"codec id must match {_ID.pattern} (lowercase letters, digits, '_', '.', '-'), "
                f"found {self.id!r}"
            )
        if self.group is not None and (isinstance(self.group, bool) or not isinstance(self.group, int)
                                       or self.group <= 0):
            raise ValueError(f"codec group size must be a positive int or None, found {self.group!r}")
        if isinstance(self.params, (tuple, list, dict)) and not self.params:  # a built-in's spec: nothing to check
            object.__setattr__(self, "params", ())
            return
        params = dict(self.params)
        if self.id in BUILTIN_IDS:  # (an option it has not, e.g. a misspelled group, was dropped)
            raise ValueError(f"codec {self.id!r} is built in and takes no options but its group size (e.g. "
                             f"'{self.id}:64' or {{\"id\": \"{self.id}\", \"group\": 64}}), found "
                             f"{sorted(params)}")
        if len(params) != len(self.params) and not isinstance(self.params, dict):
            raise ValueError(f"codec {self.id!r}: an option is given twice in {self.params!r}")
        bad = [k for k in params if not isinstance(k, str) or not k or k in ("id", "group", "params")]
        if bad:
            raise ValueError(f"codec {self.id!r}: option names must be non-empty strings other than "
                             f"'id', 'group', 'params'; found {bad}")
        try:
            canonical_json(params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"codec {self.id!r}: options must be JSON values (numbers, strings, "
                             f"lists, objects; no NaN), found {params!r} ({e})") from None
        object.__setattr__(self, "params", tuple(sorted(params.items())))

    def __hash__(self) -> int:
        return hash((self.id, self.group, canonical_json(dict(self.params)) if self.params else ""))

    @property
    def options(self) -> dict[str, Any]:
        """The plug-in options as a dict (a copy)."""
        return dict(self.params)

    @property
    def builtin(self) -> bool:
        return self.id in BUILTIN_IDS

    @classmethod
    def parse(cls, value: CodecSpec | str | dict) -> CodecSpec:
        """Accept a spec, a string like ``"int8:64"`` / ``"lowrank:rank=16"``, or a dict."""
        if isinstance(value, CodecSpec):
            return value
        if isinstance(value, dict):
            return cls.from_dict(value)
        if not isinstance(value, str):
            raise TypeError(f"codec must be a CodecSpec, str or dict, found {type(value).__name__}")
        name, _, rest = value.strip().partition(":")
        default = _DEFAULT_GROUP if name in BUILTIN_IDS else None
        if not rest:
            return cls(name, default)
        if "=" in rest:
            return cls._parse_options(value, name, rest, default)
        if rest == _GROUP_WHOLE:
            return cls(name, None)
        if not rest.isdigit():
            raise ValueError(f"codec {value!r}: group must be a number or 'whole' (or key=value options, "
                             f"e.g. 'lowrank:rank=16'), found {rest!r}")
        return cls(name, int(rest))

    @classmethod
    def _parse_options(cls, text: str, name: str, rest: str, default: int | None) -> CodecSpec:
        params: dict[str, Any] = {}
        group = default
        for item in rest.split(","):
            key, eq, raw = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise ValueError(f"codec {text!r}: expected key=value options separated by ',', found {item!r}")
            if key in params or (key == "group" and group is not default):
                raise ValueError(f"codec {text!r}: option {key!r} is given twice")
            val = _scalar(raw.strip())
            if key == "group":
                group = None if val == _GROUP_WHOLE else val
            else:
                params[key] = val
        return cls(name, group, tuple(params.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "group": self.group, "params": dict(self.params)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CodecSpec:
        """`to_dict`'s form, or ``{"id": ..., <option>: ...}`` (options inline)."""
        if "id" not in data:
            raise ValueError(f"a codec dict needs an 'id' (e.g. {{\"id\": \"lowrank\", \"rank\": 16}}); "
                             f"found keys {sorted(data)}")
        name = data["id"]
        inline = {k: v for k, v in data.items() if k not in ("id", "group", "params")}
        nested = data.get("params", {})
        if not isinstance(nested, dict):
            raise ValueError(f"codec {name!r}: 'params' must be an object, found {nested!r}")
        if inline and nested:
            raise ValueError(f"codec {name!r}: give options either inline or under 'params', not both "
                             f"(found {sorted(inline)} and params {sorted(nested)})")
        default = _DEFAULT_GROUP if name in BUILTIN_IDS else None
        group = data.get("group", default)
        if group == _GROUP_WHOLE:
            group = None
        return cls(name, group, tuple({**nested, **inline}.items()))

    def __str__(self) -> str:
        if not self.params:
            if self.group is None and not self.builtin:
                return self.id
            return f"{self.id}:{_GROUP_WHOLE if self.group is None else self.group}"
        items = [] if self.group is None else [f"group={self.group}"]
        for k, v in self.params:
            text = v if isinstance(v, str) else canonical_json(v)
            items.append(f"{k}={text}" if len(text) <= _SHOWN_CHARS else f"{k}=<{len(text)} chars>")
        return f"{self.id}:" + ",".join(items)


def _scalar(text: str) -> Any:
    """An option value of the string form: a JSON number, true, false or null, else the text."""
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if value is None or isinstance(value, (bool, int, float)) else text
