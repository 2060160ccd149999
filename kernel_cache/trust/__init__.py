"""Who may have written what engine start loads: ownership and permission checks
on the cache directory, and Ed25519 signatures on shared artifacts."""
