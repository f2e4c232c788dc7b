"""Build-once C++ extensions: compiled with the machine's gcc on first use into $TDPIPE_CACHE/kernels.

A build directory is keyed by the source, flags, torch, Python and CPU (`cpu_tag`). Before torch loads
one, the cache entry is checked: a build lock left by a killed build (torch would wait on it forever), a
shared object that is not a whole ELF file (truncated, garbage) or differs from the size recorded after
its last good load. A damaged entry is said on stderr, cleared and built again; so is one that fails to
load. The first build says so, and how long it took.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import platform
import struct
import threading
import time
from pathlib import Path
from collections.abc import Callable
from types import ModuleType

import torch

log = logging.getLogger("tdpipe")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp"]
LDFLAGS = ["-fopenmp"]  # resolves to the libgomp torch already loaded: one OpenMP runtime in the process
MANIFEST = "tdpipe-kernel.json"  # the .so's size after its last good load
_OUTPUTS = (".so", ".o", ".ninja_deps", ".ninja_log")  # what a rebuild clears (build.ninja is regenerated)

_lock = threading.Lock()  # guards _locks
_locks: dict[str, threading.Lock] = {}  # one per kernel: two kernels build at once (each gcc is one thread)
_built: dict[str, ModuleType | None] = {}


def cpu_tag(source: Path, flags: list[str]) -> str:
    """What -march=native compiles for, plus the source, so a shared cache never serves a foreign build."""
    key = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            key += "".join(line for line in f if line.startswith(("flags", "model name")))
    except OSError:
        pass
    text = source.read_text()
    # the local files it includes (#include "x.cpp") are part of the build too
    included = [source.parent / line.split('"')[1] for line in text.splitlines()
                if line.startswith('#include "')]
    key += "|".join([torch.__version__, platform.python_version(), " ".join(flags), text,
                     *(f.read_text() for f in included)])
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def elf_damage(path: Path) -> str | None:
    """Why `path` is not a whole ELF shared object (None: it is). Reads the headers only: the program and
    section header tables and every loaded segment must lie within the file. A truncated object that
    dlopen maps past its end would crash the process with SIGBUS instead of raising."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF":
                return "not an ELF file"
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if wide:
                phoff, shoff = struct.unpack_from(order + "QQ", head, 32)
                phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54)
            else:
                phoff, shoff = struct.unpack_from(order + "II", head, 28)
                phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 42)
            if phoff + phentsize * phnum > size or shoff + shentsize * shnum > size:
                return f"truncated ({size} bytes)"
            f.seek(phoff)
            table = f.read(phentsize * phnum)
        for i in range(phnum):
            entry = table[i * phentsize:(i + 1) * phentsize]
            if wide:  # Elf64_Phdr: type, flags, offset, vaddr, paddr, filesz
                kind, _, offset, _, _, filesz = struct.unpack_from(order + "IIQQQQ", entry)
            else:  # Elf32_Phdr: type, offset, vaddr, paddr, filesz
                kind, offset, _, _, filesz = struct.unpack_from(order + "IIIII", entry)
            if kind == 1 and offset + filesz > size:  # PT_LOAD
                return f"truncated ({size} bytes, a segment ends at {offset + filesz})"
    except (OSError, struct.error) as e:
        return f"unreadable ({type(e).__name__})"
    return None


def entry_damage(build_dir: Path, name: str) -> str | None:
    """Why the built entry in build_dir cannot be loaded as is (None: fine or not built yet)."""
    if (build_dir / "lock").exists():  # we hold the flock: no build of ours is running
        return "a build lock left by a killed build"
    so = build_dir / f"{name}.so"
    if not so.exists():
        return None
    why = elf_damage(so)
    if why:
        return f"{so.name} is {why}"
    try:
        recorded = json.loads((build_dir / MANIFEST).read_text())["size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None  # built before manifests: its headers were checked above
    if recorded != so.stat().st_size:
        return f"{so.name} has {so.stat().st_size} bytes, {recorded} when it last loaded"
    return None


def _clear(build_dir: Path) -> None:
    """Remove a build's outputs and torch's lock, so ninja builds everything again."""
    for f in build_dir.iterdir():
        if f.name == "lock" or f.name == MANIFEST or f.suffix in _OUTPUTS or f.name in _OUTPUTS:
            f.unlink(missing_ok=True)


def _record(build_dir: Path, name: str) -> None:
    from tdpipe.model.cache import write_json

    so = build_dir / f"{name}.so"
    try:
        write_json(build_dir / MANIFEST, {"so": so.name, "size": so.stat().st_size}, indent=None)
    except OSError:
        pass  # the next load checks the headers instead


def _loaded_before(build_dir: Path, so: Path) -> bool:
    try:
        recorded = json.loads((build_dir / MANIFEST).read_text())["size"]
        return so.exists() and recorded == so.stat().st_size and elf_damage(so) is None
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _import_built(name: str, so: Path) -> ModuleType:
    """Import a built extension module from its .so (what torch's loader does once the build is done)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load(name: str, src: Path, flags: list[str], build_dir: Path) -> ModuleType:
    """torch's JIT build and import, run under our flock; checks and rebuilds a damaged entry first."""
    from torch.utils import cpp_extension

    from tdpipe.model.cache import notice

    def compile_and_import() -> ModuleType:
        # torch versions a name it already built in this process from another build_directory
        # (name_v1.so): forget it, so the entry here is always {name}.so, the file the manifest describes
        versions = getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None)
        if versions is not None:
            versions.entries.pop(name, None)
        return cpp_extension.load(name=name, sources=[str(src)], extra_cflags=flags, extra_ldflags=LDFLAGS,
                                  build_directory=str(build_dir), verbose=False)

    so = build_dir / f"{name}.so"
    if _loaded_before(build_dir, so):
        # the .so is whole and the size it had when it last loaded fine: import it directly. torch's JIT
        # path would take its lock file even to find nothing to build, and a kill in that moment left a
        # lock that forced a rebuild (a minute) on the next start
        (build_dir / "lock").unlink(missing_ok=True)
        try:
            return _import_built(name, so)
        except (ImportError, OSError):
            pass  # rebuilt below
    why = entry_damage(build_dir, name)
    if why:
        notice(f"the cached {name} kernel in {build_dir} is damaged ({why}); building it again")
        _clear(build_dir)
    so = build_dir / f"{name}.so"
    fresh = not so.exists()
    if fresh and not why:
        notice(f"building the {name} C++ kernel under {build_dir} (once, 20-60 s)")
    t = time.perf_counter()
    try:
        mod = compile_and_import()
    except (ImportError, OSError) as e:
        if fresh:
            raise  # just built and still unloadable: not a cache problem
        notice(f"the cached {name} kernel in {build_dir} does not load ({type(e).__name__}: "
               f"{str(e).splitlines()[0] if str(e) else ''}); building it again")
        _clear(build_dir)
        fresh, t = True, time.perf_counter()
        mod = compile_and_import()
    if fresh:
        notice(f"built {name} in {time.perf_counter() - t:.1f} s")
    _record(build_dir, name)
    return mod


def build(name: str, source: str, extra_cflags: list[str] | None = None) -> ModuleType | None:
    """The compiled module, or None (logged once) when TDPIPE_NO_KERNEL=1 or the build fails. A
    TDPIPE_CACHE that cannot hold the kernels is the user's to fix: its CacheDirError propagates."""
    from tdpipe.model.cache import CacheDirError, cache_dir

    with _lock:
        mine = _locks.setdefault(name, threading.Lock())
    with mine:
        if name in _built:
            return _built[name]
        mod = None
        if os.environ.get("TDPIPE_NO_KERNEL") == "1":
            log.warning("TDPIPE_NO_KERNEL=1: %s uses the pure-torch path", name)
        else:
            try:
                src = CSRC / source
                flags = CFLAGS + (extra_cflags or [])
                build_dir = cache_dir() / "kernels" / f"{name}-{cpu_tag(src, flags)}"
                build_dir.mkdir(parents=True, exist_ok=True)
                # torch's own build lock is a plain file that a killed build leaves behind, after which every
                # later load waits forever. Serialise on a flock (released when a process dies); holding it,
                # any torch lock file is stale (entry_damage).
                with open(build_dir / "tdpipe.lock", "w") as lock:
                    fcntl.flock(lock, fcntl.LOCK_EX)
                    mod = _load(name, src, flags, build_dir)
            except CacheDirError:
                raise
            except Exception as e:  # no compiler, build error: degrade to torch, never crash the engine
                log.warning("%s kernel unavailable (%s: %s); using the pure-torch path", name,
                            type(e).__name__, e)
        _built[name] = mod
        return mod


def import_build_tools() -> None:
    """Import torch's cpp_extension, and with it setuptools, on the calling thread, before it starts threads
    that import. Python 3.11 finds a module by walking the live sys.meta_path list, and setuptools' first
    import inserts its distutils finder at the front of that list and removes it again: another thread
    walking the list in that instant skips the path finder and reports an installed module missing (seen
    in an engine core: "No module named 'jinja2.idtracking'" from the tokenizer thread while the kernels'
    loader imported setuptools). Later imports of setuptools change nothing."""
    from torch.utils import cpp_extension  # noqa: F401


def in_background(*builders: Callable[[], ModuleType | None]) -> None:
    """Start each kernel's build (or cache load) on a thread of its own and return at once: on a first run
    the kernels compile side by side (each gcc is single-threaded; 18 s and 17 s here, one after the other
    before) while the caller loads the weights. A later build() of the same kernel waits for its thread,
    and so does the interpreter's exit (not daemon threads): a build is never cut off half-written.

    The build tools are imported here, on the caller's thread, first (import_build_tools): done on a
    builder thread while the caller imported something, CI saw "No module named 'torch.utils._device'" and
    "'sympy.polys.domains.pythonintegerring'" from a model being built."""
    import_build_tools()

    for b in builders:
        threading.Thread(target=b, name="tdpipe-kernel-build").start()
