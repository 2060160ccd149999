"""Following the config from engine start through the plan enters each plan
module once, in the data flow's order: the buckets, the launch configs, the keys.

Counted by what ran: a profile function records every Python call that is
handed the config object, by module; a module's consecutive calls are one stay.
The config's own methods (``config/engine.py``) and the kernel slots' lookup
(``kernels/slots.py``, asked by the key of each variant) are not plan stages.
"""

import os
import sys

from kernel_cache import make_config
from kernel_cache.plan.plan import Plan

from ..conftest import ROOT, TINY_LIMITS

#: The plan's stages, in order.
STAGES = (
    "kernel_cache/plan/buckets.py",
    "kernel_cache/plan/launch.py",
    "kernel_cache/plan/keys.py",
)


def _stays(config, build) -> list[str]:
    calls = []

    def profile(frame, event, arg):
        if event == "call" and any(v is config for v in frame.f_locals.values()):
            calls.append(os.path.relpath(frame.f_code.co_filename, ROOT))

    sys.setprofile(profile)
    try:
        build()
    finally:
        sys.setprofile(None)
    stays: list[str] = []
    for module in calls:
        if module in STAGES and (not stays or stays[-1] != module):
            stays.append(module)
    return stays


def test_plan_build_enters_each_stage_once_in_order(tiny_model):
    config = make_config(str(tiny_model), **TINY_LIMITS)
    stays = _stays(config, lambda: Plan.build(config, cxx="gcc (test)", log_launch=False))
    assert stays == list(STAGES), stays
    # the walk of a caller that has the environment already is the same
    env = dict(Plan.build(config, cxx="gcc (test)").env)
    stays = _stays(config, lambda: Plan.build(config, env, log_launch=False))
    assert stays == list(STAGES), stays
