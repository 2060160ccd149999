"""Real request lengths: read the Azure LLM inference CSV, turn it into the kernel
calls an engine makes.

Format: the Azure LLM inference trace CSV (``ContextTokens`` and
``GeneratedTokens`` columns; other columns ignored). A request's prefill has
``ContextTokens`` query tokens over the same number of KV tokens, split into
chunks of at most ``min(max_num_batched_tokens, max_model_len)`` tokens; its
decode step ``i`` (0-based) has one query token over ``ContextTokens + i + 1``
KV tokens. Requests are served in waves of up to ``max_num_seqs`` sequences
that decode together (a simple static-batching scheduler).

Data: Microsoft Azure Public Dataset, AzureLLMInferenceTrace_conv (2023),
CC BY 4.0, published with "Splitwise: Efficient generative LLM inference using
phase splitting" (ISCA 2024).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kernel_cache.errors import ConfigError
from kernel_cache.plan.buckets import BATCHED_DECODE, PAGED_ATTENTION, Bucketer


@dataclass(frozen=True)
class Request:
    """One request: prompt tokens and generated tokens."""

    context_tokens: int
    generated_tokens: int


@dataclass(frozen=True)
class Call:
    """One kernel call: ``kernel``, real ``query_len`` (tokens per sequence), the
    real KV length of each sequence (tokens) and each sequence's slot in its wave
    (0 .. max_num_seqs - 1, an index into the engine's block tables)."""

    kernel: str
    query_len: int
    seq_lens: tuple[int, ...]
    slots: tuple[int, ...]


def read_trace(path: str | Path, limit: int | None = None, start: int = 0) -> list[Request]:
    """Rows ``start .. start+limit`` of a trace CSV with ContextTokens,GeneratedTokens.

    Raises:
        ConfigError: the file is missing, is not a UTF-8 CSV, lacks those
            columns, or a row's lengths are not integers (names the row).
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"trace {str(p)!r}: no such file")
    out = []
    try:
        with p.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            cols = set(reader.fieldnames or ())
            if not {"ContextTokens", "GeneratedTokens"} <= cols:
                raise ConfigError(
                    f"trace {str(p)!r}: needs columns ContextTokens,GeneratedTokens; "
                    f"found {sorted(cols)}"
                )
            for i, row in enumerate(reader):
                if i < start:
                    continue
                if limit is not None and len(out) >= limit:
                    break
                ctx, gen = row["ContextTokens"], row["GeneratedTokens"]
                try:
                    out.append(Request(int(ctx), int(gen)))
                except (TypeError, ValueError):
                    raise ConfigError(
                        f"trace {str(p)!r}: row {i}: ContextTokens={ctx!r}, "
                        f"GeneratedTokens={gen!r} are not integers"
                    ) from None
    except (UnicodeDecodeError, csv.Error) as e:
        raise ConfigError(f"trace {str(p)!r}: not a UTF-8 CSV: {type(e).__name__}: {e}") from None
    return out


def fit_request(r: Request, max_model_len: int) -> tuple[int, int, bool]:
    """Clamp a request to ``max_model_len`` (tokens): ``(context, generated, truncated)``.

    Generated tokens are cut first, then the prompt (an engine would reject or
    truncate such a request; the trace's context reaches 14,050 tokens)."""
    ctx = max(1, min(r.context_tokens, max_model_len))
    gen = max(0, min(r.generated_tokens, max_model_len - ctx))
    return ctx, gen, (ctx, gen) != (r.context_tokens, r.generated_tokens)


def schedule(requests: list[Request], bucketer: Bucketer) -> Iterator[Call]:
    """The kernel calls that serve ``requests`` (prefill chunks, then batched decode)."""
    c = bucketer.config
    max_q = bucketer.max_query
    for w in range(0, len(requests), c.max_num_seqs):
        wave = [fit_request(r, c.max_model_len)[:2] for r in requests[w : w + c.max_num_seqs]]
        for slot, (ctx, _) in enumerate(wave):
            done = 0
            while done < ctx:
                q = min(max_q, ctx - done)
                done += q
                yield Call(PAGED_ATTENTION, q, (done,), (slot,))
        longest = max((g for _, g in wave), default=0)
        for step in range(longest):
            active = [(slot, ctx) for slot, (ctx, g) in enumerate(wave) if step < g]
            yield Call(
                BATCHED_DECODE,
                1,
                tuple(ctx + step + 1 for _, ctx in active),
                tuple(slot for slot, _ in active),
            )


def kv_blocks_read(bucketer: Bucketer, call: Call) -> tuple[int, int]:
    """``(blocks read, real blocks)`` of a call under ``bucketer``'s buckets.

    Blocks read counts every KV block the bucketed kernel reads, padded rows of a
    decode batch included; real blocks are ``sum(ceil(seq_len / block_size))``.
    """
    bs = bucketer.block_size
    real = sum(-(-n // bs) for n in call.seq_lens)
    nb = bucketer.blocks_bucket(max(1, -(-max(call.seq_lens) // bs)))
    if call.kernel == BATCHED_DECODE and bucketer.num_seqs_buckets:
        return nb * bucketer.num_seqs_bucket(len(call.seq_lens)), real
    if call.kernel == BATCHED_DECODE:  # per-sequence fallback: each its own bucket
        read = sum(bucketer.blocks_bucket(max(1, -(-n // bs))) for n in call.seq_lens)
        return read, real
    return nb, real
