"""Metric sinks: the wandb backend logs offline into the run directory."""

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import wandb
from wandb.proto import wandb_internal_pb2

from skyrl.train.utils.tracking import Tracker

# wandb's `.wandb` transaction log: a LevelDB-style log of protobuf `Record`s behind a 7-byte file header.
WANDB_LOG_IDENT = (b":W&B", 0xBEE1, 0)
WANDB_LOG_BLOCK = 32768
WANDB_LOG_HEADER = 7
WANDB_CHUNK_FULL, WANDB_CHUNK_LAST = 1, 4


def wandb_records(path: Path) -> Iterator[wandb_internal_pb2.Record]:
    """The protobuf records of a `.wandb` file, each chunk checked against its CRC32."""
    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:WANDB_LOG_HEADER]) == WANDB_LOG_IDENT
    pos, pending = WANDB_LOG_HEADER, b""
    while pos + WANDB_LOG_HEADER <= len(data):
        left_in_block = WANDB_LOG_BLOCK - pos % WANDB_LOG_BLOCK
        if left_in_block < WANDB_LOG_HEADER:
            pos += left_in_block
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + WANDB_LOG_HEADER])
        if kind == 0 and length == 0:
            pos += left_in_block
            continue
        chunk = data[pos + WANDB_LOG_HEADER : pos + WANDB_LOG_HEADER + length]
        pos += WANDB_LOG_HEADER + length
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"corrupt chunk at byte {pos}"
        pending += chunk
        if kind in (WANDB_CHUNK_FULL, WANDB_CHUNK_LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


@pytest.fixture
def offline_wandb(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """wandb offline, with every wandb directory under `tmp_path/elsewhere` (returned)."""
    elsewhere = tmp_path / "elsewhere"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(elsewhere / "dir"))
    for var, sub in [
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_DATA_DIR", "data"),
    ]:
        monkeypatch.setenv(var, str(elsewhere / sub))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    yield elsewhere
    wandb.teardown()


def test_wandb_backend_logs_an_offline_run_into_the_run_directory(tmp_path: Path, offline_wandb: Path):
    """An offline wandb run lands under `run_dir/wandb` (not WANDB_DIR or the cwd) with the config,
    and one history row per logged step holding the finite metrics that step was given."""
    elsewhere = offline_wandb
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    logged = {
        0: {"loss": 1.0, "reward/mean": 0.25},
        1: {"loss": 0.5, "reward/mean": 0.5, "grad_norm": float("nan")},
        2: {"loss": 0.25, "reward/mean": 0.75},
    }

    tracker = Tracker(["console", "wandb"], run_dir, "skyrl-test", "offline-run", {"trainer": {"seed": 7}})
    for step, metrics in logged.items():
        tracker.log(metrics, step=step)
    tracker.close()
    wandb.teardown()  # the wandb service writes the run file asynchronously; this waits for it
    run_files = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    records = [r for f in run_files for r in wandb_records(f)]

    assert len(run_files) == 1, f"expected one offline run under {run_dir}/wandb, found {run_files}"
    assert not (elsewhere / "dir").exists() and not (tmp_path / "wandb").exists()
    assert any(r.WhichOneof("record_type") == "exit" for r in records), "close() did not finish the run"
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.project, run.display_name) == ("skyrl-test", "offline-run")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["trainer"] == {"seed": 7}
    history = []
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append({k: v for k, v in row.items() if not k.startswith("_")} | {"_step": row["_step"]})
    expected = [{k: v for k, v in m.items() if k != "grad_norm"} | {"_step": s} for s, m in logged.items()]
    assert history == expected


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path: Path, offline_wandb: Path):
    """Two trackers on one run directory (a run, then its resume) log to one wandb run id."""
    for step in (1, 2):
        tracker = Tracker(["wandb"], tmp_path, "skyrl-test", "resumed", {})
        tracker.log({"loss": 1.0 / step}, step=step)
        tracker.close()
    wandb.teardown()
    run_files = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    run_ids = {
        r.run.run_id for f in run_files for r in wandb_records(f) if r.WhichOneof("record_type") == "run"
    }
    assert len(run_files) == 2 and len(run_ids) == 1, (run_files, run_ids)
