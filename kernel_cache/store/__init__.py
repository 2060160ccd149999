"""Stage 4, store: the tiers that hold artifacts (disk, Redis, S3, bundle), the
lookup that orders them, the build locks, quarantine and housekeeping."""
