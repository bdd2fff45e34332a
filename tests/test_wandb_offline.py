"""Reading back an offline W&B run, including one whose file is still being written."""

import threading
import time

import wandb

from compile_trainer.runs.wandb_offline import read_offline_run


def offline_run(tmp_path):
    run = wandb.init(mode="offline", dir=tmp_path, project="reader", name="reader-test", config={"lr": 0.1})
    for step in range(3):
        run.log({"train/loss": 1.0 / (step + 1)}, step=step)
    run.summary.update({"summary/steps": 3, "summary/flops_source": "counted", "summary/padding": "x" * 40_000})
    run.finish()
    return next(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


def test_a_run_is_read_back_after_the_service_flushes_its_last_block(tmp_path):
    """``finish()`` may return with the file's tail unwritten: the reader waits for the ``exit`` record."""
    path = offline_run(tmp_path)
    run = read_offline_run(path.parent)
    whole = path.read_bytes()
    assert len(whole) > 32 * 1024 + 100, "the summary's record crosses into the second block"
    assert run.finished and run.name == "reader-test" and run.config["lr"] == 0.1
    assert run.series("train/loss") == [1.0, 0.5, 1.0 / 3]
    assert run.summary["summary/steps"] == 3 and run.summary["summary/flops_source"] == "counted"

    path.write_bytes(whole[: 32 * 1024 + 100])  # one block and a piece of a record, as a writer leaves it
    partial = read_offline_run(path, wait_s=0.2)
    assert not partial.finished and "summary/steps" not in partial.summary
    assert partial.series("train/loss")[:1] == [1.0], "what was written is read"

    writer = threading.Timer(0.5, path.write_bytes, args=(whole,))
    writer.start()
    started = time.monotonic()
    flushed = read_offline_run(path)
    writer.join()
    assert flushed.finished and flushed.summary["summary/steps"] == 3
    assert 0.5 <= time.monotonic() - started < 5
