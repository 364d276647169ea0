"""First compiles from several threads at once.

torch.export keeps its tracing modes on a process-wide stack, so two threads compiling two new
specs at once both failed ("Trying to pop empty mode stack", ``KeyError: 'custom'``) while a
sequential retry worked. Kernel keys here (f32 d16, bhsd and bshd) are compiled by no other test,
into an empty cache folder, so both calls really compile.
"""

from __future__ import annotations

import threading

import fmha_iree
from common import compiles
from reference import assert_close, attention_ref, make_qkv, seed_of


def test_two_threads_compile_two_new_specs(tmp_path, monkeypatch):
    monkeypatch.setenv("FMHA_IREE_CACHE", str(tmp_path / "cache"))
    before = compiles()
    results, errors = {}, []

    def call(layout: str):
        try:
            q, k, v = make_qkv(seed_of("threads", layout), B=2, Hq=2, Sq=37, Sk=45, Dq=16, layout=layout)
            out, lse = fmha_iree.fmha_fwd(q, k, v, mask="b", layout=layout, return_lse=True)
            results[layout] = (q, k, v, out, lse)
        except Exception as e:  # reported below: the assertion names what each thread raised
            errors.append(f"{layout}: {e!r}")

    threads = [threading.Thread(target=call, args=(layout,)) for layout in ("bhsd", "bshd")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert compiles() - before == 2
    for layout, (q, k, v, out, lse) in results.items():
        ref_out, ref_lse = attention_ref(q, k, v, mask="b", layout=layout)
        assert_close(out, ref_out, q.dtype, kind="out", what=layout)
        assert_close(lse, ref_lse, q.dtype, kind="lse", what=layout)
