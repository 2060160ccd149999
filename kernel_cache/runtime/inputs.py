"""Random inputs of a variant's exact bucket shapes (for export and verify)."""

from __future__ import annotations

from kernel_cache.config.engine import EngineConfig
from kernel_cache.plan.buckets import PAGED_ATTENTION, KernelVariant

#: The per-tensor scales of an fp8 plan's example pool (standard-normal K and V
#: stored as ``x / scale``: about +-250 of fp8's +-448 for |x| <= 5). Two values,
#: so that a kernel that swaps the scales is wrong.
K_SCALE, V_SCALE = 0.02, 0.03


def pool_blocks_for(variant: KernelVariant) -> int:
    """An example KV pool size (blocks) for ``variant``: larger than any of its
    static dimensions and distinct from them, so ``torch.export`` keeps
    ``num_pool_blocks`` dynamic instead of tying it to another dimension."""
    dims = {variant.query_len, variant.num_blocks, variant.num_seqs}
    p = variant.num_blocks * variant.num_seqs + 3
    while p in dims:
        p += 1
    return p


def make_inputs(
    config: EngineConfig,
    variant: KernelVariant,
    *,
    seed: int = 0,
    num_pool_blocks: int | None = None,
    device: str | None = None,
):
    """Positional inputs for the variant's kernel, with valid random lengths.

    Lengths: decode has one sequence on the bucket edge, and with 3 or more rows
    one of length 1 and one padded row (``seq_len`` 0); prefill has one padded
    query row when the query bucket holds more than one token.

    Returns a tuple matching :class:`~kernel_cache.kernels.plain.PagedAttention` or
    :class:`~kernel_cache.kernels.plain.BatchedDecode` ``forward`` (see their docstrings
    for shapes). Each block table (each row of a decode batch's) indexes distinct
    random pool blocks, as an engine's does (the kernels are also right for
    tables that repeat a block: ``tests/kernels/test_decode_oracle.py``).

    Raises:
        ValueError: ``num_pool_blocks`` smaller than the variant's ``num_blocks``.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    device = device or config.device
    dt = config.torch_dtype()
    h, kvh, d, bs = config.num_heads, config.num_kv_heads, config.head_dim, config.block_size
    p = num_pool_blocks or pool_blocks_for(variant)
    nb = variant.num_blocks
    if p < nb:
        raise ValueError(f"num_pool_blocks={p} is below the variant's num_blocks={nb}")
    kc = torch.randn(p, bs, kvh, d, generator=g)
    vc = torch.randn(p, bs, kvh, d, generator=g)
    scales = ()
    if config.kv_fp8:  # stored = fp8(x / scale), read = float(stored) * scale (vLLM)
        scales = (torch.tensor([K_SCALE]), torch.tensor([V_SCALE]))
        kc = (kc / K_SCALE).to(torch.float8_e4m3fn)
        vc = (vc / V_SCALE).to(torch.float8_e4m3fn)
    else:
        kc, vc = kc.to(dt), vc.to(dt)
    cap = nb * bs
    if variant.kernel == PAGED_ATTENTION:
        q = variant.query_len
        real_q = min(q, cap)
        if real_q == q > 1:
            real_q -= 1  # one padded query row
        seq_len = int(torch.randint(real_q, cap + 1, (1,), generator=g))
        bt = torch.randperm(p, generator=g)[:nb].to(torch.int32)
        query = torch.randn(q, h, d, generator=g).to(dt)
        args = (
            query,
            kc,
            vc,
            bt,
            torch.tensor([seq_len], dtype=torch.int32),
            torch.tensor([real_q], dtype=torch.int32),
        )
    else:
        s = variant.num_seqs
        seq_lens = torch.randint(1, cap + 1, (s,), generator=g, dtype=torch.int32)
        seq_lens[0] = cap  # one sequence exactly on the bucket edge
        if s >= 3:
            seq_lens[1] = 1  # one token
            seq_lens[-1] = 0  # a padded row
        bt = torch.stack([torch.randperm(p, generator=g)[:nb] for _ in range(s)]).to(torch.int32)
        query = torch.randn(s, h, d, generator=g).to(dt)
        args = (query, kc, vc, bt, seq_lens)
    return tuple(a.to(device) for a in (*args, *scales))


def slot_dims(spec, variant: KernelVariant) -> dict:
    """``{dimension entry: size}`` of declared slot ``spec`` at ``variant``: each
    bucket axis its bucket (``query_tokens`` -> ``query_len``, ``kv_blocks`` ->
    ``num_blocks``, ``decode_seqs`` -> ``num_seqs``)."""
    return {
        "query_tokens": variant.query_len,
        "kv_blocks": variant.num_blocks,
        "decode_seqs": variant.num_seqs,
    }


def make_slot_inputs(spec, variant: KernelVariant, *, seed: int = 0, device: str = "cpu"):
    """Random inputs of declared slot ``spec`` at ``variant``'s buckets (for
    export): every bucket dimension at its bucket, fixed ones as declared, each
    dynamic size (one per ``dynamic:NAME``) larger than every static dimension
    and distinct from them and from the other dynamic sizes, so that
    ``torch.export`` keeps it dynamic. Floats are standard normal, integers in
    ``[0, 4)``, bools random.

    Returns: ``(inputs, {dynamic name: example size})``.
    """
    import torch

    from kernel_cache.config.slot_spec import torch_dtype

    g = torch.Generator().manual_seed(seed)
    axes = slot_dims(spec, variant)
    static = {d if isinstance(d, int) else axes.get(d, 0) for i in spec.inputs for d in i.shape}
    dyn: dict[str, int] = {}
    out = []
    for inp in spec.inputs:
        names = iter(inp.dynamic_names())
        shape = []
        for d in inp.shape:
            if isinstance(d, int):
                shape.append(d)
            elif d in axes:
                shape.append(axes[d])
            else:
                name = next(names)
                if name not in dyn:
                    size = max(static | set(dyn.values()) | {1}) + 3
                    dyn[name] = size
                shape.append(dyn[name])
        dtype = torch_dtype(inp.dtype)
        if dtype.is_floating_point:
            t = torch.randn(shape, generator=g).to(dtype)
        elif dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            t = torch.randint(0, 4, shape, generator=g, dtype=dtype)
        out.append(t.to(device))
    return tuple(out), dyn
