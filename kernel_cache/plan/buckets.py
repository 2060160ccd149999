"""The bucketer: the one source of truth for shape buckets and kernel variants.

Warmup, verify and dispatch all read the same :class:`Bucketer`; its
:meth:`~Bucketer.fingerprint` goes into every plan.

Ladders (all immutable tuples):

* KV, in blocks. ``max_blocks = ceil(max_model_len / block_size)``. The first
  bucket is 1 block and the last is exactly ``max_blocks``.

  - ``4/3`` (default): ``b0 = 1, next = max(b + 1, ceil(b * 4/3))`` while below
    ``cap_blocks = ceil(kv_dense_cap / block_size)``; ``cap_blocks`` itself is a
    bucket; above it ``cap_blocks * 2, * 4, ...`` while below ``max_blocks``.
    Below the cap a real block count ``n`` maps to the smallest bucket
    ``B >= n`` with ``(B - n) / B < 1/4`` (at most a quarter of a read is
    padding; property-tested in ``tests/plan/test_buckets.py``).
  - ``pow2``: 1, 2, 4, ... while below ``max_blocks``, then ``max_blocks``.

* Query (prefill / mixed kernel), in tokens: ``{1} U {k * query_step <= M} U {M}``
  with ``M = min(max_num_batched_tokens, max_model_len)``.
* num_seqs (batched decode): powers of two from ``min_batched_seqs`` below
  ``max_num_seqs``, plus ``max_num_seqs``; empty when
  ``max_num_seqs < min_batched_seqs`` (decode then uses the per-sequence kernel).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
import re

from pydantic import BaseModel, ConfigDict, field_validator

from kernel_cache.config.engine import (  # noqa: F401 - re-exported: overrides are parsed with the config
    ENV_KV_BUCKETS,
    ENV_NUM_SEQS_BUCKETS,
    ENV_QUERY_BUCKETS,
    EngineConfig,
    env_overrides,
    parse_bucket_list,
)
from kernel_cache.errors import ConfigError, ShapeError

log = logging.getLogger("kernel_cache")

PAGED_ATTENTION = "paged_attention"
BATCHED_DECODE = "batched_decode"
KERNELS = (PAGED_ATTENTION, BATCHED_DECODE)


#: A kernel name: a built-in slot or a declared one (a lower-case identifier).
_KERNEL_RE = re.compile(r"[a-z_][a-z0-9_]*")


class KernelVariant(BaseModel):
    """One compiled kernel: a kernel name and its static bucket shape.

    ``query_len`` is in tokens, ``num_blocks`` in KV blocks, ``num_seqs`` in
    sequences. ``paged_attention`` variants have ``num_seqs == 1``;
    ``batched_decode`` variants have ``query_len == 1``. A declared slot's
    variant (``kernel`` is the slot's name,
    :class:`~kernel_cache.config.slot_spec.SlotSpec`) has the bucket of each
    axis its inputs follow and 0 on the others (``mlp:512:0:0``).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kernel: str
    query_len: int
    num_blocks: int
    num_seqs: int

    @field_validator("kernel")
    @classmethod
    def _kernel(cls, v: str) -> str:
        if not _KERNEL_RE.fullmatch(v):
            raise ValueError(f"kernel {v!r}: expected a slot name (a lower-case identifier)")
        return v

    def __str__(self) -> str:
        return f"{self.kernel}:{self.query_len}:{self.num_blocks}:{self.num_seqs}"

    @classmethod
    def parse(cls, text: str, flag: str = "--variant") -> KernelVariant:
        """Parse ``KERNEL:QUERY:BLOCKS:SEQS`` (the form ``str()`` prints).

        Raises:
            ConfigError: another form; the message names ``flag``.
        """
        parts = text.split(":")
        if len(parts) != 4 or not _KERNEL_RE.fullmatch(parts[0]):
            raise ConfigError(
                f"{flag} {text!r}: expected KERNEL:QUERY:BLOCKS:SEQS with KERNEL one of "
                f"{', '.join(KERNELS)} or a declared slot, e.g. batched_decode:1:8:4"
            )
        try:
            q, b, s = (int(x) for x in parts[1:])
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: QUERY, BLOCKS and SEQS must be integers") from None
        return cls(kernel=parts[0], query_len=q, num_blocks=b, num_seqs=s)


def kv_ladder_blocks(max_blocks: int, ladder: str, cap_blocks: int | None) -> tuple[int, ...]:
    """The KV ladder in blocks (see module docstring). ``cap_blocks=None``: no cap."""
    if max_blocks < 1:
        raise ConfigError(f"max_blocks must be >= 1, got {max_blocks}")
    out: list[int] = []
    if ladder == "pow2":
        b = 1
        while b < max_blocks:
            out.append(b)
            b *= 2
    elif ladder == "4/3":
        limit = max_blocks if cap_blocks is None else min(cap_blocks, max_blocks)
        b = 1
        while b < limit:
            out.append(b)
            b = max(b + 1, math.ceil(b * 4 / 3))
        if cap_blocks is not None and cap_blocks < max_blocks:
            b = cap_blocks
            while b < max_blocks:
                out.append(b)
                b *= 2
    else:
        raise ConfigError(f"kv_ladder={ladder!r}; accepted values: 4/3, pow2")
    out.append(max_blocks)
    return tuple(out)


def _override(values, limit: int, name: str, unit_check=None) -> tuple[int, ...]:
    vals = sorted(set(values))
    for v in vals:
        if unit_check:
            unit_check(v)
        if v > limit:
            raise ConfigError(
                f"{name}: entry {v} is above the axis limit {limit}; remove it or raise the limit "
                "(a bucket above the limit would pad every call to it)"
            )
    if vals[-1] != limit:
        log.info(
            "%s stops at %d, short of the limit %d: appending %d", name, vals[-1], limit, limit
        )
        vals.append(limit)
    return tuple(vals)


class Bucketer:
    """Turns an :class:`EngineConfig`'s limits into immutable ladders and variants.

    Attributes (tuples of ints, ascending):
        num_blocks_buckets: KV buckets in blocks.
        kv_buckets: the same in tokens (``num_blocks * block_size``).
        query_buckets: query-length buckets in tokens.
        num_seqs_buckets: decode-batch buckets in sequences (may be empty).

    Raises:
        ConfigError: an override entry is not a multiple of block_size (KV), or
            is above its axis limit; the message names the variable.
    """

    def __init__(self, config: EngineConfig):
        self.config = config
        c = config
        self.block_size = c.block_size
        self.max_blocks = c.max_blocks
        self.max_query = min(c.max_num_batched_tokens, c.max_model_len)
        if c.kv_buckets is not None:
            name = f"kv_buckets ({ENV_KV_BUCKETS} / --kv-buckets)"

            def _mult(v):
                if v % c.block_size:
                    raise ConfigError(
                        f"{name}: entry {v} tokens is not a multiple of block_size "
                        f"{c.block_size}; use {math.ceil(v / c.block_size) * c.block_size}"
                    )

            toks = _override(c.kv_buckets, c.max_blocks * c.block_size, name, _mult)
            self.num_blocks_buckets = tuple(t // c.block_size for t in toks)
        else:
            cap = math.ceil(c.kv_dense_cap / c.block_size) if c.kv_dense_cap else None
            self.num_blocks_buckets = kv_ladder_blocks(c.max_blocks, c.kv_ladder, cap)
        self.kv_buckets = tuple(b * c.block_size for b in self.num_blocks_buckets)

        if c.query_buckets is not None:
            self.query_buckets = _override(
                c.query_buckets,
                self.max_query,
                f"query_buckets ({ENV_QUERY_BUCKETS} / --query-buckets)",
            )
        else:
            m = self.max_query
            qs = {1, m} | set(range(c.query_step, m + 1, c.query_step))
            self.query_buckets = tuple(sorted(qs))

        if c.num_seqs_buckets is not None:
            self.num_seqs_buckets = _override(
                c.num_seqs_buckets,
                c.max_num_seqs,
                f"num_seqs_buckets ({ENV_NUM_SEQS_BUCKETS} / --num-seqs-buckets)",
            )
        elif c.max_num_seqs < c.min_batched_seqs:
            self.num_seqs_buckets = ()
        else:
            s, ns = c.min_batched_seqs, []
            while s < c.max_num_seqs:
                ns.append(s)
                s *= 2
            ns.append(c.max_num_seqs)
            self.num_seqs_buckets = tuple(ns)
        self._variants = self._make_variants()

    # -- variants ---------------------------------------------------------
    def _make_variants(self) -> tuple[KernelVariant, ...]:
        out = []
        prev = 0
        for q in self.query_buckets:
            smallest_real = prev + 1
            for nb in self.num_blocks_buckets:
                if smallest_real <= nb * self.block_size:
                    out.append(
                        KernelVariant(
                            kernel=PAGED_ATTENTION, query_len=q, num_blocks=nb, num_seqs=1
                        )
                    )
            prev = q
        for s in self.num_seqs_buckets:
            for nb in self.num_blocks_buckets:
                out.append(
                    KernelVariant(kernel=BATCHED_DECODE, query_len=1, num_blocks=nb, num_seqs=s)
                )
        for spec in self.config.slots:
            out += self.slot_variants(spec)
        return tuple(out)

    def slot_variants(self, spec) -> list[KernelVariant]:
        """The variants of declared slot ``spec``: one per bucket of each axis its
        inputs follow (the product over several), 0 on the axes it does not."""
        ladders = {
            "query_tokens": self.query_buckets,
            "kv_blocks": self.num_blocks_buckets,
            "decode_seqs": self.num_seqs_buckets,
        }
        used = spec.axes()
        combos: list[dict[str, int]] = [{}]
        for axis in used:
            combos = [{**c, axis: b} for c in combos for b in ladders[axis]]
        return [
            KernelVariant(
                kernel=spec.name,
                query_len=c.get("query_tokens", 0),
                num_blocks=c.get("kv_blocks", 0),
                num_seqs=c.get("decode_seqs", 0),
            )
            for c in combos
        ]

    @property
    def variants(self) -> tuple[KernelVariant, ...]:
        """Every variant the engine can dispatch: the plan to compile."""
        return self._variants

    # -- lookups (hot path: bisect over tuples, host ints only) ------------
    def blocks_bucket(self, num_blocks: int) -> int:
        """Smallest KV bucket (blocks) >= ``num_blocks``; ShapeError above max_blocks."""
        i = bisect.bisect_left(self.num_blocks_buckets, num_blocks)
        if i == len(self.num_blocks_buckets):
            raise ShapeError(
                f"kv length needs {num_blocks} blocks of {self.block_size} tokens, above the "
                f"plan's limit max_model_len={self.config.max_model_len} "
                f"({self.max_blocks} blocks); raise --max-model-len and warm up again"
            )
        return self.num_blocks_buckets[i]

    def query_bucket(self, query_len: int) -> int:
        i = bisect.bisect_left(self.query_buckets, query_len)
        if i == len(self.query_buckets):
            raise ShapeError(
                f"query_len {query_len} is above the plan's limit "
                f"min(max_num_batched_tokens, max_model_len)={self.max_query}; split the chunk "
                "or raise --max-num-batched-tokens"
            )
        return self.query_buckets[i]

    def num_seqs_bucket(self, num_seqs: int) -> int:
        i = bisect.bisect_left(self.num_seqs_buckets, num_seqs)
        if i == len(self.num_seqs_buckets):
            raise ShapeError(
                f"num_seqs {num_seqs} is above the plan's limit max_num_seqs="
                f"{self.config.max_num_seqs}; raise --max-num-seqs and warm up again"
            )
        return self.num_seqs_buckets[i]

    # -- identity -----------------------------------------------------------
    def describe(self) -> dict:
        """The ladders and variants as JSON-ready data (``kernel-cache plan --json``)."""
        return {
            "kv_buckets": list(self.kv_buckets),
            "num_blocks_buckets": list(self.num_blocks_buckets),
            "query_buckets": list(self.query_buckets),
            "num_seqs_buckets": list(self.num_seqs_buckets),
            "variants": [v.model_dump() for v in self.variants],
            "fingerprint": self.fingerprint(),
        }

    def _unchanged(self) -> set[str] | None:
        """Fields left out of the fingerprint at their defaults: ``kv_cache_dtype``
        auto and no declared ``slots`` keep a plan's fingerprint what it was
        before the options existed."""
        out = set()
        if not self.config.kv_fp8:
            out.add("kv_cache_dtype")
        if not self.config.slots:
            out.add("slots")
        return out or None

    def fingerprint(self) -> str:
        """sha256 (hex, 16 chars) over the config and the ladders it produced."""
        doc = {
            # kv_cache_dtype auto is left out: a plan's fingerprint is what it was
            # before the option existed
            "config": self.config.model_dump(mode="json", exclude=self._unchanged()),
            "num_blocks_buckets": self.num_blocks_buckets,
            "query_buckets": self.query_buckets,
            "num_seqs_buckets": self.num_seqs_buckets,
        }
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]
