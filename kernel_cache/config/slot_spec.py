"""Declared slots: a module an engine runs through the cache beside attention,
described by a :class:`SlotSpec` (immutable, JSON-serialisable, nothing imported).

A declared slot is a name, a factory import path and the module's inputs. Each
input dimension is one of:

* an ``int``: fixed;
* a bucket axis of the plan (:data:`AXES`): ``"query_tokens"`` (the query
  buckets, tokens), ``"kv_blocks"`` (the KV buckets, blocks) or
  ``"decode_seqs"`` (the decode-batch buckets, sequences): the variant's
  bucket, static in its artifact; a call is padded up to it;
* ``"dynamic"`` or ``"dynamic:NAME"``: any size at run time (like
  ``num_pool_blocks``); dimensions sharing one ``NAME`` have the same size.

The plan gains one variant per bucket of each axis the slot's inputs follow
(the product where several axes are followed). Padding: the elements of an
input past the caller's size along a bucket axis hold the input's ``pad``
value. Output: one tensor; with ``output_rows`` set to an axis, its dim 0
follows that axis and the rows past the caller's size are padding, sliced
off. The contract in full: docs/custom_kernels.md.
"""

from __future__ import annotations

import json
import math
import re
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from kernel_cache.config.kernel_paths import BUILTIN, FORM, check_path
from kernel_cache.errors import ConfigError

#: The plan's bucket axes a declared dimension may follow, with the unit and the
#: :class:`~kernel_cache.plan.buckets.Bucketer` ladder that gives their buckets.
AXES: dict[str, tuple[str, str]] = {
    "query_tokens": ("tokens", "query_buckets"),
    "kv_blocks": ("blocks", "num_blocks_buckets"),
    "decode_seqs": ("sequences", "num_seqs_buckets"),
}
DYNAMIC = "dynamic"
#: Element types of a declared input.
SLOT_DTYPES = ("float32", "bfloat16", "float16", "int32", "int64", "bool")

#: The largest fixed dimension: the largest size ``torch.export`` is given for a
#: dynamic one (warmup's export); a larger one overflows torch's sizes.
MAX_DIM = 2**31 - 1
#: ``(low, high)`` of the values a ``pad`` of each integer dtype may hold
#: (an integral value) and the largest finite magnitude of each float dtype.
_INT_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1), "bool": (0, 1)}
_FLOAT_MAX = {
    "float16": 65504.0,
    "bfloat16": 3.3895313892515355e38,
    "float32": 3.4028234663852886e38,
}

_NAME_RE = re.compile(r"[a-z_][a-z0-9_]*")
_DYN_RE = re.compile(r"dynamic(:[A-Za-z_]\w*)?")

Dim = int | str
Scalar = int | float | str | bool


class SlotInput(BaseModel):
    """One positional input of a declared slot's module.

    ``shape``: one entry per dimension, an ``int`` (fixed), an axis of
    :data:`AXES` or ``"dynamic"`` / ``"dynamic:NAME"``. ``pad``: the value an
    element past the caller's size along a bucket axis holds.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="the input's name (an identifier)")
    shape: tuple[Dim, ...] = Field(
        description="per dimension: an int (fixed), query_tokens, kv_blocks, decode_seqs "
        "(a bucket axis of the plan) or dynamic / dynamic:NAME"
    )
    dtype: Literal["float32", "bfloat16", "float16", "int32", "int64", "bool"]
    pad: float = Field(0.0, description="value of padded elements (past a bucket axis' size)")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_]\w*", v):
            raise ValueError(f"input name {v!r} is not an identifier")
        return v

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: tuple) -> tuple:
        for d in v:
            if isinstance(d, bool) or (isinstance(d, int) and d < 1):
                raise ValueError(f"dimension {d!r}: a fixed dimension is an int >= 1")
            if isinstance(d, int) and d > MAX_DIM:
                raise ValueError(
                    f"dimension {d}: a fixed dimension is at most {MAX_DIM}; declare it "
                    "dynamic if its size varies"
                )
            if isinstance(d, str) and d not in AXES and not _DYN_RE.fullmatch(d):
                raise ValueError(
                    f"dimension {d!r}: expected an int, one of {', '.join(AXES)}, "
                    "dynamic or dynamic:NAME"
                )
        return v

    @model_validator(mode="after")
    def _pad(self):
        p = self.pad
        if self.dtype in _INT_RANGE:
            low, high = _INT_RANGE[self.dtype]
            if not (math.isfinite(p) and p.is_integer() and low <= p <= high):
                kind = "a bool" if self.dtype == "bool" else f"an {self.dtype}"
                raise ValueError(
                    f"input {self.name!r}: pad {p!r} is not {kind} (an integer from {low} "
                    f"to {high}); give a pad the dtype holds"
                )
        elif math.isfinite(p) and abs(p) > _FLOAT_MAX[self.dtype]:
            raise ValueError(
                f"input {self.name!r}: pad {p!r} is beyond {self.dtype}'s range "
                f"(+-{_FLOAT_MAX[self.dtype]:g}); give a pad the dtype holds, or inf"
            )
        return self

    def axes(self) -> tuple[str, ...]:
        """The bucket axes this input's dimensions follow, in dimension order."""
        return tuple(d for d in self.shape if isinstance(d, str) and d in AXES)

    def dynamic_names(self) -> tuple[str, ...]:
        """The name of each dynamic dimension (``dynamic`` alone: ``INPUT_DIM``)."""
        out = []
        for i, d in enumerate(self.shape):
            if isinstance(d, str) and _DYN_RE.fullmatch(d):
                out.append(d.partition(":")[2] or f"{self.name}_{i}")
        return tuple(out)


class SlotSpec(BaseModel):
    """A slot an engine declares: ``factory(**args)`` returns a ``torch.nn.Module``
    whose ``forward(*inputs)`` takes :attr:`inputs` and returns one tensor.

    Its parameters and buffers are not part of the artifact: they are inputs of
    the compiled code, bound or passed at run time.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="the slot's name: lower-case identifier, not a built-in slot")
    factory: str = Field(description=f"the module's factory: {FORM}")
    args: tuple[tuple[str, Scalar], ...] = Field(
        (), description="keyword arguments of the factory (JSON scalars; part of the key)"
    )
    inputs: tuple[SlotInput, ...] = Field(description="the forward's positional inputs, in order")
    output_rows: Literal["query_tokens", "kv_blocks", "decode_seqs"] | None = Field(
        None,
        description="the axis the output's dim 0 follows: rows past the caller's size are "
        "padding, sliced off (None: the output is returned whole)",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.fullmatch(v):
            raise ValueError(f"slot name {v!r}: expected a lower-case identifier such as 'mlp'")
        if v in BUILTIN:
            raise ValueError(
                f"slot name {v!r} is a built-in slot; name the engine's implementation of it "
                f"with --kernel {v}=PATH (kernels=...) instead"
            )
        return v

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str) -> str:
        try:
            return check_path("slot", v)
        except ConfigError as e:
            raise ValueError(str(e).removeprefix("kernels: ")) from None

    @field_validator("args", mode="before")
    @classmethod
    def _args(cls, v):
        items = v.items() if isinstance(v, dict) else v
        try:
            out = tuple(sorted((str(k), x) for k, x in items))
        except (TypeError, ValueError):
            raise ValueError(f"args {v!r}: expected a mapping of keyword to JSON scalar") from None
        for k, x in out:
            if isinstance(x, float) and not math.isfinite(x):
                raise ValueError(
                    f"args {k!r}={x!r}: not a finite number (NaN and Infinity are not JSON, "
                    "and the args are part of the key); pass a finite number or a string"
                )
        return out

    @field_serializer("args")
    def _args_out(self, v):
        return dict(v)

    @model_validator(mode="after")
    def _whole(self):
        if not self.inputs:
            raise ValueError(f"slot {self.name!r} declares no inputs")
        names = [i.name for i in self.inputs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"slot {self.name!r}: input names given twice: {', '.join(dup)}")
        if self.output_rows is not None and self.output_rows not in self.axes():
            raise ValueError(
                f"slot {self.name!r}: output_rows={self.output_rows!r} is an axis no input "
                f"follows (inputs follow: {', '.join(self.axes()) or 'none'})"
            )
        return self

    def axes(self) -> tuple[str, ...]:
        """The bucket axes the inputs follow, in :data:`AXES` order."""
        used = {a for i in self.inputs for a in i.axes()}
        return tuple(a for a in AXES if a in used)

    def factory_args(self) -> dict:
        return dict(self.args)

    def key_json(self) -> str:
        """Compact JSON of what shapes the compiled code besides the factory's
        sources: ``args``, ``inputs`` and ``output_rows`` (the ``geometry`` key
        component of the slot's variants)."""
        doc = self.model_dump(mode="json", include={"args", "inputs", "output_rows"})
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def check_axes(spec: SlotSpec, empty: dict[str, str]) -> None:
    """Refuse a dimension of ``spec`` that follows an axis the plan has no
    buckets on. ``empty``: ``{axis: why it is empty and the fix}``.

    Raises:
        ConfigError: names the slot, the input, the dimension, the axis and the fix.
    """
    for inp in spec.inputs:
        for i, d in enumerate(inp.shape):
            if isinstance(d, str) and d in empty:
                raise ConfigError(
                    f"slot {spec.name!r}: input {inp.name!r} dim {i} follows the {d} axis, "
                    f"but this plan has no {d} buckets ({empty[d]})"
                )


def parse_slot_option(text: str, flag: str = "--slot") -> tuple[SlotSpec, ...]:
    """``--slot`` values: a JSON object (one slot) or ``@FILE`` holding a JSON
    object or a list of them.

    Raises:
        ConfigError: unreadable file, not JSON, or an invalid spec (names ``flag``,
            the value and the first problem).
    """
    from pydantic import ValidationError

    where = f"{flag} {text!r}"
    if text.startswith("@"):
        path = text[1:]
        try:
            with open(path, encoding="utf-8") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(f"{where}: cannot read {path!r}: {e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: cannot read {path!r}: not UTF-8 text ({e})") from None
        where = f"{flag} @{path}"
    else:
        raw = text
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise ConfigError(f"{where}: not JSON (nested too deep); expected a slot object") from None
    except ValueError as e:
        raise ConfigError(
            f"{where}: not JSON ({e}); expected a slot object "
            '{"name": ..., "factory": "pkg.mod:Factory", "inputs": [...]} or @FILE'
        ) from None
    docs = doc if isinstance(doc, list) else [doc]
    out = []
    for d in docs:
        try:
            out.append(SlotSpec.model_validate(d))
        except ValidationError as e:
            raise ConfigError(f"{where}: {explain(e)}") from None
    return tuple(out)


def explain(e) -> str:
    """A pydantic ``ValidationError`` of a slot spec as one line per problem,
    each naming its place (``inputs.0.shape.1``) and the value."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}={err.get('input')!r}: {msg}" if loc else msg)
    return "; ".join(parts)


def torch_dtype(name: str):
    """The ``torch.dtype`` of a :data:`SLOT_DTYPES` name (imports torch)."""
    import torch

    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "int32": torch.int32,
        "int64": torch.int64,
        "bool": torch.bool,
    }[name]
