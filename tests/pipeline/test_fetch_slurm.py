"""A first run with nothing on the file system, on the real local Slurm: the fetch stage downloads the tiny model
from the Hub stand-in with the token its job reads from Secrets Manager, copies it to the bucket, prepare and
convert-in start from what it fetched, and the export stage pushes the trained model to a private repository.

Secrets Manager and S3 are moto's standalone server on 127.0.0.1 (the jobs are other processes, which reach it
through AWS_ENDPOINT_URL); the Hub is tests/support/hub_standin.py, reached through HF_ENDPOINT."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from transformers import AutoModelForCausalLM

from tests.support.hub_standin import HubStandin, running_hub
from tests.support.moto_server import moto_endpoint
from training.config.site import Site
from training.local.tiny import make_tiny_sources
from training.pipeline.hub import FETCH_MANIFEST
from training.pipeline.submit import cancel, submit, wait

REPO = "meta-llama/Tiny-Llama"
READ_TOKEN = "hf_read_0123456789abcdefghij"
WRITE_TOKEN = "hf_write_0123456789abcdefghij"
BUCKET = "results-bucket"


@pytest.fixture(scope="module")
def aws_endpoint() -> Iterator[str]:
    with moto_endpoint() as endpoint:
        yield endpoint


@pytest.fixture
def environment(aws_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandin]:
    """This process and the jobs it submits (sbatch passes its environment on) reach the stand-ins only."""
    credentials = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}
    for name, value in {**credentials, "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": aws_endpoint}.items():
        monkeypatch.setenv(name, value)
    for name in ("HF_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with running_hub() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        yield hub


def test_a_first_run_fetches_its_model_trains_it_and_pushes_the_result(
    local_slurm: Any, environment: HubStandin, tmp_path: Path
) -> None:
    hub = environment
    sources = make_tiny_sources(tmp_path / "sources", "llama")
    (sources["hf"] / "README.md").write_text("---\nlicense: llama3.1\n---\n# A tiny Llama\n")
    commit = hub.add_model_directory(REPO, sources["hf"], gated=True, license="llama3.1")
    hub.add_token(READ_TOKEN, "alice")
    hub.add_token(WRITE_TOKEN, "alice", write=True)
    hub.repos[REPO].accepted.add("alice")
    secrets = boto3.client("secretsmanager")
    read_arn = secrets.create_secret(Name="hf-read", SecretString=READ_TOKEN)["ARN"]
    write_arn = secrets.create_secret(Name="hf-write", SecretString=WRITE_TOKEN)["ARN"]
    boto3.client("s3").create_bucket(Bucket=BUCKET)
    models = tmp_path / "fsx" / "models"
    site = Site(
        runs_root=str(tmp_path / "fsx" / "runs"),
        results=str(tmp_path / "results"),
        python=sys.executable,
        slurm_bin=str(local_slurm.bin_dir),
        models_dir=str(models),
        models_uri=f"s3://{BUCKET}/fsx/models",
        hub_token_secret_arn=read_arn,
        hub_write_token_secret_arn=write_arn,
        hub_push_repo="alice/tiny-llama-cpt",
    )
    overrides = [
        f"model.config={models / 'Tiny-Llama'}",
        f"model.hub={json.dumps({'repo': REPO, 'revision': commit})}",
        f"prepare.source={sources['source']}",
        "steps=2",
    ]
    result = submit("tiny-llama-cpt", overrides, run_id="first", site=site, dry_run=False)
    run_dir = Path(result["run_dir"])
    rows = wait(run_dir, timeout=900)
    assert {row["stage"]: row["state"] for row in rows} == dict.fromkeys(
        ["fetch-tokenizer", "fetch", "prepare", "convert-in", "compile", "preflight", "train", "convert-out"]
        + ["evaluate", "sample", "export"],
        "COMPLETED",
    ), rows
    fetched = models / "Tiny-Llama"
    manifest = json.loads((fetched / FETCH_MANIFEST).read_text())
    assert (manifest["repo_id"], manifest["revision"]) == (REPO, commit)
    s3 = boto3.client("s3")
    listing = s3.list_objects_v2(Bucket=BUCKET, Prefix="fsx/models/Tiny-Llama/")["Contents"]
    assert sorted(o["Key"].rsplit("/", 1)[1] for o in listing) == sorted([*hub.files(REPO), FETCH_MANIFEST])
    pushed = hub.repos["alice/tiny-llama-cpt"]
    assert pushed.private
    trained = {p.relative_to(run_dir / "hf").as_posix(): p.read_bytes() for p in (run_dir / "hf").rglob("*")}
    assert hub.files("alice/tiny-llama-cpt") == {k: v for k, v in trained.items() if (run_dir / "hf" / k).is_file()}
    AutoModelForCausalLM.from_pretrained(str(run_dir / "hf"))
    logs = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").iterdir())
    scripts = "".join(p.read_text() for p in (run_dir / "jobs").iterdir())
    assert READ_TOKEN not in logs + scripts and WRITE_TOKEN not in logs + scripts
    assert read_arn in scripts and f"fetched {REPO} at {commit}" in logs
    # A second run of the same recipe finds the model there and downloads nothing.
    before = [r for r in hub.requests if r.startswith(("GET", "HEAD")) and REPO in r]
    again = submit("tiny-llama-cpt", overrides, run_id="second", site=site, dry_run=False)
    fetch_job, second = again["jobs"]["fetch"], Path(again["run_dir"])
    assert "fetch-tokenizer" not in again["jobs"]  # prepare reads the model's own tokenizer
    deadline = time.monotonic() + 300
    while not (second / "state" / "fetch.done").exists() and time.monotonic() < deadline:
        time.sleep(1)
    cancel(second)  # the rest of the run is the first one's again
    assert [r for r in hub.requests if r.startswith(("GET", "HEAD")) and REPO in r] == before
    log = second / "logs" / f"fetch-{fetch_job}.out"
    assert "already; nothing downloaded" in log.read_text() and os.path.isfile(fetched / "config.json")
