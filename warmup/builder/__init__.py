"""The build stage: compile every missing variant of a plan and publish it.

:mod:`~warmup.builder.planner` (``warmup()``, the entry point), :mod:`~warmup.builder.worker`
(one variant's steps in a worker process), :mod:`~warmup.builder.pool` (the worker pool
and signals), :mod:`~warmup.builder.report` (the report and progress),
:mod:`~warmup.builder.compiler`, :mod:`~warmup.builder.loadcheck`, :mod:`~warmup.builder.shard`.
Nothing is imported here: ``import warmup.builder.compiler`` runs this file first
(its bytes are part of every key's ``sources``).
"""
