"""_kiln_build.py - the PEP 517 build backend of Kiln's Python package (standard library only,
so `pip install ./python` works offline, without setuptools).

It builds a pure-Python wheel of kiln/ plus kiln/_install.py, which records the libkiln.so
the installed package loads (an environment variable still wins at run time):
$KILN_LIBRARY, else $KILN_BUILD_DIR/lib/libkiln.so, else ../build/lib/libkiln.so beside this
directory (the tree `make` builds); when none exists nothing is recorded and the package asks
the dynamic linker for libkiln.so.0 (an installed Kiln). Editable installs (pip install -e)
put this directory on sys.path through a .pth file.
"""

import base64
import hashlib
import io
import os
import re
import sys
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
NAME = "kiln"


def _version():
    with open(os.path.join(HERE, "kiln", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)


def _library():
    cands = []
    if os.environ.get("KILN_LIBRARY"):
        cands.append(os.environ["KILN_LIBRARY"])
    if os.environ.get("KILN_BUILD_DIR"):
        cands.append(os.path.join(os.environ["KILN_BUILD_DIR"], "lib", "libkiln.so"))
    cands.append(os.path.join(HERE, "..", "build", "lib", "libkiln.so"))
    for c in cands:
        if os.path.isfile(c):
            return os.path.abspath(c)
    return None


def _metadata(version):
    return ("Metadata-Version: 2.1\nName: %s\nVersion: %s\n"
            "Summary: Kiln LLM inference engine: in-process generation with vLLM's offline "
            "API\nRequires-Python: >=3.9\n" % (NAME, version))


def _files():
    """(archive name, bytes) of the package's modules."""
    out = []
    pkg = os.path.join(HERE, "kiln")
    for name in sorted(os.listdir(pkg)):
        if name.endswith(".py") and name != "_install.py":
            with open(os.path.join(pkg, name), "rb") as f:
                out.append(("kiln/" + name, f.read()))
    return out


def _write_wheel(wheel_directory, files, version):
    dist = "%s-%s.dist-info" % (NAME, version)
    files = list(files) + [
        (dist + "/METADATA", _metadata(version).encode()),
        (dist + "/WHEEL", b"Wheel-Version: 1.0\nGenerator: kiln _kiln_build\n"
                          b"Root-Is-Purelib: true\nTag: py3-none-any\n"),
        (dist + "/top_level.txt", b"kiln\n"),
    ]
    record = io.StringIO()
    for name, data in files:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.write("%s,sha256=%s,%d\n" % (name, digest, len(data)))
    record.write("%s/RECORD,,\n" % dist)
    whl = "%s-%s-py3-none-any.whl" % (NAME, version)
    with zipfile.ZipFile(os.path.join(wheel_directory, whl), "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files:
            z.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), data)
        z.writestr(zipfile.ZipInfo(dist + "/RECORD", (2020, 1, 1, 0, 0, 0)), record.getvalue())
    return whl


def _install_module():
    lib = _library()
    if lib:
        print("kiln: the installed package will load %s" % lib, file=sys.stderr)
    else:
        print("kiln: no libkiln.so found to record (set KILN_LIBRARY or KILN_BUILD_DIR); the "
              "installed package will ask the dynamic linker for libkiln.so.0", file=sys.stderr)
    return ('"""Written by _kiln_build.py at install time: the libkiln.so this package '
            'loads."""\nLIBRARY = %r\n' % lib).encode()


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = _files() + [("kiln/_install.py", _install_module())]
    return _write_wheel(wheel_directory, files, _version())


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    # The source directory on sys.path: the package then finds libkiln.so as in the source
    # tree (KILN_LIBRARY, else ../build/lib).
    return _write_wheel(wheel_directory, [("kiln-editable.pth", (HERE + "\n").encode())],
                        _version())


def build_sdist(sdist_directory, config_settings=None):
    version = _version()
    base = "%s-%s" % (NAME, version)
    name = base + ".tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        for rel in ["pyproject.toml", "_kiln_build.py"] + [n for n, _ in _files()]:
            t.add(os.path.join(HERE, rel), arcname=base + "/" + rel)
        info = tarfile.TarInfo(base + "/PKG-INFO")
        data = _metadata(version).encode()
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    return name
