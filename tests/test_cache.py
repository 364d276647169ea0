"""The disk cache: entries are checked before the runtime sees them, bad ones heal, unsafe or
unwritable folders fall back to memory, and the folder follows XDG_CACHE_HOME with private modes.

Each test points FMHA_IREE_CACHE (or XDG_CACHE_HOME) at its own folder and compiles one small CPU
module; a result is checked against the float64 reference, so a cache that handed back the wrong
module would fail here.
"""

from __future__ import annotations

import os
import stat
import warnings
from pathlib import Path

import numpy as np
import pytest

import fmha_iree
from reference import assert_close, attention_ref

SHAPE = dict(B=1, H=2, S=19, D=16)


def _qkv():
    rng = np.random.default_rng(5)
    b, h, s, d = SHAPE["B"], SHAPE["H"], SHAPE["S"], SHAPE["D"]
    return tuple(rng.standard_normal((b, h, s, d), dtype=np.float32) for _ in range(3))


def _run_checked():
    q, k, v = _qkv()
    out = fmha_iree.fmha_fwd(q, k, v, mask="b")
    assert_close(out, attention_ref(q, k, v, mask="b")[0], np.float32, what="cached module")


def _entry(folder):
    vm = [p for p in folder.rglob("*.vmfb")]
    assert len(vm) == 1, vm
    return vm[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FMHA_IREE_CACHE", str(root))
    monkeypatch.delenv("FMHA_IREE_CACHE_TRUST", raising=False)
    _fresh()
    yield root
    _fresh()


def _fresh():
    """Forget this process's modules (compiled bytes and loaded modules) so the next call reads the
    disk cache."""
    fmha_iree.clear_memory_caches()


def _compiles():
    return fmha_iree.cache_stats()["compiles"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "no_record"])
def test_damaged_entry_is_rebuilt(cache, damage, tmp_path):
    _run_checked()
    vmfb = _entry(cache)
    data = bytearray(vmfb.read_bytes())
    if damage == "flip":
        for i in range(1000, len(data), 997):
            data[i] ^= 0xFF
        vmfb.write_bytes(bytes(data))
    elif damage == "truncate":
        vmfb.write_bytes(bytes(data[: len(data) // 3]))
    elif damage == "foreign":  # another module's bytes (same size class, other contents) under this key
        vmfb.write_bytes(bytes(data[::-1]))
    else:
        vmfb.with_suffix(".json").unlink()
    _fresh()
    before = _compiles()
    with pytest.warns(RuntimeWarning, match="failed its check"):
        _run_checked()
    assert _compiles() == before + 1
    _fresh()  # healed: the next process-level load is a clean disk hit
    hits = fmha_iree.cache_stats()["disk_hits"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run_checked()
    assert fmha_iree.cache_stats()["disk_hits"] == hits + 1


def test_record_of_another_spec_is_refused(cache):
    import json

    _run_checked()
    rec_path = _entry(cache).with_suffix(".json")
    rec = json.loads(rec_path.read_text())
    rec["spec"] = {**rec["spec"], "layout": "bshd" if rec["spec"].get("layout") == "bhsd" else "bhsd"}
    rec_path.write_text(json.dumps(rec))
    _fresh()
    with pytest.warns(RuntimeWarning, match="another spec"):
        _run_checked()


def test_modes_and_xdg(tmp_path, monkeypatch):
    monkeypatch.delenv("FMHA_IREE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    _fresh()
    _run_checked()
    vmfb = _entry(tmp_path / "xdg" / "fmha_iree")
    assert stat.S_IMODE(vmfb.stat().st_mode) == 0o600
    assert stat.S_IMODE(vmfb.with_suffix(".json").stat().st_mode) == 0o600
    assert stat.S_IMODE(vmfb.parent.stat().st_mode) == 0o700
    _fresh()


def test_world_writable_folder_is_not_used(cache):
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o777)
    with pytest.warns(RuntimeWarning, match="writable by every user"):
        _run_checked()
    assert not list(cache.rglob("*.vmfb"))


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes read-only folders")
def test_read_only_cache_falls_back_to_memory(cache):
    cache.mkdir(mode=0o700)
    os.chmod(cache, 0o500)
    try:
        with pytest.warns(RuntimeWarning, match="not using the disk cache"):
            _run_checked()
    finally:
        os.chmod(cache, 0o700)


def test_unwritable_entry_keeps_the_compiled_module(cache, monkeypatch, caplog):
    """A write that fails keeps the compiled module for this process; the first compile says what
    it compiles and how long it took (logger "fmha_iree", INFO)."""
    import logging

    from fmha_iree.toolchain import cache as disk

    def fail(*a, **k):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(disk.DiskCache, "store", fail)
    before = _compiles()
    with pytest.warns(RuntimeWarning, match="read-only file system"), caplog.at_level(logging.INFO, "fmha_iree"):
        _run_checked()
    said = [r.getMessage() for r in caplog.records if r.name == "fmha_iree"]
    assert any(m.startswith("compiling fmha_f32_bhsd") for m in said), said
    assert any(m.startswith("compiled fmha_f32_bhsd") and " s (" in m for m in said), said
    assert _compiles() == before + 1
    _run_checked()  # from memory
    assert _compiles() == before + 1


def test_cache_folder_deleted_during_a_compile_keeps_the_module(cache, monkeypatch):
    """The cache folder removed while a module compiles (a user clearing the cache): the call still
    returns the right result with one warning, and the compiled module serves the next call."""
    import shutil

    from fmha_iree.toolchain import compile as C

    real = C.compile_spec

    def compile_then_delete(spec, **kw):
        out = real(spec, **kw)
        shutil.rmtree(cache)
        return out

    monkeypatch.setattr(C, "compile_spec", compile_then_delete)
    before = _compiles()
    with pytest.warns(RuntimeWarning, match="not using the disk cache"):
        _run_checked()
    monkeypatch.setattr(C, "compile_spec", real)
    _run_checked()  # from memory
    assert _compiles() == before + 1


def test_read_only_cache_serves_its_entries(cache, monkeypatch):
    """A cache folder that cannot be written (populated or empty) never fails a call: an entry it
    holds is loaded without the lock and without compiling; a module it lacks is compiled and kept
    in memory, with one warning. (Root writes through read-only modes, so the folder's
    writability is denied through ``os.access``.)"""
    _run_checked()
    fmha_iree.clear_memory_caches()
    folder = _entry(cache).parent
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if m & os.W_OK and Path(p) == folder else real_access(p, m))
    before, hits = _compiles(), fmha_iree.cache_stats()["disk_hits"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run_checked()  # populated: loaded, no compile, no warning
    assert _compiles() == before and fmha_iree.cache_stats()["disk_hits"] == hits + 1
    q, k, v = (x[:, :, :, :8].copy() for x in _qkv())  # another head dim: a module the cache lacks
    with pytest.warns(RuntimeWarning, match="not writable"):
        out = fmha_iree.fmha_fwd(q, k, v, mask="b")
    assert_close(out, attention_ref(q, k, v, mask="b")[0], np.float32, what="read-only cache, new module")
    assert _compiles() == before + 1
