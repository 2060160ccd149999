"""``kernel-cache tune``: time launch-config candidates per variant and write a table.

For each chosen variant (``batched_decode`` on any device, ``paged_attention``
on CUDA, where it is the Triton prefill kernel):

1. Candidates (:func:`candidates`), the defaults first:
   ``batched_decode``: every ``num_kv_splits`` in ``--num-kv-splits`` (at most
   ``num_blocks``) times, on the CPU, every ``chunks_per_split`` in
   ``--chunks-per-split`` that divides the split (``blocks_per_chunk =
   ceil(num_blocks / num_kv_splits) / chunks_per_split``); ``paged_attention``:
   every tile of ``--block-m`` x ``--block-n`` x ``--num-warps`` x
   ``--num-stages`` that the kernel can run (``block_m`` from the GQA group up to
   the rows the query bucket fills, the shared memory within the H200's).
2. Every candidate is compiled through the normal warmup path into the artifact
   cache, under the key that holds its launch config (so a resumed tune, or a
   later ``warmup`` with the resulting table, compiles nothing twice). All
   compiles finish before any timing starts.
3. Correctness: each candidate's output on random inputs of the variant's
   shapes is compared with :func:`kernel_cache.kernels.reference.reference_decode`
   or, for prefill, :func:`~kernel_cache.kernels.reference.reference_attention`
   on the real query rows (tolerance :data:`warmup.check.verify.TOLERANCE`); a
   mismatch is never kept.
4. Timing, warm: each loaded artifact runs 3 times first; then ``--rounds``
   rounds, each timing every candidate once in a shuffled order, one sample
   being the mean of ``inner`` back-to-back calls (``inner`` chosen so that a
   sample of the defaults lasts about ``--target-ms``). Per candidate: median,
   min and max milliseconds per call, and the paired ratios
   ``default / candidate`` of each round (both measured within the same round,
   so a load change on a shared machine hits both).
5. The rule (:data:`RULE`): a candidate beats the default beyond noise when the
   median of its paired ratios is at least ``1 + --min-gain`` and their lower
   quartile is above 1 (it was faster in at least three rounds out of four).
   Of the candidates that match the reference and beat the default, the one
   with the lowest median time is kept; else the defaults are kept.

Each variant's measurement is stored as soon as it is done, as a JSON file
beside the artifacts (``<cache-dir>/tune/<key>.json``, :func:`save_result`),
under a key made of the default
artifact's key (kernel source, variant, geometry, dtype, device, versions), the
candidate list and the timing settings; an interrupted tune run again with the
same arguments reuses every finished variant and compiles nothing it has.

The output is a table in the bundled format (:mod:`kernel_cache.plan.tables`), one
entry per tuned variant (the defaults written out where they won; a prefill
entry names its ``query_len``), with the measurements under ``measured``.

The code: :mod:`~warmup.tune.candidates` (settings, candidates, the rule, the
result key), :mod:`~warmup.tune.measure` (steps 3 to 5), :mod:`~warmup.tune.run`
(:func:`tune`, the stored results), :mod:`~warmup.tune.table` (the table and
its write), :mod:`~warmup.tune.cli` (the subcommand).
"""

from warmup.tune.candidates import (
    RULE,
    TIMING_FIELDS,
    TUNE_FORMAT,
    TuneSettings,
    candidates,
    prefill_candidates,
    result_key,
)
from warmup.tune.cli import PREFILL_TILE_OPTIONS, add_tune_command, cmd_tune
from warmup.tune.measure import measure_variant
from warmup.tune.run import load_result, save_result, tune
from warmup.tune.table import check_out, format_table, make_table, table_entry, write_table

__all__ = [
    "PREFILL_TILE_OPTIONS",
    "RULE",
    "TIMING_FIELDS",
    "TUNE_FORMAT",
    "TuneSettings",
    "add_tune_command",
    "candidates",
    "check_out",
    "cmd_tune",
    "format_table",
    "load_result",
    "make_table",
    "measure_variant",
    "prefill_candidates",
    "result_key",
    "save_result",
    "table_entry",
    "tune",
    "write_table",
]
