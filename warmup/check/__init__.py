"""Tools that check a warmed cache without compiling: ``verify`` (every variant
against the eager reference) and ``explain`` (which key component changed)."""
