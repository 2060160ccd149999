"""Stages 5 and 6, load and dispatch: engine start finds every variant of a
plan, checks and loads it, and dispatch picks the bucket per call."""
