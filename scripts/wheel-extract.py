#!/usr/bin/env python3
"""Extracts some members of a PyPI wheel without downloading all of it.

    wheel-extract.py PACKAGE==VERSION DEST [--tag TAG] PATTERN...

VERSION may end with .* (the newest release of that series).

Looks the release up in PyPI's simple index (PEP 691 JSON), picks the wheel whose file name contains TAG
(default: cp310-cp310-manylinux1_x86_64, then any manylinux x86_64 / py3-none wheel), reads
the zip's central directory with HTTP range requests and downloads only the byte ranges of the
members matching the glob PATTERNs (fnmatch), which it unpacks under DEST. A torch wheel's
headers are ~15 MB of its ~700 MB. If the server ignores ranges, the whole wheel is fetched
into memory instead (slow but correct). Prints the wheel's name and what was extracted.
The member data is checked against the zip's CRC-32 (zipfile does it).

Environment: PYPI_SIMPLE_URL (https://pypi.org/simple), GMLAKE_WHEEL_TAG (overrides --tag).
"""
import argparse
import fnmatch
import io
import json
import os
import re
import sys
import urllib.request
import zipfile

CHUNK = 1 << 20


class RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote file, fetched by HTTP ranges and cached."""

    def __init__(self, url, size):
        self.url = url
        self.size = size
        self.pos = 0
        self.spans = []  # (start, bytes), non-overlapping
        self.requests = 0
        self.fetched = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, off, whence=0):
        if whence == 0:
            self.pos = off
        elif whence == 1:
            self.pos += off
        else:
            self.pos = self.size + off
        return self.pos

    def _get(self, start, end):  # [start, end)
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={start}-{end - 1}"})
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
            if r.status != 206:
                # The whole file: keep it all.
                self.spans = [(0, data)]
                self.requests += 1
                self.fetched += len(data)
                return
        self.requests += 1
        self.fetched += len(data)
        self.spans.append((start, data))

    def prefetch(self, start, end):
        start, end = max(0, start), min(self.size, end)
        if start < end and self._find(start, end) is None:
            self._get(start, end)

    def _find(self, start, end):
        for s, d in self.spans:
            if s <= start and end <= s + len(d):
                return s, d
        return None

    def read(self, n=-1):
        if n is None or n < 0:
            n = self.size - self.pos
        n = min(n, self.size - self.pos)
        if n <= 0:
            return b""
        hit = self._find(self.pos, self.pos + n)
        if hit is None:
            self._get(self.pos, min(self.size, self.pos + max(n, CHUNK)))
            hit = self._find(self.pos, self.pos + n)
            if hit is None:
                raise IOError(f"range {self.pos}+{n} not served by {self.url}")
        s, d = hit
        out = d[self.pos - s : self.pos - s + n]
        self.pos += len(out)
        return out

    def readinto(self, b):
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


def pick_wheel(package, version, tag):
    base = os.environ.get("PYPI_SIMPLE_URL", "https://pypi.org/simple")
    name = re.sub(r"[-_.]+", "-", package).lower()
    req = urllib.request.Request(
        f"{base}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        meta = json.load(r)
    stem = name.replace("-", "_") + "-"
    files = [f for f in meta["files"]
             if f["filename"].lower().startswith(stem) and f["filename"].endswith(".whl")
             and not f.get("yanked")]

    def version_of(f):
        return f["filename"][len(stem):].split("-")[0]

    if version.endswith(".*"):
        # The newest release of the series (numeric parts compared as numbers).
        pre = version[:-1]
        cands = sorted({version_of(f) for f in files if version_of(f).startswith(pre)},
                       key=lambda v: [int(x) if x.isdigit() else x for x in re.split(r"[.+]", v)])
        if not cands:
            raise SystemExit(f"wheel-extract: no {package} release matches {version}")
        version = cands[-1]
    files = [f for f in files if version_of(f) == version]
    prefs = [tag] if tag else []
    prefs += ["cp310-cp310-manylinux1_x86_64", "manylinux1_x86_64", "manylinux2014_x86_64",
              "manylinux_2_17_x86_64", "manylinux_2_28_x86_64", "py3-none-manylinux"]
    for p in prefs:
        for f in files:
            if p in f["filename"]:
                return f
    raise SystemExit(f"wheel-extract: no linux x86_64 wheel for {package}=={version} (tag {tag})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("req")
    ap.add_argument("dest")
    ap.add_argument("patterns", nargs="+")
    ap.add_argument("--tag", default=os.environ.get("GMLAKE_WHEEL_TAG", ""))
    a = ap.parse_args()
    package, _, version = a.req.partition("==")
    if not version:
        raise SystemExit("wheel-extract: give PACKAGE==VERSION")
    f = pick_wheel(package, version, a.tag)
    rf = RangeFile(f["url"], f["size"])
    # The end of the zip (EOCD and usually the whole central directory) in one request.
    rf.prefetch(max(0, f["size"] - 4 * CHUNK), f["size"])
    z = zipfile.ZipFile(io.BufferedReader(rf, buffer_size=CHUNK))
    infos = [i for i in z.infolist() if any(fnmatch.fnmatch(i.filename, p) for p in a.patterns)]
    if not infos:
        raise SystemExit(f"wheel-extract: nothing in {f['filename']} matches {a.patterns}")
    # Coalesce the members' byte ranges (local header + data) into few requests.
    infos.sort(key=lambda i: i.header_offset)
    spans = []
    for i in infos:
        s = i.header_offset
        e = s + 30 + len(i.filename.encode()) + len(i.extra) + i.compress_size + 1024
        if spans and s - spans[-1][1] < CHUNK:
            spans[-1][1] = max(spans[-1][1], e)
        else:
            spans.append([s, e])
    for s, e in spans:
        rf.prefetch(s, e)
    os.makedirs(a.dest, exist_ok=True)
    for i in infos:
        z.extract(i, a.dest)
    print(f"wheel-extract: {f['filename']}: {len(infos)} files, "
          f"{rf.fetched / 1e6:.1f} MB fetched of {f['size'] / 1e6:.1f} MB in {rf.requests} requests")


if __name__ == "__main__":
    sys.exit(main())
