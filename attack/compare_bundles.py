"""Compare two exported bundles of one plan: per variant, the key and the
artifact's sha256 (and whether the .so inside differs).

  python attack/compare_bundles.py /tmp/a4/cache-base.bundle /tmp/a4/cache-X.bundle
"""

import hashlib
import json
import sys
import zipfile
from pathlib import Path


def entries(d):
    m = json.loads((Path(d) / "manifest.json").read_text())
    return {e["variant"]: e for e in m["entries"]}


def members(d, e):
    z = zipfile.ZipFile(Path(d) / e["file"])
    return {n: hashlib.sha256(z.read(n)).hexdigest()[:12] for n in z.namelist()}


a, b = sys.argv[1:3]
ea, eb = entries(a), entries(b)
for v in sorted(ea):
    x, y = ea[v], eb.get(v)
    if y is None:
        print(v, "missing in", b)
        continue
    same_key = x["key"] == y["key"]
    same_bytes = x["sha256"] == y["sha256"]
    print(f"{v}: key {'same' if same_key else 'DIFFERS'}, bytes {'same' if same_bytes else 'DIFFER'}")
    if not same_bytes:
        ma, mb = members(a, x), members(b, y)
        for n in sorted(set(ma) | set(mb)):
            if ma.get(n) != mb.get(n):
                print("   member differs:", n)
