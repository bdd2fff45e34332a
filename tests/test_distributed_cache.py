"""The compile cache under real DDP (2 gloo processes, Inductor): rank 0 alone writes the bundle, every rank
reads it; a second run on a "new machine" (empty Inductor caches) compiles nothing: its regions are served by the
artifacts of the precompiled layer (their parameters hold gradients at the next forward under DDP)."""

import json

from tests.test_distributed import finish, start


def run(tmp_path, name: str, cache) -> dict:
    inductor = tmp_path / f"inductor-{name}"  # a new machine: its own empty Inductor cache
    out = tmp_path / f"{name}.json"
    args = ["--devices", "2", "--batch", "2", "--backend", "inductor", "--cache", str(cache)]
    result = finish(start(out, *args, env={"TORCHINDUCTOR_CACHE_DIR": str(inductor)}), out)
    ranks = [json.loads((tmp_path / f"{name}.json.rank{rank}").read_text()) for rank in (0, 1)]
    return result | {"ranks": ranks}


def test_ddp_compile_cache_rank_zero_writes_every_rank_reads(tmp_path):
    cache = tmp_path / "cache"
    first = run(tmp_path, "first", cache)
    assert [r["cache_status"] for r in first["ranks"]] == ["miss", "miss"]
    # rank 0 alone writes: after warm-up, then at train end with the precompiled regions. Every rank captures
    # its own (on a GPU each its device's: the guards check the device index); rank 0 gathers them, and keeps one
    # per entry and state (on the CPU both ranks' states are the same: rank 1's add nothing)
    assert [r["cache_saves"] for r in first["ranks"]] == [2, 0]
    captures = [r["cache_precompiled_captures"] for r in first["ranks"]]
    assert captures[1] > 0 and captures[0] == captures[1] == first["ranks"][0]["cache_precompiled_artifacts"]
    assert len(list(cache.iterdir())) == 1
    second = run(tmp_path, "second", cache)
    for rank in second["ranks"]:
        assert rank["cache_status"] == "hit" and rank["cache_saves"] == 0
        # every region call served from the bundle's precompiled artifacts, the dynamic-length graphs included
        assert rank["cache_precompiled_misses"] == 0 < rank["cache_precompiled_hits"]
        assert rank["cache_fx_graph_misses"] == 0 and rank["cache_aot_autograd_misses"] == 0
    assert second["losses"] == first["losses"]
