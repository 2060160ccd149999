"""The build stage: compile every missing variant of a plan and publish it.

:mod:`~warmup.build.planner` (``warmup()``, the entry point), :mod:`~warmup.build.worker`
(one variant's steps in a worker process), :mod:`~warmup.build.pool` (the worker pool
and signals), :mod:`~warmup.build.report` (the report and progress),
:mod:`~warmup.build.compiler`, :mod:`~warmup.build.loadcheck`, :mod:`~warmup.build.shard`.
Nothing is imported here: ``import warmup.build.compiler`` runs this file first
(its bytes are part of every key's ``sources``).
"""
