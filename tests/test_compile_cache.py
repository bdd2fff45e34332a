"""The compile cache (``compile_trainer.cache``): bundles that travel between runs and machines.

A "new machine" is a fresh process with empty TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR (``cache_run.py``);
the S3 store is moto's server on the loopback interface, reached through fsspec and s3fs.
"""

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from compile_trainer import CompileCallback, compat
from compile_trainer.cache.bundle import BundleError, decode, encode
from compile_trainer.cache.key import bundle_name, cache_key, key_fields
from compile_trainer.cache.session import CompileCacheWarning
from compile_trainer.cache.storage import BundleStore
from compile_trainer.cli.main import main as cli_main
from compile_trainer.runs.wandb_offline import read_offline_run
from compile_trainer.schema import PolicyError, to_policy
from tests.conftest import quiet_cpu_trainer
from tests.telemetry_models import TinyRegression

HERE = Path(__file__).resolve().parent
BUCKET = "compile-cache"


@pytest.fixture(scope="module")
def s3_endpoint():
    """An S3-compatible server (moto) on 127.0.0.1 with one bucket; the AWS settings that reach it."""
    from moto.server import ThreadedMotoServer

    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env["AWS_ENDPOINT_URL"] = f"http://{host}:{port}"
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    import boto3

    boto3.client("s3").create_bucket(Bucket=BUCKET)
    yield env
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    server.stop()


def test_a_damaged_bundle_is_recognised_and_says_why():
    data = encode({"key": "k"}, {"mega_cache": b"x" * 100, "cache_dirs": b"y" * 50})
    assert decode(data).sections == {"mega_cache": b"x" * 100, "cache_dirs": b"y" * 50}
    damaged = {
        "truncated": data[:-10],
        "truncated: the file ends inside its manifest": data[:40],
        "corrupt: section 'mega_cache'": data[:-120] + b"z" + data[-119:],
        "not a compile_trainer bundle": b"PK\x03\x04" + data[4:],
    }
    for reason, broken in damaged.items():
        with pytest.raises(BundleError, match=reason):
            decode(broken)


def _write_many(location: str, payload: bytes, times: int) -> None:
    store = BundleStore(location)
    for _ in range(times):
        store.write("same.ctbundle", encode({"writer": payload[:1].decode()}, {"mega_cache": payload}))


def test_two_writers_at_once_leave_one_whole_bundle(tmp_path):
    payloads = [b"a" * 3_000_000, b"b" * 2_000_000]
    context = multiprocessing.get_context("fork")  # two processes, without re-importing this module
    writers = [context.Process(target=_write_many, args=(str(tmp_path), p, 8)) for p in payloads]
    for writer in writers:
        writer.start()
    reader = BundleStore(str(tmp_path))
    seen = set()
    while any(writer.is_alive() for writer in writers):
        data = reader.read("same.ctbundle")
        if data is not None:  # whichever writer renamed last, never half of one
            seen.add(decode(data).manifest["writer"])
    for writer in writers:
        writer.join()
        assert writer.exitcode == 0
    assert decode(reader.read("same.ctbundle")).sections["mega_cache"] in payloads
    assert sorted(p.name for p in tmp_path.iterdir()) == ["same.ctbundle"]  # no temporary file left behind
    assert seen <= {"a", "b"}


def test_s3_store_writes_lists_reads_and_prunes(s3_endpoint, capsys):
    url = f"s3://{BUCKET}/store-test"
    store = BundleStore(url)
    store.write(bundle_name("k1"), encode({"key": "k1", "fields": {"torch": "2.13"}, "regions": ["a"]}, {"x": b"1"}))
    store.write(bundle_name("k2"), encode({"key": "k2", "fields": {"torch": "2.13"}, "regions": []}, {"x": b"22"}))
    assert decode(store.read(bundle_name("k2"))).sections == {"x": b"22"}
    assert store.read(bundle_name("missing")) is None
    assert cli_main(["cache", "list", url]) == 0
    listed = capsys.readouterr().out
    assert "2 bundle(s)" in listed and "k1" in listed and "torch 2.13" in listed
    assert cli_main(["cache", "prune", url, "--keep", "1"]) == 0
    assert "deleted 1 of 2" in capsys.readouterr().out
    assert len(store.list(".ctbundle")) == 1


def _run(cache_dir: str, machine: Path, env: dict, *args: str) -> dict:
    """One run in a fresh process whose Inductor and Triton caches start empty (a new machine)."""
    machine.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        **env,
        "TORCHINDUCTOR_CACHE_DIR": str(machine / "inductor"),
        "TRITON_CACHE_DIR": str(machine / "triton"),
    }
    done = subprocess.run(
        [sys.executable, str(HERE / "cache_run.py"), cache_dir, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"output": done.stdout + done.stderr}


def test_a_new_machine_loads_the_bundle_from_s3_and_compiles_less(s3_endpoint, tmp_path):
    """From torch 2.11 the regions' traces travel too (the precompiled layer): the new machine compiles nothing;
    before, Dynamo traces each region again and the backend's work comes from the bundle."""
    precompiled = compat.aot_compile_problem() is None
    url = f"s3://{BUCKET}/runs"
    cold = _run(url, tmp_path / "machine1", s3_endpoint)
    assert cold["cache_status"] == "miss" and cold["cache_saves"] >= 1 and cold["compiles"] > 0
    assert cold["cache_fx_graph_misses"] > 0 and all(misses > 0 for _, misses in cold["regions"].values())
    if precompiled:
        assert cold["cache_precompiled_captures"] == cold["cache_precompiled_artifacts"] > 0
        assert "compile cache: precompiling " in cold["output"]  # the pause at fit end is announced

    warm = _run(url, tmp_path / "machine2", s3_endpoint, "--wandb-dir", str(tmp_path / "wandb"))
    assert warm["cache_status"] == "hit", warm["cache_reason"]
    assert warm["cache_key"] == cold["cache_key"]
    cold_compile_s = cold["compile_time_s"]  # the captures ran after training: not part of the cold compile
    assert warm["cache_cold_compile_s"] == pytest.approx(cold_compile_s, rel=0.05)
    assert warm["cache_fx_graph_misses"] == 0 and "cache: hit, bundle of " in warm["output"]
    if precompiled:  # every region call served by its artifact: Dynamo traced nothing, the backend compiled nothing
        assert warm["cache_precompiled_hits"] > 0 and warm["cache_precompiled_misses"] == 0
        assert warm["compiles"] == warm["unique_graphs"] == 0 and "call(s) served, 0 compiled" in warm["output"]
    else:
        assert warm["compiles"] == cold["compiles"] and warm["cache_fx_graph_hits"] > 0
    loads = warm["cache_load_s"] + (warm.get("cache_precompiled_load_s") or 0)
    assert warm["cache_seconds_saved"] == pytest.approx(cold_compile_s - warm["compile_time_s"] - loads)
    assert warm["weights"] == cold["weights"]  # the bundle changed compile time, not results
    assert warm["cache_saves"] == 0 and "precompiling" not in warm["output"]  # nothing new: nothing rewritten

    run = read_offline_run(next((tmp_path / "wandb").rglob("run-*.wandb")))
    assert run.summary["summary/cache_status"] == "hit"
    assert run.summary["summary/compiles"] == warm["compiles"]
    assert run.series("cache/hit")[-1] == 1.0

    # without the precompiled layer, Dynamo traces again and the backend's work comes from the bundle
    layers = _run(
        url, tmp_path / "machine3", s3_endpoint, "--mode", "read-only", "--layers", "mega_cache", "cache_dirs"
    )
    assert layers["cache_fx_graph_misses"] == 0 and layers["cache_fx_graph_hits"] > 0
    assert all(hits > 0 and misses == 0 for hits, misses in layers["regions"].values())
    assert layers["compiles"] == cold["compiles"] and layers["cache_aot_autograd_misses"] == 0
    assert layers["weights"] == cold["weights"]


def _fit(policy_overrides: dict):
    module = TinyRegression(n_batches=3)
    callback = CompileCallback("regional", print_plan=False, backend="aot_eager", **policy_overrides)
    quiet_cpu_trainer(max_steps=3, callbacks=[callback]).fit(module)
    return callback, [p.detach().clone() for p in module.parameters()]


@pytest.mark.parametrize("damage", ["truncated", "corrupt", "other torch", "torch refuses its contents"])
def test_an_unusable_bundle_warns_why_and_compiles_cold(tmp_path, damage):
    policy = to_policy("regional", backend="aot_eager", cache={"dir": str(tmp_path)})
    fields = key_fields(TinyRegression(n_batches=3), policy, torch.device("cpu"))
    key = cache_key(fields)
    bundles = {
        "truncated": encode({"key": key, "fields": fields}, {"mega_cache": b"m" * 1000})[:-300],
        "corrupt": encode({"key": key, "fields": fields}, {"mega_cache": b"m" * 1000}).replace(b"m" * 10, b"n" * 10, 1),
        "other torch": encode({"key": "0" * 32, "fields": fields | {"torch": "2.0.0"}}, {}),
        "torch refuses its contents": encode({"key": key, "fields": fields}, {"mega_cache": b"not a mega-cache"}),
    }
    BundleStore(str(tmp_path)).write(bundle_name(key), bundles[damage])
    reasons = {
        "truncated": "truncated",
        "corrupt": "corrupt: section 'mega_cache'",
        "other torch": "written for other settings: torch '2.0.0'",
        "torch refuses its contents": "torch could not read the mega-cache",
    }
    with pytest.warns(CompileCacheWarning, match=reasons[damage]):
        callback, weights = _fit({"cache": {"dir": str(tmp_path)}})
    assert callback.summary()["cache_status"] == "unusable"
    torch._dynamo.reset()
    _, reference = _fit({})
    assert all(torch.equal(a, b) for a, b in zip(weights, reference))


def test_cache_section_errors_name_what_is_valid():
    with pytest.raises(PolicyError, match="cache.mode='rw' is invalid. Valid modes: read-write, read-only, off"):
        to_policy("regional", cache={"dir": "/tmp/x", "mode": "rw"})
    with pytest.raises(PolicyError, match="Give one or more of: mega_cache, cache_dirs"):
        to_policy("regional", cache={"dir": "/tmp/x", "layers": ["triton"]})
    with pytest.raises(PolicyError, match=r"cache.dir='nosuch://bucket/x' needs fsspec with nosuch:// support"):
        CompileCallback("regional", cache={"dir": "nosuch://bucket/x"})  # before any training
    CompileCallback("regional", cache={"dir": "s3://bucket/x"})  # s3fs is installed (the dev extra)


def test_every_rank_reads_and_only_rank_zero_writes(tmp_path, monkeypatch):
    """Ranks from torch.distributed, else the launcher's RANK; a real (tiny) Inductor compile in between."""
    from compile_trainer import compat
    from compile_trainer.cache.session import CompileCache, process_rank

    monkeypatch.setenv("RANK", "1")
    assert process_rank() == 1
    model = torch.nn.Linear(4, 4)
    policy = to_policy("full", cache={"dir": str(tmp_path)})
    ranks = [CompileCache(policy.cache, rank=rank) for rank in (1, 0)]
    for cache in ranks:
        assert cache.load(model, policy, torch.device("cpu")).status == "miss"
    with compat.fresh_inductor_cache():
        torch.compile(lambda x: x * 2 + 1)(torch.ones(4))
    assert not ranks[0].save(["model"], 1.0) and not list(tmp_path.iterdir())
    assert ranks[1].save(["model"], 1.0) and len(list(tmp_path.iterdir())) == 1
    assert not ranks[1].save(["model"], 1.0)  # nothing compiled since: nothing rewritten
    reader = CompileCache(policy.cache, rank=1)
    assert reader.load(model, policy, torch.device("cpu")).status == "hit"
    assert reader.outcome.cold_compile_s == 1.0 and reader.describe().startswith("cache: hit, bundle of ")


def test_the_runs_of_a_multirun_read_the_bundle_the_first_one_wrote(tmp_path):
    """Two seeds of one policy, each with empty local caches (sweep.fresh_cache): the second loads the bundle."""
    from compile_trainer.runs.results import RESULT_FILE, read_result
    from tests.test_train_script import ROOT, TINY

    directory, bundles = tmp_path / "sweep", tmp_path / "bundles"
    overrides = ["compile=regional", "compile.backend=inductor", f"compile.cache.dir={bundles}", "seed=0,1"]
    overrides += ["sweep.fresh_cache=true", "trainer.max_steps=3", "logger=csv", f"hydra.sweep.dir={directory}"]
    command = [sys.executable, "train.py", "-m", *TINY, *overrides]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    first, second = (read_result(directory / str(job) / RESULT_FILE)["summary"] for job in (0, 1))
    assert first["cache_status"] == "miss" and first["cache_saves"] >= 1
    assert second["cache_status"] == "hit" and second["cache_key"] == first["cache_key"]
    assert second["cache_fx_graph_misses"] == 0
    if compat.aot_compile_problem() is None:  # torch >= 2.11: the regions' traces came with the bundle
        assert second["cache_precompiled_hits"] > 0
        assert second["cache_precompiled_misses"] == second["compiles"] == 0 < first["compiles"]
    else:
        assert second["compiles"] == first["compiles"] > 0 and second["cache_fx_graph_hits"] > 0
