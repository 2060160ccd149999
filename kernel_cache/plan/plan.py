"""The Plan: one immutable object with every variant of an engine config, its
resolved launch config and its cache key, computed once.

Warmup, verify, engine start, export, explain, tune and housekeeping all read
a :class:`Plan` instead of walking ``variant -> launch config -> key`` each on
its own, so they agree on every key by construction::

    plan = Plan.build(config)          # or make_plan(config, env)
    for item in plan:                  # bucket order
        item.variant, item.launch, item.source, item.key
    plan.key(variant); plan.find("batched_decode:1:2:4"); len(plan)

A launch config is resolved as :func:`kernel_cache.plan.launch.resolve_plan`
does (``KERNEL_CACHE_TUNING`` > bundled table > defaults) and each key is built
once (:func:`kernel_cache.plan.keys.build_key`). Building a plan probes the
environment (:func:`kernel_cache.plan.keys.environment`) unless a caller that
has it passes it (or the ``cxx`` value, which engine start reads from records);
nothing else is loaded or compiled.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kernel_cache.config.engine import EngineConfig
from kernel_cache.config.recipe import device_arch
from kernel_cache.plan.buckets import Bucketer, KernelVariant
from kernel_cache.plan.keys import CacheKey, build_key, environment, recipe_options
from kernel_cache.plan.launch import (
    Resolved,
    Resolver,
    current_resolver,
    describe_plan,
    resolve_plan,
)

#: The ``source`` of an item whose launch config a caller gave
#: (:meth:`Plan.with_launch`: ``kernel-cache tune``'s candidates).
GIVEN = "given"


@dataclass(frozen=True)
class PlanItem:
    """One variant of a plan: its launch config, where that came from
    (``env``, ``bundled``, ``default``; :data:`GIVEN` for a caller's config)
    and its cache key. Immutable and hashable; :attr:`launch` returns a new dict."""

    variant: KernelVariant
    launch_items: tuple[tuple[str, int], ...]
    source: str
    key: CacheKey

    @property
    def launch(self) -> dict[str, int]:
        """The resolved launch config, e.g. ``{"blocks_per_chunk": 2, "num_kv_splits": 1}``
        (a fresh dict: changing it changes nothing here)."""
        return dict(self.launch_items)

    @property
    def resolved(self) -> Resolved:
        return Resolved(self.launch, self.source)

    @property
    def hexdigest(self) -> str:
        return self.key.hexdigest


def _item(config, variant, resolved: Resolved, env: dict, options: dict) -> PlanItem:
    cfg = resolved.config
    key = build_key(config, variant, env, compile_options=options, launch=cfg)
    return PlanItem(variant, tuple(sorted(cfg.items())), resolved.source, key)


@dataclass(frozen=True)
class Plan:
    """Every variant of ``config``'s plan in bucket order, each a :class:`PlanItem`.

    Equal configs built in one environment give equal plans (and equal hashes);
    the bucketer is derived from the config and does not take part in either.
    Build with :meth:`build` (or :func:`make_plan`).
    """

    config: EngineConfig
    env_items: tuple[tuple[str, str], ...]
    items: tuple[PlanItem, ...]
    bucketer: Bucketer = field(compare=False, hash=False, repr=False)
    _by_variant: Mapping[KernelVariant, PlanItem] = field(compare=False, hash=False, repr=False)
    _by_name: Mapping[str, PlanItem] = field(compare=False, hash=False, repr=False)

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        env: Mapping[str, str] | None = None,
        *,
        cxx: str | None = None,
        log_launch: bool = True,
        logger: logging.Logger | None = None,
    ) -> Plan:
        """Resolve and key every variant of ``config`` once, in three stages,
        each module entered once: the buckets (:mod:`.buckets`), the launch
        configs (:mod:`.launch`), the keys (:mod:`.keys`).

        Args:
            env: the environment components, if the caller has them
                (default: :func:`~kernel_cache.plan.keys.environment` of ``config``).
            cxx: the build-only ``cxx`` component for that default (None: ask
                the compiler; engine start passes the recorded one).
            log_launch: log the resolved launch table once at INFO (as
                :func:`~kernel_cache.plan.launch.resolve_plan` does).

        Raises:
            ConfigError: an invalid ``KERNEL_CACHE_TUNING`` or bundled table, or
                a bucket override the bucketer refuses.
        """
        bucketer = Bucketer(config)
        arch = (
            env["device_arch"] if env is not None else device_arch(config.device, config.cpu_target)
        )
        if log_launch:
            resolved = resolve_plan(config, bucketer.variants, arch, logger=logger)
        else:
            resolver = Resolver()
            resolved = {v: resolver.resolve(config, v, arch) for v in bucketer.variants}
        env = dict(environment(config, cxx=cxx) if env is None else env)
        options = recipe_options(config)
        items = tuple(_item(config, v, resolved[v], env, options) for v in bucketer.variants)
        return cls(
            config,
            tuple(env.items()),
            items,
            bucketer,
            MappingProxyType({i.variant: i for i in items}),
            MappingProxyType({str(i.variant): i for i in items}),
        )

    # -- accessors ----------------------------------------------------------
    def __iter__(self) -> Iterator[PlanItem]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __contains__(self, variant: object) -> bool:
        return variant in self._by_variant

    @property
    def env(self) -> dict[str, str]:
        """The environment components of every key (a fresh dict)."""
        return dict(self.env_items)

    @property
    def variants(self) -> tuple[KernelVariant, ...]:
        return tuple(i.variant for i in self.items)

    def item(self, variant: KernelVariant) -> PlanItem:
        """Raises KeyError: ``variant`` is not in the plan."""
        return self._by_variant[variant]

    def key(self, variant: KernelVariant) -> CacheKey:
        """The key of a variant of the plan. Raises KeyError: not in the plan."""
        return self._by_variant[variant].key

    def find(self, variant: str | KernelVariant) -> PlanItem | None:
        """The item of ``variant`` (or its ``KERNEL:QUERY:BLOCKS:SEQS`` text); None
        if the plan has no such variant."""
        if isinstance(variant, KernelVariant):
            return self._by_variant.get(variant)
        return self._by_name.get(variant)

    def resolved(self) -> dict[KernelVariant, Resolved]:
        """``{variant: Resolved}`` in plan order (what ``resolve_plan`` returns)."""
        return {i.variant: i.resolved for i in self.items}

    def describe_launch(self, items: Iterable[PlanItem] | None = None) -> dict:
        """JSON-ready: the variants a launch table sets (of ``items``, default all):
        ``{variant: {"config", "source"}}``."""
        chosen = self.items if items is None else items
        return describe_plan({i.variant: i.resolved for i in chosen})

    def fingerprint(self) -> str:
        return self.bucketer.fingerprint()

    # -- items outside the plan's own resolution ---------------------------
    def items_for(self, variants: Iterable[KernelVariant]) -> list[PlanItem]:
        """Items of ``variants`` in the order given: the plan's own, and for a
        variant the plan does not hold, one resolved and keyed the same way (the
        process-wide resolver, without logging)."""
        out = []
        for v in variants:
            own = self._by_variant.get(v)
            if own is None:
                r = current_resolver().resolve(self.config, v, self.env["device_arch"])
                own = _item(self.config, v, r, self.env, recipe_options(self.config))
            out.append(own)
        return out

    def with_launch(self, variant: KernelVariant, launch: Mapping[str, int]) -> PlanItem:
        """An item of ``variant`` under a launch config the caller gives (a tuning
        candidate), keyed as the plan's own; its source is :data:`GIVEN`."""
        resolved = Resolved(dict(launch), GIVEN)
        return _item(self.config, variant, resolved, self.env, recipe_options(self.config))


def make_plan(
    config: EngineConfig, env: Mapping[str, str] | None = None, *, log_launch: bool = True
) -> Plan:
    """:meth:`Plan.build`."""
    return Plan.build(config, env, log_launch=log_launch)
