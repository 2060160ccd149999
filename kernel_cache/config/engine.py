"""Engine configuration: a model's attention geometry plus the engine's limits.

`EngineConfig` is a frozen pydantic model. Build one from a preset name or a
Hugging Face ``config.json`` with :func:`make_config`; bad values raise
:class:`~kernel_cache.errors.ConfigError` naming the field, the value and what
is accepted.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from kernel_cache.config import settings
from kernel_cache.config.kernel_paths import builtin_path, normalize
from kernel_cache.config.recipe import DEFAULT_CPU_TARGET
from kernel_cache.config.slot_spec import SlotSpec, check_axes
from kernel_cache.config.slot_spec import explain as explain_slot
from kernel_cache.errors import ConfigError

#: dtypes a variant can be compiled for. ``float32`` is the CPU default,
#: ``bfloat16`` the CUDA default.
DTYPES = ("float32", "bfloat16", "float16")

ENV_KV_BUCKETS = settings.var("kv_buckets")
ENV_QUERY_BUCKETS = settings.var("query_buckets")
ENV_NUM_SEQS_BUCKETS = settings.var("num_seqs_buckets")
DEVICES = ("cpu", "cuda")
#: KV-cache element types: ``auto`` (the model dtype) or ``fp8_e4m3`` (vLLM's
#: name: the pool in ``torch.float8_e4m3fn`` with a per-tensor float32 K and V
#: scale given at call time; docs/usage.md, "FP8 KV cache").
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
KV_LADDERS = ("4/3", "pow2")


def parse_bucket_list(text: str, name: str, example: str = "128,256,512") -> tuple[int, ...]:
    """Parse a comma-separated list of positive integers (``example`` is shown in errors).

    Raises:
        ConfigError: naming ``name`` (the env variable or flag) and the bad token.
    """
    try:
        return settings.parse_int_list(text)
    except ValueError as e:
        raise ConfigError(
            f"{name}: {e}; expected a comma-separated list of positive integers such as {example}"
        ) from None


def env_overrides(environ=None) -> dict:
    """Bucket overrides from ``KERNEL_CACHE_*_BUCKETS`` (KV in tokens), the
    variables of ``environ`` (default :data:`os.environ`) that are set.

    Raises:
        ConfigError: a list that is not of positive integers (names the variable).
    """
    out = {}
    for field in ("kv_buckets", "query_buckets", "num_seqs_buckets"):
        value = settings.get(field, environ)
        if value is not None:
            out[field] = value
    return out


class ModelGeometry(BaseModel):
    """Attention geometry of a model, as in its Hugging Face ``config.json``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


#: Presets copied from the models' public ``config.json`` files on the Hugging
#: Face hub (num_attention_heads, num_key_value_heads, head_dim or
#: hidden_size / num_attention_heads).
PRESETS: dict[str, ModelGeometry] = {
    # ibm-granite/granite-3.3-8b-instruct: hidden_size 4096, 32 heads, 8 KV heads
    "granite-3.3-8b": ModelGeometry(
        name="granite-3.3-8b", num_heads=32, num_kv_heads=8, head_dim=128
    ),
    # meta-llama/Llama-3.1-8B: hidden_size 4096, 32 heads, 8 KV heads
    "llama-3.1-8b": ModelGeometry(name="llama-3.1-8b", num_heads=32, num_kv_heads=8, head_dim=128),
    # Qwen/Qwen2.5-7B: hidden_size 3584, 28 heads, 4 KV heads
    "qwen2.5-7b": ModelGeometry(name="qwen2.5-7b", num_heads=28, num_kv_heads=4, head_dim=128),
    # meta-llama/Llama-3.2-1B: hidden_size 2048, 32 heads, 8 KV heads, head_dim 64
    "llama-3.2-1b": ModelGeometry(name="llama-3.2-1b", num_heads=32, num_kv_heads=8, head_dim=64),
}

#: The model the built-in default plan is for (``kernel-cache warmup`` with no
#: options). Its engine limits are :class:`EngineConfig`'s field defaults, the
#: one set of defaults the CLI, :func:`make_config` and the README share; they
#: are kept small so that warmup + verify of the default plan finish within a
#: few minutes on a 2-core CPU (measured: see README.md, "Run the main job").
DEFAULT_MODEL = "llama-3.2-1b"

#: EngineConfig fields that come from the model (``--model``), not an option.
GEOMETRY_FIELDS = ("model", "num_heads", "num_kv_heads", "head_dim")


class EngineConfig(BaseModel):
    """Attention geometry and engine limits; the input of the bucketer.

    Units: ``max_model_len``, ``max_num_batched_tokens``, ``kv_dense_cap``,
    ``query_step`` and ``kv_buckets`` are in tokens; ``block_size`` is tokens
    per KV block; ``max_num_seqs``, ``min_batched_seqs`` and
    ``num_seqs_buckets`` are sequences. ``kv_buckets``, ``query_buckets`` and
    ``num_seqs_buckets`` override the computed ladders
    (``KERNEL_CACHE_KV_BUCKETS`` and friends).

    Every field but the geometry is an ENGINE OPTION of the ``kernel-cache``
    command (``--max-model-len`` for ``max_model_len``...), with the default
    and description given here.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "custom"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int = Field(
        1024, description="tokens a sequence can hold, prompt and output together"
    )
    block_size: int = Field(128, description="tokens per KV block")
    max_num_seqs: int = Field(8, description="sequences in one decode batch")
    max_num_batched_tokens: int = Field(
        1024, description="tokens of one prefill chunk (caps the query buckets)"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="element type of query and KV (default float32 on cpu, bfloat16 on cuda)",
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="element type of the KV pool: auto (the model dtype) or fp8_e4m3 "
        "(float8_e4m3fn, with per-tensor float32 k_scale and v_scale passed at call "
        "time; part of the key)",
    )
    device: Literal["cpu", "cuda"] = Field("cpu", description="where the kernels run")
    cpu_target: Literal["x86-64-v3", "native"] = Field(
        DEFAULT_CPU_TARGET,
        description="instruction set of CPU artifacts (part of the key; native: this CPU's "
        "model and features, loads only on the same; see docs/keys.md)",
    )
    kv_ladder: Literal["4/3", "pow2"] = Field(
        "pow2",
        description="KV bucket ladder: pow2 doubles (the shipped kernels read only real KV, "
        "so finer buckets would only add variants); 4/3 grows by a third up to "
        "--kv-dense-cap, then doubles (for kernels that read their whole bucket; "
        "docs/benchmarks/padding.md)",
    )
    kv_dense_cap: int = Field(
        4096, description="tokens where the 4/3 ladder starts doubling; 0 means no cap"
    )
    query_step: int = Field(512, description="tokens between prefill query buckets")
    min_batched_seqs: int = Field(
        4,
        description="smallest decode-batch bucket (sequences); with --max-num-seqs below "
        "it, decode runs sequence by sequence",
    )
    kv_buckets: tuple[int, ...] | None = Field(
        None, description="KV buckets in tokens, replacing the ladder (env KERNEL_CACHE_KV_BUCKETS)"
    )
    query_buckets: tuple[int, ...] | None = Field(
        None, description="prefill query buckets in tokens (env KERNEL_CACHE_QUERY_BUCKETS)"
    )
    num_seqs_buckets: tuple[int, ...] | None = Field(
        None, description="decode-batch buckets in sequences (env KERNEL_CACHE_NUM_SEQS_BUCKETS)"
    )
    kernels: tuple[tuple[str, str], ...] = Field(
        (),
        description="the engine's own implementation of a kernel slot, as SLOT=package."
        "module:Factory (repeatable; slots: paged_attention, batched_decode; see "
        "kernel_cache.kernels.slots); the other slots keep the built-in kernels",
    )
    slots: tuple[SlotSpec, ...] = Field(
        (),
        description="a slot the engine declares beside attention, as a JSON object or "
        "@FILE of JSON (an object or a list; repeatable): name, factory, args, inputs, "
        "output_rows (docs/custom_kernels.md)",
    )

    @field_validator(
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_model_len",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "query_step",
        "min_batched_seqs",
    )
    @classmethod
    def _positive(cls, v: int, info):
        if v < 1:
            raise ValueError(f"{info.field_name} must be an integer >= 1, got {v}")
        return v

    @field_validator("kernels", mode="before")
    @classmethod
    def _kernels(cls, v, info):
        """Sorted ``(slot, path)`` pairs; a pair naming the slot's built-in
        factory on this device is dropped, so naming it is the same config (the
        same keys, fingerprint and command line) as leaving it out."""
        try:
            pairs = normalize(v)
        except ConfigError as e:  # pydantic reports a ValueError with the field name
            raise ValueError(str(e).removeprefix("kernels: ")) from None
        device = info.data.get("device", "cpu")
        return tuple((s, p) for s, p in pairs if p != builtin_path(s, device))

    @field_validator("slots", mode="before")
    @classmethod
    def _slots(cls, v):
        """Specs (or their JSON-ready dicts) sorted by name; a name given twice
        with different specs is refused."""
        if v is None:
            return ()
        if isinstance(v, (SlotSpec, dict)):
            v = (v,)
        out: dict[str, SlotSpec] = {}
        for item in v:
            try:
                spec = item if isinstance(item, SlotSpec) else SlotSpec.model_validate(item)
            except ValidationError as e:
                raise ValueError(explain_slot(e)) from None
            if out.get(spec.name, spec) != spec:
                raise ValueError(f"slot {spec.name!r} declared twice with different specs")
            out[spec.name] = spec
        return tuple(out[n] for n in sorted(out))

    @field_validator("kv_dense_cap")
    @classmethod
    def _cap(cls, v: int):
        if v < 0:
            raise ValueError(f"kv_dense_cap must be >= 0 tokens (0 = no cap), got {v}")
        return v

    @model_validator(mode="after")
    def _gqa(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for GQA; accepted num_kv_heads: "
                f"{[d for d in range(1, self.num_heads + 1) if self.num_heads % d == 0]}"
            )
        return self

    @model_validator(mode="after")
    def _slot_axes(self):
        for spec in self.slots:
            try:
                check_axes(spec, self.empty_axes())
            except ConfigError as e:
                raise ValueError(str(e)) from None
        return self

    def empty_axes(self) -> dict[str, str]:
        """``{axis: why the plan has no buckets on it, and the fix}`` for each
        bucket axis of :data:`~kernel_cache.config.slot_spec.AXES` this config
        leaves empty (only ``decode_seqs`` can be: the plan then decodes one
        sequence at a time)."""
        if self.num_seqs_buckets is None and self.max_num_seqs < self.min_batched_seqs:
            return {
                "decode_seqs": f"max_num_seqs={self.max_num_seqs} is below min_batched_seqs="
                f"{self.min_batched_seqs}; fix: --min-batched-seqs {self.max_num_seqs} or "
                "--num-seqs-buckets, or declare the dimension fixed, dynamic or on another axis"
            }
        return {}

    def slot(self, name: str) -> SlotSpec | None:
        """The declared slot ``name``, or None."""
        for spec in self.slots:
            if spec.name == name:
                return spec
        return None

    @property
    def max_blocks(self) -> int:
        """KV blocks needed for ``max_model_len`` tokens: ceil(max_model_len / block_size)."""
        return math.ceil(self.max_model_len / self.block_size)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def geometry(self) -> dict:
        """The fields that shape a compiled kernel (part of every cache key)."""
        return {
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
        }

    def torch_dtype(self):
        """The model dtype (query and output) as a ``torch.dtype``."""
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[
            self.dtype
        ]

    @property
    def kv_fp8(self) -> bool:
        """Whether the KV pool is fp8 (``kv_cache_dtype == "fp8_e4m3"``)."""
        return self.kv_cache_dtype == "fp8_e4m3"

    def kv_torch_dtype(self):
        """The KV pool's ``torch.dtype``: ``torch.float8_e4m3fn`` for ``fp8_e4m3``,
        else the model dtype."""
        import torch

        return torch.float8_e4m3fn if self.kv_fp8 else self.torch_dtype()


def geometry_from_hf_config(path: str | os.PathLike) -> ModelGeometry:
    """Read num_heads / num_kv_heads / head_dim from a Hugging Face ``config.json``.

    Uses ``num_attention_heads``, ``num_key_value_heads`` (defaults to
    num_attention_heads, as in transformers) and ``head_dim`` or
    ``hidden_size / num_attention_heads``.

    Raises:
        ConfigError: the file is missing, is not JSON, or lacks the head counts.
    """
    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ConfigError(f"--model: directory {str(p)!r} has no config.json")
        p = p / "config.json"
    try:
        cfg = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--model: no such file {str(p)!r}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model: {str(p)!r} is not a readable JSON config: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--model: {str(p)!r} must hold a JSON object")
    cfg = cfg.get("text_config", cfg) if "num_attention_heads" not in cfg else cfg
    heads = cfg.get("num_attention_heads")
    if not isinstance(heads, int) or isinstance(heads, bool):
        raise ConfigError(
            f"--model: {str(p)!r} has no integer 'num_attention_heads' (got {heads!r}); "
            "a Hugging Face config.json needs num_attention_heads, num_key_value_heads "
            "and head_dim or hidden_size"
        )
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        hidden = cfg.get("hidden_size")
        if not isinstance(hidden, int) or hidden % heads:
            raise ConfigError(
                f"--model: {str(p)!r} has neither 'head_dim' nor a 'hidden_size' divisible by "
                f"num_attention_heads={heads} (hidden_size={hidden!r})"
            )
        head_dim = hidden // heads
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in (kv, head_dim)):
        raise ConfigError(
            f"--model: {str(p)!r}: num_key_value_heads={kv!r} and head_dim={head_dim!r} "
            "must be integers"
        )
    return ModelGeometry(name=str(p.resolve()), num_heads=heads, num_kv_heads=kv, head_dim=head_dim)


def resolve_model(model: str) -> ModelGeometry:
    """A preset name (see :data:`PRESETS`) or a path to a ``config.json``."""
    if model in PRESETS:
        return PRESETS[model]
    if os.sep in model or model.endswith(".json") or Path(model).exists():  # a path
        return geometry_from_hf_config(model)
    raise ConfigError(
        f"--model: unknown preset {model!r}; accepted presets: {', '.join(PRESETS)}, "
        "or a path to a Hugging Face config.json"
    )


def make_config(model: str | None = None, *, use_env: bool = True, **fields) -> EngineConfig:
    """Build an :class:`EngineConfig` from a preset or config path plus limits.

    ``fields`` left as ``None`` take :class:`EngineConfig`'s defaults, the same
    as the ``kernel-cache`` command's: ``make_config(DEFAULT_MODEL)`` is the
    plan ``kernel-cache warmup`` warms with no options. ``dtype`` defaults to float32
    on the CPU and bfloat16 on CUDA. With ``use_env`` (the default), bucket
    lists not given here come from ``KERNEL_CACHE_KV_BUCKETS``,
    ``KERNEL_CACHE_QUERY_BUCKETS`` and ``KERNEL_CACHE_NUM_SEQS_BUCKETS``, so an
    engine and ``kernel-cache warmup`` started with the same environment agree
    on the plan.

    Raises:
        ConfigError: naming each invalid field, its value and the accepted values.
    """
    fields = {k: v for k, v in fields.items() if v is not None}
    if use_env:
        fields = {**env_overrides(), **fields}
    if model is not None:
        geo = resolve_model(model)
        fields = {
            "model": geo.name,
            "num_heads": geo.num_heads,
            "num_kv_heads": geo.num_kv_heads,
            "head_dim": geo.head_dim,
            **fields,
        }
    if "dtype" not in fields:
        fields["dtype"] = "bfloat16" if fields.get("device") == "cuda" else "float32"
    try:
        return EngineConfig(**fields)
    except ValidationError as e:
        raise ConfigError(_explain_validation(e)) from None


_ACCEPTED = {
    "dtype": DTYPES,
    "device": DEVICES,
    "kv_ladder": KV_LADDERS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
}


def _explain_validation(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        field = ".".join(str(x) for x in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        accepted = _ACCEPTED.get(field)
        extra = f"; accepted values: {', '.join(accepted)}" if accepted else ""
        if err["loc"]:
            lines.append(f"{field}={err.get('input')!r}: {msg}{extra}")
        else:  # a rule across fields: the message names them
            lines.append(msg)
    return "invalid engine configuration: " + "; ".join(lines)


#: The ENGINE OPTIONS of the ``kernel-cache`` command: every
#: :class:`EngineConfig` field but the geometry, each as ``--field-name``.
ENGINE_OPTION_FIELDS = tuple(f for f in EngineConfig.model_fields if f not in GEOMETRY_FIELDS)


#: Fields whose flag is not the field's name: ``kernels`` is ``--kernel
#: SLOT=PATH``, once per slot; ``slots`` is ``--slot JSON|@FILE``, repeatable.
_FLAGS = {"kernels": "--kernel", "slots": "--slot"}


def option_flag(field: str) -> str:
    """The command-line flag of an :class:`EngineConfig` field: ``--max-model-len``
    (``--kernel`` for ``kernels``)."""
    return _FLAGS.get(field) or "--" + field.replace("_", "-")


def config_to_cli(config: EngineConfig, cache_dir=None) -> str:
    """ENGINE OPTIONS (and ``--cache-dir`` if given) that rebuild ``config``: the
    command an error message tells the user to run. Every option is spelled out,
    so the command warms this plan even where the defaults differ."""
    import shlex

    parts = [f"--model {shlex.quote(config.model)}"]
    for field in ENGINE_OPTION_FIELDS:
        value = getattr(config, field)
        if value is None or value == () or (field == "kv_cache_dtype" and value == "auto"):
            continue  # auto is the default on every device: left out, as before the option
        if field == "kernels":
            parts += [f"{option_flag(field)} {shlex.quote(f'{k}={p}')}" for k, p in value]
            continue
        if field == "slots":
            parts += [
                f"{option_flag(field)} {shlex.quote(s.model_dump_json(exclude_defaults=True))}"
                for s in value
            ]
            continue
        if isinstance(value, tuple):
            value = ",".join(map(str, value))
        parts.append(f"{option_flag(field)} {shlex.quote(str(value))}")
    if cache_dir is not None:
        parts.append(f"--cache-dir {shlex.quote(str(Path(cache_dir).resolve()))}")
    return " ".join(parts)
