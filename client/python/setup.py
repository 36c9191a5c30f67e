"""Builds the `epd` Python package and its extension epd._C (pybind11 over epd.h).

    /usr/bin/python3 -m venv --system-site-packages V && V/bin/pip install --no-build-isolation ./client/python

(the Python that has torch: /usr/bin/python3 on Debian 12; docs/CLIENT_API.md section 14.)

No network: needs setuptools and pybind11's headers (the `pybind11` Python package when
importable, else Debian's pybind11-dev in /usr/include), epd.h + dlpack/dlpack.h, and
libepdclient.so, found in this order:

1. EPD_PREFIX: an installed tree (PREFIX/include/epd/epd.h, PREFIX/lib*/libepdclient.so);
2. EPD_BUILD_DIR: a CMake build tree of this repository (BUILD/client/libepdclient.so, the
   headers from the source tree);
3. this repository's build/ tree;
4. `pkg-config epd`;
5. /usr/local.
EPD_SOURCE_DIR names the repository when building from a copy of client/python.

dlpack/dlpack.h is looked for in DLPACK_INCLUDE_DIR, then beside epd.h, then /usr/include
and /usr/local/include. The extension links libepdclient alone, with an rpath to its
directory.
"""

import glob
import os
import re
import shlex
import subprocess
import sys

from setuptools import Extension, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
# The repository (for its build/ tree, client/include and version): EPD_SOURCE_DIR when the
# package is built from a copy, else the tree this file is in.
REPO = os.environ.get("EPD_SOURCE_DIR") or os.path.dirname(os.path.dirname(HERE))
LIB = "libepdclient.so"


def _fail(message):
    sys.stderr.write("epd setup.py: " + message + "\n")
    raise SystemExit(1)


def _lib_dir_of_prefix(prefix):
    for d in ["lib", "lib64"] + [os.path.relpath(p, prefix) for p in glob.glob(os.path.join(prefix, "lib", "*-linux-gnu"))]:
        if os.path.exists(os.path.join(prefix, d, LIB)):
            return os.path.join(prefix, d)
    return None


def _from_prefix(prefix, what):
    inc = os.path.join(prefix, "include")
    lib = _lib_dir_of_prefix(prefix)
    if not os.path.exists(os.path.join(inc, "epd", "epd.h")) or lib is None:
        return None
    return what, inc, lib


def _from_build(build, what):
    lib = os.path.join(build, "client")
    inc = os.path.join(REPO, "client", "include")
    if not os.path.exists(os.path.join(lib, LIB)) or not os.path.exists(os.path.join(inc, "epd", "epd.h")):
        return None
    return what, inc, lib


def _from_pkg_config():
    try:
        cflags = subprocess.run(["pkg-config", "--cflags-only-I", "epd"], check=True, capture_output=True, text=True).stdout
        libs = subprocess.run(["pkg-config", "--libs-only-L", "epd"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    incs = [f[2:] for f in shlex.split(cflags) if f.startswith("-I")]
    lib_dirs = [f[2:] for f in shlex.split(libs) if f.startswith("-L")]
    for inc in incs or ["/usr/include"]:
        for lib in lib_dirs or ["/usr/lib", "/usr/lib/x86_64-linux-gnu"]:
            if os.path.exists(os.path.join(inc, "epd", "epd.h")) and os.path.exists(os.path.join(lib, LIB)):
                return "pkg-config epd", os.path.realpath(inc), os.path.realpath(lib)
    return None


def find_epd():
    """(where, include dir of epd/epd.h, directory of libepdclient.so)."""
    prefix = os.environ.get("EPD_PREFIX")
    if prefix:
        found = _from_prefix(prefix, "EPD_PREFIX=" + prefix)
        if found is None:
            _fail("EPD_PREFIX=%s has no include/epd/epd.h and lib*/%s" % (prefix, LIB))
        return found
    build = os.environ.get("EPD_BUILD_DIR")
    if build:
        found = _from_build(os.path.abspath(build), "EPD_BUILD_DIR=" + build)
        if found is None:
            _fail("EPD_BUILD_DIR=%s has no client/%s (build the epdclient_shared target)" % (build, LIB))
        return found
    for candidate in (
        lambda: _from_build(os.path.join(REPO, "build"), os.path.join(REPO, "build")),
        _from_pkg_config,
        lambda: _from_prefix("/usr/local", "/usr/local"),
    ):
        found = candidate()
        if found is not None:
            return found
    _fail(
        "libepdclient not found: set EPD_PREFIX (an installed tree) or EPD_BUILD_DIR (a build "
        "tree with client/%s), build the repository's build/ tree, or install epd (pkg-config "
        "epd, /usr/local)" % LIB
    )


def find_dlpack(epd_include):
    candidates = [os.environ.get("DLPACK_INCLUDE_DIR"), epd_include, "/usr/include", "/usr/local/include"]
    for d in candidates:
        if d and os.path.exists(os.path.join(d, "dlpack", "dlpack.h")):
            return d
    _fail("dlpack/dlpack.h not found (install libdlpack-dev or set DLPACK_INCLUDE_DIR)")


def find_pybind11():
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        if os.path.exists("/usr/include/pybind11/pybind11.h"):
            return "/usr/include"
    _fail("pybind11 headers not found (install pybind11-dev, or the pybind11 Python package)")


def version(lib_dir):
    """epd's version: the repository's CMakeLists.txt, else the epd.pc beside the library,
    else `pkg-config --modversion epd`, else 0.0.0."""
    try:
        with open(os.path.join(REPO, "CMakeLists.txt")) as f:
            m = re.search(r"project\(epd VERSION ([0-9.]+)", f.read())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        with open(os.path.join(lib_dir, "pkgconfig", "epd.pc")) as f:
            m = re.search(r"^Version:\s*([0-9.]+)", f.read(), re.M)
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        return subprocess.run(["pkg-config", "--modversion", "epd"], check=True, capture_output=True,
                              text=True).stdout.strip() or "0.0.0"
    except (OSError, subprocess.CalledProcessError):
        return "0.0.0"


os.chdir(HERE)  # sources and packages are named relative to this directory
where, epd_include, lib_dir = find_epd()
dlpack_include = find_dlpack(epd_include)
pybind11_include = find_pybind11()
print("epd setup.py: epd.h from %s, %s from %s (%s); dlpack.h from %s; pybind11 from %s"
      % (epd_include, LIB, lib_dir, where, dlpack_include, pybind11_include))

ext = Extension(
    "epd._C",
    sources=sorted(glob.glob(os.path.join("src", "*.cc"))),
    depends=sorted(glob.glob(os.path.join("src", "*.h"))),
    include_dirs=[pybind11_include, epd_include, dlpack_include],
    library_dirs=[lib_dir],
    libraries=["epdclient"],
    runtime_library_dirs=[lib_dir],
    extra_compile_args=["-std=c++17", "-O2", "-fvisibility=hidden", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
    language="c++",
)

setup(
    name="epd",
    version=version(lib_dir),
    description="Python client of epd, the expert-parallel MoE dispatch/combine daemon",
    packages=find_packages(include=["epd", "epd.*"]),
    ext_modules=[ext],
    python_requires=">=3.9",
    zip_safe=False,
)
