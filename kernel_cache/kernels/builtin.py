"""The built-in CPU kernels, :class:`RealKVPagedAttention` and
:class:`RealKVBatchedDecode` (the slots' default factories on the CPU,
:data:`kernel_cache.config.kernel_paths.BUILTIN`), and :func:`build_module`,
which builds the module of any slot's factory.

Both extend the plain kernels of :mod:`kernel_cache.kernels.plain` (same
layout, inputs, outputs and semantics). On the CPU, when traced for export,
they read only the KV a sequence really has: prefill copies the sequence's
positions below ``seq_len`` (a data-dependent length) and runs SDPA's CPU flash
kernel on the real query rows, in chunks (each causal over its own positions
and unmasked over those before, merged by log-sum-exp); decode runs
``torch.nn.attention.flex_attention`` over the whole paged pool with a block
mask built in the graph from ``seq_lens`` and the block tables, so a sequence
reads its own blocks up to ``seq_len`` and a padded row (``seq_len == 0``)
reads none. Run eagerly (``verify``'s oracle) or off the CPU both are the
plain kernels (for decode also because eager ``flex_attention`` ignores the
block mask's sparsity).

The bytes of this file, and of ``plain.py`` which it imports, are hashed into
every cache key (:func:`kernel_cache.plan.sources.source_files`): any edit
here misses the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from kernel_cache import torch_compat
from kernel_cache.kernels.plain import BatchedDecode, PagedAttention, dequant


class RealKVPagedAttention(PagedAttention):
    """:class:`PagedAttention` that reads only the sequence's real KV blocks (CPU).

    Same inputs, outputs and semantics as :class:`PagedAttention`. Traced on the
    CPU by ``torch.export`` or ``torch.compile`` (:meth:`real_blocks`) it reads
    the first ``ceil(seq_len / block_size)`` blocks of ``block_table`` (a
    data-dependent count: unbacked sizes under ``torch.export``, bounded by
    :func:`kernel_cache.torch_compat.check`) and only the real query rows ``r = min(real_query_len,
    seq_len)``, with ``start = seq_len - r`` the position of row 0. The rows
    are cut in ``max(1, q_len // 192)`` chunks (``_PREFILL_CHUNK_ROWS``); each
    chunk ``[a, e)`` takes two calls of the CPU flash kernel (GQA native),
    merged by their log-sum-exp:

    * its own square, positions ``start + a .. start + e - 1``, ``is_causal``
      (top-left: row ``i`` sees up to ``start + i``);
    * the positions before it, ``< start + a``, unmasked. For a fresh prompt's
      first chunk (nothing before it) the call reads position 0, weighted 0.

    No boolean mask is built. K and V of each call are copied from the pool
    straight into a head-major ``[1, num_kv_heads, length, head_dim]`` buffer
    in the cache's dtype (the CPU flash kernel reads a token-major view about
    15 % slower; ``docs/benchmarks/cpu-kernels.md``). Blocks past ``seq_len`` are not read.
    Run eagerly (``verify``'s oracle) or on another device it is the plain
    :class:`PagedAttention`, so that ``verify`` compares the artifact with an
    independent formulation.

    Padded query rows (``>= real_query_len``) are zeros. ``seq_len`` 0 (not
    produced by dispatch) reads position 0 only and stays finite. A NaN or inf
    among the real K/V (positions below ``seq_len``) or the query rows, or a
    result that is not finite (a sum past the float range), sends the chunk to
    the plain kernel (``torch.cond``): the flash kernel returns 0 for a row
    whose visible scores are all NaN or ``-inf``, the reference NaN.
    """

    def forward(
        self,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_len,
        real_query_len,
        k_scale=None,
        v_scale=None,
    ):
        args = (query, key_cache, value_cache, block_table, seq_len, real_query_len)
        if query.device.type != "cpu" or not torch.compiler.is_compiling():
            return super().forward(*args, k_scale, v_scale)
        return self.real_blocks(*args, k_scale, v_scale)

    def real_blocks(
        self,
        query,
        key_cache,
        value_cache,
        block_table,
        seq_len,
        real_query_len,
        k_scale=None,
        v_scale=None,
    ):
        """The gather of the real blocks and the chunked flash calls (what is
        compiled for the CPU); callable eagerly. Same inputs and output as
        :meth:`forward`."""
        q_len = query.shape[0]
        nb = block_table.shape[0]
        bs = key_cache.shape[1]
        kvh, d = self.num_kv_heads, self.head_dim
        kv_t = seq_len[0].clamp(1, nb * bs)  # seq_len 0 reads position 0
        rows_t = torch.minimum(real_query_len[0], kv_t).clamp(1, q_len)
        # start (the absolute position of query row 0) is its own unbacked size,
        # so that Inductor knows the slices below start at or after 0.
        start, rows = (kv_t - rows_t).item(), rows_t.item()
        torch_compat.check(start >= 0)
        torch_compat.check(rows >= 1)
        torch_compat.check(rows <= q_len)
        kv_len = start + rows
        torch_compat.check(kv_len <= nb * bs)
        n = (kv_len + (bs - 1)) // bs
        idx = block_table[:n].long()
        # Head-major [1, kvh, n * block_size, d] (the reshape alone is a token-major
        # view): the CPU flash kernel reads it faster. Inductor copies only the
        # sliced positions below, straight from the pool.
        k = key_cache[idx].permute(2, 0, 1, 3).reshape(1, kvh, n * bs, d)
        v = value_cache[idx].permute(2, 0, 1, 3).reshape(1, kvh, n * bs, d)
        if k_scale is not None:  # fp8: the real blocks dequantized into the query's dtype
            k, v = (dequant(k, k_scale).to(query.dtype), dequant(v, v_scale).to(query.dtype))
        k, v = k.contiguous(), v.contiguous()
        q = query[:rows].transpose(0, 1).unsqueeze(0)  # [1, H, rows, D]: the real rows
        flash = torch_compat.cpu_flash_attention()
        fresh = kv_t == rows_t  # a fresh prompt: nothing before row 0
        # The rows in n_chunks chunks (a fixed count per query bucket: a full
        # bucket's chunks have at least _PREFILL_CHUNK_ROWS rows, from which the
        # flash kernel takes 64-row query tiles, not 32): chunk [a, e) sees, unmasked, every
        # position before start + a and, causally, the square of its own positions.
        # The flash kernel computes whole 512-position KV tiles under is_causal, so
        # one causal call over the whole diagonal does twice the work it needs;
        # chunks leave C^2 / 2 per chunk. Each chunk's rows are written into a
        # zeroed [1, H, q_len, D] output (padded rows stay zeros). A chunk with no
        # real row of its own (fewer rows than chunks) computes the last row again
        # (the flash kernel cannot take 0 rows), which it writes with the same value.
        n_chunks = max(1, q_len // _PREFILL_CHUNK_ROWS)
        out = q.new_zeros(1, q.shape[1], q_len, d)
        for j in range(n_chunks):
            b0, b1 = (j * rows) // n_chunks, ((j + 1) * rows) // n_chunks
            a = torch.sym_min(b0, rows - 1)
            e = torch.sym_max(b1, a + 1)
            torch_compat.check(a >= 0)
            torch_compat.check(e > a)
            torch_compat.check(e <= rows)
            qa = q[:, :, a:e]
            diag, lse_d = flash(
                qa,
                k[:, :, start + a : start + e],
                v[:, :, start + a : start + e],
                is_causal=True,
                scale=self.scale,
            )[:2]
            # Before the chunk: with nothing there (a fresh prompt's first chunk)
            # the call reads position 0, weighted 0.
            p_end = torch.sym_max(start + a, 1)
            pre, lse_p = flash(qa, k[:, :, :p_end], v[:, :, :p_end], scale=self.scale)[:2]
            if j == 0:
                lse_p = torch.where(fresh, float("-inf"), lse_p)  # [1, H, e - a] float32
            m = torch.maximum(lse_p, lse_d)
            w_p, w_d = torch.exp(lse_p - m)[..., None], torch.exp(lse_d - m)[..., None]
            merged = (pre.float() * w_p + diag.float() * w_d) / (w_p + w_d)
            out = out.slice_scatter(merged.to(out.dtype), dim=2, start=a, end=e)
        out = out[0].transpose(0, 1).to(query.dtype)  # [q_len, H, D]
        # The CPU flash kernel returns 0 (and a log-sum-exp of 0) for a row whose
        # visible scores are all NaN or -inf, where the reference is NaN, and the
        # merge then weighs the other call wrongly: with a NaN or inf among the real
        # K/V the plain kernel recomputes the chunk.
        finite = k[:, :, :kv_len].isfinite().all() & v[:, :, :kv_len].isfinite().all()
        finite = finite & q.isfinite().all() & out.isfinite().all()  # NaN query; overflow
        args = (query, key_cache, value_cache, block_table, seq_len, real_query_len)
        if k_scale is not None:
            args = (*args, k_scale, v_scale)
        return _cond(~finite, self._recompute, _keep_last, (*args, out))

    def _recompute(
        self, query, key_cache, value_cache, block_table, seq_len, real_query_len, *rest
    ):
        """:meth:`PagedAttention.forward` with its padded rows zeroed, in a tensor of
        ``out``'s sizes (``torch.cond`` traces its branches with symbolic sizes and
        wants both outputs alike)."""
        *scales, out = rest  # (k_scale, v_scale) for an fp8 pool
        res = PagedAttention.forward(
            self, query, key_cache, value_cache, block_table, seq_len, real_query_len, *scales
        )
        real = torch.arange(res.shape[0], device=res.device) < real_query_len
        res = torch.where(real[:, None, None], res, 0)
        return _shaped_like(out, res)


#: Fewest query rows per chunk of a full bucket in the CPU prefill's causal part
#: (:meth:`RealKVPagedAttention.real_blocks`): ATen's CPU flash kernel takes
#: 64-row query tiles from 192 rows on and 32-row tiles below. Measured at
#: granite geometry, one thread: docs/benchmarks/cpu-kernels.md ("Kernel speed").
_PREFILL_CHUNK_ROWS = 192

#: Query rows of one flex head are kept below this: torch 2.13's CPU flex template
#: packs the whole K/V (the entire pool here) for bfloat16/float16 once a head has
#: 64 or more query rows (``need_pack`` in ``cpp_flex_attention_template.py``).
_FLEX_MAX_ROWS = 63


class RealKVBatchedDecode(BatchedDecode):
    """:class:`BatchedDecode` that reads only real KV when compiled for the CPU.

    Same inputs, outputs, launch parameters and semantics as
    :class:`BatchedDecode`. Traced on the CPU by ``torch.export`` or
    ``torch.compile`` (``torch.compiler.is_compiling()``), it is one
    ``torch.nn.attention.flex_attention`` call over the whole pool: K and V are
    the pool viewed as ``[1, num_kv_heads, num_pool_blocks * block_size,
    head_dim]`` (no copy), and each sequence is one batch entry whose
    ``num_heads / num_kv_heads`` query heads of a KV head form the query rows of
    that head (every query head of a group sees the same positions, so each KV
    block is read once per group; groups of 64 or more heads are split into flex
    heads of fewer rows, which read the block once each).

    Block lists: sequence ``s`` lists ``n = min(ceil(seq_len / block_size),
    num_blocks)`` blocks as full blocks: the first ``n`` entries of
    ``block_tables[s]`` itself, in order, repeats included (the template visits
    every entry, so a block listed twice is attended twice, as in vLLM's
    reference). A padded row (``seq_len == 0``) lists none and returns zeros. The
    positions at and past ``seq_len`` in the last block are removed by a
    ``score_mod``, not by a partial block: the CPU template applies a partial
    block's ``mask_mod`` to every entry with that block id, so a last block that
    also appears earlier in the row would be masked there too. The
    ``score_mod`` adds, to the scores of the last block's pool id ``X`` at
    offsets ``>= lim`` (``lim = seq_len - (n - 1) * block_size``, the real tokens
    of the last block), ``log(k / (k + 1))``, where ``k`` is how often ``X``
    appears among the row's first ``n - 1`` entries: each of the ``k + 1``
    entries of ``X`` then weighs those offsets ``k / (k + 1)``, ``k`` in all,
    and the offsets below ``lim`` ``k + 1`` times; with ``k == 0`` the bias is
    ``-inf`` (a plain mask). Rows whose last block is whole get no bias
    (``lim == block_size``).

    Compiled, the kernel reads no block past ``seq_len`` (the last block is read
    whole and its tail masked: at most ``block_size - 1`` positions per
    sequence) and copies nothing of the pool; its graph allocates nothing
    pool-sized except an uninitialized ``[num_seqs, 1, 1, num_pool_blocks]``
    int32 placeholder that is never written or read (see below). The tail's
    weight is 0, but 0 times a NaN or inf held there is NaN: a result that is
    not finite everywhere is recomputed (``torch.cond``) by the plain kernel over
    the bucket, which zeroes every slot at or past ``seq_len`` first (a NaN
    inside the real KV stays NaN, as in the reference). The template returns
    zeros, not NaN, for a row whose scores are NaN or all ``-inf``, so the
    ``score_mod`` makes every non-finite score ``+inf`` (before the tail's
    bias), which makes the row NaN and so recomputed.

    An fp8 pool (``k_scale`` given) takes the plain kernel compiled as well:
    ``flex_attention`` wants query, keys and values of one dtype, and an fp8
    pool converted to the query's dtype would be a copy of the whole pool.

    The launch parameters (``num_kv_splits``, ``blocks_per_chunk``) shape only
    the plain path; the compiled flex kernel parallelizes over
    sequences and KV heads itself. Run eagerly (``verify``'s oracle, tests) or on
    another device it is the plain :class:`BatchedDecode`: eager
    ``flex_attention`` computes every score of the pool and ignores the block
    mask's sparsity.

    Workarounds flex needs under ``torch.export`` + AOTInductor (torch 2.13):

    * the query is a computed tensor (not a view of an input);
    * the template checks ``kv_len <= width * block_size`` on the partial-block
      index (``flex_cpu.lower_cpu``), so with ``kv_len`` the pool that index is
      ``num_pool_blocks`` wide for any pool without a guard: it is
      ``torch.empty`` (allocated, never written, never read: every row lists
      zero partial blocks), not a ``cat`` of zeros, which cost time in
      proportion to the pool;
    * ``score_mod`` may capture only graph inputs or tensors that are already
      buffers when flex is lowered (the CPU lowering records captured tensors
      before realizing them, and a still-pointwise capture fails to render), and
      only 1-D ones indexed by a tensor expression (an integer index into a
      captured tensor fails under functionalization): the per-row values are one
      int64 tensor ``[3 * num_seqs]`` (first masked position, end of the last
      block, the bias's float32 bits) made a buffer by a ``cumsum`` of its
      differences, exact in integers, which Inductor runs as an ATen call on the
      CPU (it has no scan codegen there).
    """

    def forward(
        self, query, key_cache, value_cache, block_tables, seq_lens, k_scale=None, v_scale=None
    ):
        if query.device.type != "cpu" or not torch.compiler.is_compiling() or k_scale is not None:
            return super().forward(
                query, key_cache, value_cache, block_tables, seq_lens, k_scale, v_scale
            )
        return self._flex(query, key_cache, value_cache, block_tables, seq_lens)

    def _flex(self, query, key_cache, value_cache, block_tables, seq_lens):
        from torch.nn.attention.flex_attention import BlockMask, flex_attention

        s, nb = block_tables.shape
        p, bs = key_cache.shape[0], key_cache.shape[1]
        kvh, g, d = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim
        split = next(m for m in range(1, g + 1) if g % m == 0 and g // m <= _FLEX_MAX_ROWS)
        rows = g // split  # query rows of one flex head; kvh * split flex heads
        q = query.reshape(s, kvh * split, rows, d) * 1  # computed, not a view of the input
        k = key_cache.view(1, p * bs, kvh, d).transpose(1, 2)
        v = value_cache.view(1, p * bs, kvh, d).transpose(1, 2)
        n = ((seq_lens + (bs - 1)) // bs).clamp(0, nb)  # blocks read per row, [s] int32
        last_col = (n - 1).clamp(min=0)
        last = torch.gather(block_tables, 1, last_col.long()[:, None])[:, 0].long()  # [s]
        lim = seq_lens - (n - 1) * bs  # real tokens of the last block; bs: no tail
        cols = torch.arange(nb, dtype=torch.int32, device=query.device)
        earlier = (block_tables == last[:, None]) & (cols[None, :] < last_col[:, None])
        reps = earlier.sum(1).to(torch.float32)  # k: the last block among the others
        bias = torch.log(reps / (reps + 1))  # -inf when k == 0
        vals = torch.cat([last * bs + lim, (last + 1) * bs, bias.view(torch.int32).to(torch.int64)])
        side = (vals - torch.cat([vals.new_zeros(1), vals[:-1]])).cumsum(0)  # == vals

        def score_mod(score, b, h, q_idx, kv_idx):
            # The CPU template returns 0 for a row whose scores are NaN or all -inf,
            # where the reference is NaN: a non-finite score (a NaN or inf key) is
            # made +inf, which makes the row NaN, so that the plain kernel
            # recomputes it (the reference's result).
            score = torch.where(score.isfinite(), score, float("inf"))
            tail = (kv_idx >= side[b]) & (kv_idx < side[b + s])
            return torch.where(
                tail, score + side[b + 2 * s].to(torch.int32).view(torch.float32), score
            )

        mask = BlockMask.from_kv_blocks(
            torch.zeros((s, 1, 1), dtype=torch.int32, device=query.device),
            torch.empty((s, 1, 1, p), dtype=torch.int32, device=query.device),
            n[:, None, None],
            block_tables[:, None, None, :],
            BLOCK_SIZE=(128, bs),
            seq_lengths=(rows, p * bs),
            compute_q_blocks=False,
        )
        out = flex_attention(
            q, k, v, score_mod=score_mod, block_mask=mask, scale=self.scale, enable_gqa=split > 1
        ).reshape(s, kvh * g, d)
        # The template weighs the masked tail of a last block by 0, and 0 * NaN (or an
        # inf there) is NaN although vLLM's reference never reads those slots: a
        # non-finite result is recomputed by the plain kernel, which zeroes them first.
        args = (query, key_cache, value_cache, block_tables, seq_lens, out)
        out = _cond(~out.isfinite().all(), self._recompute, _keep_last, args)
        return out.to(query.dtype)

    def _recompute(self, query, key_cache, value_cache, block_tables, seq_lens, out):
        """:meth:`BatchedDecode._single_pass` (the whole bucket, unread slots zeroed)
        in a tensor of ``out``'s sizes (``torch.cond`` traces its branches with
        symbolic sizes and wants both outputs alike)."""
        res = self._single_pass(query, key_cache, value_cache, block_tables, seq_lens)
        return _shaped_like(out, res)


def _cond(pred, true_fn, false_fn, args):
    """``torch.cond``'s operator under ``torch.export`` (warmup's compile); the
    plain ``if`` otherwise: eagerly (``torch.cond`` outside a trace compiles its
    branches) and under ``torch.compile``, where the ``if`` is a graph break
    (Dynamo's ``torch.cond`` refuses these branches as aliasing their operands).

    The operator (:func:`kernel_cache.torch_compat.cond_operator`) traces the
    branches with export's own tracer; ``torch.cond`` would first compile the
    call with Dynamo: 2.5-5.7 s of CPU in the call against 0.2-0.7 s, 1.0-3.8 s
    less for a tiny variant's whole compile, the same kernels
    (docs/benchmarks/compile.md). The operator traces a branch as a function of
    its positional parameters (a bound method's ``self`` would count as one)
    that returns a tuple: hence the wrappers. Every tensor a branch reads must be
    one of ``args``: the operator does not lift a tensor a branch captures, as
    Dynamo did."""
    if torch.compiler.is_exporting():
        (out,) = torch_compat.cond_operator()(
            pred, lambda *a: (true_fn(*a),), lambda *a: (false_fn(*a),), tuple(args)
        )
        return out
    return true_fn(*args) if bool(pred) else false_fn(*args)


def _shaped_like(out, res):
    """``res`` in a new tensor made like ``out`` (``empty_like``): ``torch.cond``
    traces its branches with symbolic sizes and wants both outputs alike, strides
    included, also for a dimension of size 1."""
    return torch.empty_like(out).copy_(res.reshape(-1, out.shape[1], out.shape[2]))


def _keep_last(*args):
    """``torch.cond``'s other branch: a copy of the last operand, made as the
    recomputing branches make theirs (:func:`_shaped_like`)."""
    return torch.empty_like(args[-1]).copy_(args[-1])


def build_module(
    kernel: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    impl: str | None = None,
    **launch,
) -> nn.Module:
    """The module of slot ``kernel`` ("paged_attention" or "batched_decode") from
    the factory ``impl`` names (an import path, see :mod:`kernel_cache.kernels.slots`;
    None: the slot's default, :class:`RealKVPagedAttention` or
    :class:`RealKVBatchedDecode`: the real-KV kernels when compiled for the
    CPU, the plain kernels eagerly and off the CPU).

    ``launch``: the variant's launch parameters as keywords (for ``batched_decode``
    ``blocks_per_chunk`` and ``num_kv_splits``; ``paged_attention`` takes none),
    usually the resolved config of :func:`kernel_cache.plan.launch.resolve_plan`.

    Raises:
        ConfigError: an unknown slot, or launch parameters a built-in refuses.
        CompileError: ``impl`` does not import or does not return a module.
    """
    from kernel_cache.kernels.slots import build

    return build(kernel, impl, num_heads, num_kv_heads, head_dim, **launch)
