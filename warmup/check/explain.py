"""Explain a miss: which stored entries are nearest, and which key components differ.

For each variant (given, or every variant of the plan that misses) the key is
built in this process's environment and looked up as engine start does
(:class:`kernel_cache.store.lookup.Lookup`). For a miss, every stored entry of every
tier is compared with it component by component
(:data:`kernel_cache.plan.keys.COMPONENTS`), and the nearest are listed: the same
variant first, then the fewest differing runtime components, then the same kernel,
then the fewest differing components, newest first. Each difference reads
``name: <this process> != <stored>``, for example ``torch: 2.13.0 != 2.14.1``.
A miss because files whose code ran when the stored entry was traced changed
since (:mod:`kernel_cache.plan.traced`) names them under ``traced``: the entry's
components all match, so the nearest entries show no difference.
"""

from __future__ import annotations

import datetime as _dt

from kernel_cache.errors import ConfigError, ShapeError, shown
from kernel_cache.plan.buckets import KERNELS, PAGED_ATTENTION, Bucketer, KernelVariant
from kernel_cache.plan.keys import BUILD_ONLY, COMPONENTS, source_changes
from kernel_cache.plan.plan import Plan
from kernel_cache.store.disk_tier import Tier
from kernel_cache.store.lookup import Lookup

#: Stored entries listed per missing variant.
NEAREST = 3


def short(value) -> str:
    """A component value for a one-line diff (long digests cut to 16 characters)."""
    text = str(value)
    return text if len(text) <= 48 else text[:16] + "..."


def differences(here: dict, stored: dict) -> list[dict]:
    """Component-wise differences: ``[{"component", "here", "stored",
    "build_only"}]`` in :data:`COMPONENTS` order."""
    out = []
    for name in COMPONENTS:
        a, b = here.get(name), stored.get(name)
        if a != b:
            out.append(
                {"component": name, "here": a, "stored": b, "build_only": name in BUILD_ONLY}
            )
    return out


def _mapping(text) -> dict | None:
    """A component value that is a JSON object, as a dict; else None."""
    import json

    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def field_changes(here: str, stored: str) -> str | None:
    """For a component that is a JSON object (``compile_options``, ``launch_config``,
    ``geometry``), each field that differs with both values, never cut:
    ``"aot_inductor.debug_compile: false != true; cpp.march new (x86-64-v3)"``;
    None if either side is not an object."""
    import json

    a, b = _mapping(here), _mapping(stored)
    if a is None or b is None:
        return None

    def js(v) -> str:
        return json.dumps(v, sort_keys=True)

    parts = [f"{f}: {js(a[f])} != {js(b[f])}" for f in sorted(set(a) & set(b)) if a[f] != b[f]]
    parts += [f"{f} new ({js(a[f])})" for f in sorted(set(a) - set(b))]
    parts += [f"{f} gone (was {js(b[f])})" for f in sorted(set(b) - set(a))]
    return "; ".join(parts) or None


def format_difference(d: dict) -> str:
    """``"torch: 2.13.0 != 2.14.1"``; for ``sources``, the files that differ
    (``"sources: warmup/builder/compiler.py changed"``); for a component that is a
    JSON object, the fields that differ with both values."""
    tag = " (build-only: accepted at load)" if d["build_only"] else ""
    diff = (source_changes if d["component"] == "sources" else field_changes)(
        d["here"], d["stored"]
    )
    if diff:
        return f"{d['component']}: {diff}{tag}"
    return f"{d['component']}: {short(d['here'])} != {short(d['stored'])}{tag}"


def explain(
    config, tiers: list[Tier], variants: list[KernelVariant] | None = None, *, nearest=NEAREST
) -> dict:
    """The JSON-ready explanation.

    Args:
        config: the engine configuration; its plan is checked when ``variants`` is None.
        tiers: where to look (engine start's order).
        variants: explain these (hits included); default: the plan's misses.
        nearest: stored entries listed per miss.

    Returns: ``{"variants" (checked), "hits", "misses", "not_in_plan" (given
    variants the plan does not hold), "stored" (entries compared), "tiers":
    [locations], "unlisted": {location: why} (tiers whose entries were not
    compared: their listing went past ``KERNEL_CACHE_REMOTE_LIST_MAX``),
    "results": [{"variant", "key", "status" ("hit" | "miss" | "corrupt" |
    "not_in_plan"), "where", "accepted" (hit: build-only components
    taken from the record), "reason" (corrupt, not_in_plan), "traced" (miss: the
    traced files that changed since the plan key's entry was built, one line
    each), "nearest": [{"variant", "key", "where", "created", "differences":
    [...], "lines": ["torch: a != b"]}]}]}``
    """
    plan = Plan.build(config, log_launch=False)
    unlisted: dict[str, str] = {}
    known = (*KERNELS, *(spec.name for spec in config.slots))
    for v in variants or ():
        if v.kernel not in known:
            raise ConfigError(
                f"--variant {v}: no kernel {v.kernel!r} in this plan; its kernels: "
                f"{', '.join(known)} (a declared slot needs its --slot)"
            )
    items = list(plan) if variants is None else plan.items_for(variants)
    lookup = Lookup(tiers)
    stored = None  # read at the first miss only: a plan that hits sends no listing
    results, hits, outside = [], 0, 0
    for item in items:
        r = {"variant": str(item.variant), "key": item.key.hexdigest}
        if item.variant not in plan:
            # a hit or a miss means nothing here: warmup never builds it, dispatch never runs it
            outside += 1
            r.update(status="not_in_plan", reason=not_in_plan(plan.bucketer, item.variant))
            results.append(r)
            continue
        result = lookup.search(item.key)
        if result.failed is not None:  # a corrupt entry: noted, and counted as a miss
            e = result.failed.error
            r.update(status="corrupt", where=e.where, reason=e.reason)
        found = result.found
        if found is not None:
            hits += 1
            if variants is not None:
                accepted = {n: {"here": a, "stored": b} for n, (a, b) in found.accepted.items()}
                r.update(status="hit", where=found.tier.location, accepted=accepted)
                results.append(r)
            continue
        r.setdefault("status", "miss")
        r["traced"] = list(result.changes)
        if stored is None:
            stored, unlisted = _listed(tiers)
        r["nearest"] = nearest_entries(item.key.as_dict(), item.variant, stored, nearest)
        results.append(r)
    return {
        "variants": len(items),
        "hits": hits,
        "misses": len(items) - hits - outside,
        "not_in_plan": outside,
        "stored": len(stored or ()),
        "tiers": [t.location for t in tiers],
        "unlisted": unlisted,
        "results": results,
    }


def _listed(tiers: list[Tier]) -> tuple[list, dict[str, str]]:
    """``([(where, meta)], {where: why})``: every tier's entries, to rank the
    nearest from, and the tiers left out because their listing went past
    ``KERNEL_CACHE_REMOTE_LIST_MAX`` (the error's text), so that one shared
    store over the bound costs only its own part of the report."""
    from kernel_cache.store.remote_base import ListingLimitError

    stored, unlisted = [], {}
    for t in tiers:
        try:
            stored += [(t.location, m) for m in t.iter_meta()]
        except ListingLimitError as e:
            unlisted[t.location] = str(e)
    return stored, unlisted


def nearest_entries(here: dict, v: KernelVariant, stored: list, nearest: int) -> list[dict]:
    """The ``nearest`` stored entries (``stored``: ``[(where, meta)]``) to a key
    whose components are ``here``, ranked as the module docstring says:
    ``[{"variant", "key", "where", "created", "differences", "lines"}]``."""
    ranked = []
    for where, meta in stored:
        comps = meta.get("components")
        if not isinstance(comps, dict):
            continue
        diff = differences(here, comps)
        rank = (
            comps.get("variant") != here["variant"],
            sum(not d["build_only"] for d in diff),
            str(comps.get("variant")).split(":")[0] != v.kernel,
            len(diff),
            -float(meta.get("created") or 0),
        )
        ranked.append((rank, where, meta, diff))
    ranked.sort(key=lambda x: x[0])
    return [
        {
            "variant": meta.get("variant"),
            "key": meta.get("key"),
            "where": where,
            "created": meta.get("created"),
            "differences": diff,
            "lines": [format_difference(d) for d in diff],
        }
        for _, where, meta, diff in ranked[:nearest]
    ]


def _blocks(n: int, block_size: int) -> str:
    return f"{n} block{'s' if n != 1 else ''} of {block_size} tokens"


def _slot_not_in_plan(bucketer: Bucketer, spec, v: KernelVariant) -> str:
    """:func:`not_in_plan` for a declared slot's variant: which field is not a
    bucket of an axis the slot follows, or is not 0 for one it does not."""
    fields = {
        "query_tokens": ("query_len", v.query_len, bucketer.query_buckets),
        "kv_blocks": ("num_blocks", v.num_blocks, bucketer.num_blocks_buckets),
        "decode_seqs": ("num_seqs", v.num_seqs, bucketer.num_seqs_buckets),
    }
    why = []
    for axis, (name, value, buckets) in fields.items():
        if axis in spec.axes() and value not in buckets:
            listed = ", ".join(map(str, buckets))
            why.append(f"{name} {value} is not a {axis} bucket of this plan ({listed})")
        elif axis not in spec.axes() and value != 0:
            why.append(f"{v.kernel} follows no {axis} axis, so its {name} is 0")
    return (
        f"not in the plan: {'; '.join(why)}; warmup never builds it and engine start never "
        "loads it (the plan's variants: kernel-cache plan)"
    )


def not_in_plan(bucketer: Bucketer, v: KernelVariant) -> str:
    """Why ``v`` is not a variant of the plan, and what dispatch runs instead:
    ``"not in the plan: num_blocks 5 is not a KV bucket of this plan (1, 2, 3, 4,
    6, 8); ...; dispatch runs that shape as batched_decode:1:6:4 ..."``."""
    spec = bucketer.config.slot(v.kernel)
    if spec is not None:
        return _slot_not_in_plan(bucketer, spec, v)
    bs = bucketer.block_size
    prefill = v.kernel == PAGED_ATTENTION
    fixed = ("num_seqs", v.num_seqs) if prefill else ("query_len", v.query_len)
    why, then = [], None
    if fixed[1] != 1:
        why.append(f"{v.kernel} variants have {fixed[0]} 1")
    else:
        if prefill:
            first = ("query_len", v.query_len, bucketer.query_buckets, "a query bucket")
        else:
            first = ("num_seqs", v.num_seqs, bucketer.num_seqs_buckets, "a decode-batch bucket")
        for name, value, buckets, what in (
            first,
            ("num_blocks", v.num_blocks, bucketer.num_blocks_buckets, "a KV bucket"),
        ):
            if value not in buckets:
                listed = ", ".join(map(str, buckets)) or "none: decode runs sequence by sequence"
                why.append(f"{name} {value} is not {what} of this plan ({listed})")
        # a prefill chunk in query bucket Q has more tokens than the bucket below Q
        below = [q for q in bucketer.query_buckets if q < v.query_len]
        smallest = below[-1] + 1 if below and v.query_len in bucketer.query_buckets else v.query_len
        if prefill and smallest > v.num_blocks * bs:
            tokens = f"{smallest} to {v.query_len}" if smallest < v.query_len else f"{smallest}"
            why.append(
                f"no prefill chunk of {tokens} tokens fits in {_blocks(v.num_blocks, bs)}, "
                "so no call has that shape"
            )
        elif not prefill and not bucketer.num_seqs_buckets:
            then = "dispatch runs each sequence of a decode batch through paged_attention"
        elif why:
            try:
                if prefill:
                    q, s = bucketer.query_bucket(v.query_len), 1
                else:
                    q, s = 1, bucketer.num_seqs_bucket(v.num_seqs)
                nb = bucketer.blocks_bucket(v.num_blocks)
            except ShapeError as e:
                then = f"that shape is beyond the plan's limits: {e}"
            else:
                runs = KernelVariant(kernel=v.kernel, query_len=q, num_blocks=nb, num_seqs=s)
                then = f"dispatch runs that shape as {runs}"
    return (
        f"not in the plan: {'; '.join(why)}; warmup never builds it and engine start never "
        f"loads it" + (f"; {then}" if then else "") + " (the plan's variants: kernel-cache plan)"
    )


def _when(ts) -> str:
    if not ts:
        return "-"
    return _dt.datetime.fromtimestamp(float(ts)).strftime("%Y-%m-%d %H:%M")


def render(report: dict) -> str:
    """The text ``kernel-cache explain`` prints."""
    where = (
        f"{report['stored']} stored entries in {', '.join(report['tiers'])}"
        if report["tiers"]
        else "no cache or bundle found (--cache-dir / $KERNEL_CACHE_DIR, "
        "--bundle / $KERNEL_CACHE_BUNDLE)"
    )
    outside = report.get("not_in_plan", 0)
    unlisted = [
        f"nearest entries not searched in {shown(why)}"
        for why in report.get("unlisted", {}).values()
    ]
    lines = [
        f"explain: {report['variants']} variant(s) checked, {report['hits']} hit, "
        f"{report['misses']} miss"
        + (f", {outside} not in the plan" if outside else "")
        + f"; {where}",
        "differences read: component: this process != stored entry",
        *unlisted,
    ]
    for r in report["results"]:
        if r["status"] == "not_in_plan":
            lines.append(f"{r['variant']}  {r['reason']}")
            continue
        head = f"{r['variant']}  {r['status']}  key {r['key'][:16]}"
        if r["status"] == "hit":
            lines.append(f"{head}  in {r['where']}")
            for n, a in r["accepted"].items():
                lines.append(f"    {n}: {a['here']} != {a['stored']} (build-only: accepted)")
            continue
        if r["status"] == "corrupt":
            lines.append(f"{head}  in {r['where']}: {r['reason']}")
            continue
        lines.append(head)
        lines.extend(f"    traced: {line}" for line in r.get("traced", ()))
        if not r["nearest"]:
            lines.append("    no stored entries to compare with")
        for n in r["nearest"]:
            lines.append(
                f"  nearest: {n['variant']} key {str(n['key'])[:16]} in {n['where']} "
                f"(created {_when(n['created'])})"
            )
            lines.extend(f"    {line}" for line in n["lines"])
    # stored records' text (variants, component values, file names) is a writer's:
    # a newline or an escape in it must not start a line or recolour the terminal
    return "\n".join(shown(line, 100_000, quote=False) for line in lines)
