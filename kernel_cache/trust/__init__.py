"""Who may have written what engine start loads: ownership and permission checks
on the cache directory, and HMAC-SHA256 signatures on shared artifacts."""
