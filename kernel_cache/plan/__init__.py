"""Stage 2, plan: the bucketer and its variants, each variant's launch config
and its content-hashed key. Nothing here loads or compiles code."""
