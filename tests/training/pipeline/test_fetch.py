"""The fetch stage and the Hub push, with the real huggingface_hub client against a stand-in of the Hub's HTTP API
on 127.0.0.1 (tests/support/hub_standin.py), tokens in Secrets Manager and the model copy in S3 through moto.

The model is a tiny random Llama saved by transformers, so what is fetched is what `from_pretrained` loads."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from moto import mock_aws

from tests.support.hub_standin import HubStandin, point_client_at, running_hub
from training.cli import main
from training.config.recipe import HubSource, load_recipe, recipe_as_dict
from training.config.site import Site
from training.errors import UserError
from training.local.tiny import tiny_model, train_tokenizer
from training.pipeline.hub import FETCH_MANIFEST, copy_destination, fetch_model, push_model, tokenizer_source
from training.pipeline.plan import plan_run
from training.pipeline.scripts import render

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

REPO = "meta-llama/Tiny-Llama"
READ_TOKEN = "hf_read_0123456789abcdefghij"
WRITE_TOKEN = "hf_write_0123456789abcdefghij"
REGION = "us-west-2"
BUCKET = "results-bucket"


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    model = tiny_model(root / "hf", train_tokenizer(root / "tokenizer"))
    (model / "README.md").write_text("---\nlicense: llama3.1\n---\n# A tiny Llama\n")
    return model


@pytest.fixture
def hub(tiny_hf: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandin]:
    with running_hub() as standin:
        point_client_at(standin.endpoint, monkeypatch)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        standin.add_model_directory(REPO, tiny_hf, gated=True, license="llama3.1")
        standin.add_token(READ_TOKEN, "alice")
        standin.add_token(WRITE_TOKEN, "alice", write=True)
        standin.add_token("hf_read_of_bob_0123456789", "bob")
        standin.repos[REPO].accepted.add("alice")
        yield standin


@pytest.fixture
def aws(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """Secrets Manager holding both tokens and the results bucket, in moto; the secrets' ARNs."""
    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing")):
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    with mock_aws():
        secrets = boto3.client("secretsmanager", region_name=REGION)
        arns = {
            "read": secrets.create_secret(Name="hf-read", SecretString=READ_TOKEN)["ARN"],
            "write": secrets.create_secret(Name="hf-write", SecretString=json.dumps({"token": WRITE_TOKEN}))["ARN"],
        }
        boto3.client("s3", region_name=REGION).create_bucket(
            Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": REGION}
        )
        yield arns


def revision(hub: HubStandin) -> str:
    return hub.repos[REPO].branches["main"]


def recipe_file(tmp_path: Path, hub: HubStandin, *, repo: str = REPO, rev: str | None = None) -> Path:
    """The tiny Llama recipe downloading its model from the stand-in into tmp_path/models/Tiny-Llama."""
    text = (Path(__file__).resolve().parents[3] / "training/train/recipes/tiny-llama-cpt.yaml").read_text()
    text = text.replace(
        "  config: work/tiny-llama/hf\n",
        f"  config: {tmp_path / 'models' / 'Tiny-Llama'}\n  hub:\n    repo: {repo}\n"
        f"    revision: {rev or revision(hub)}\n",
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


# --- fetch ---------------------------------------------------------------------------------------------------


def test_fetch_downloads_verifies_and_records_the_pinned_commit(
    tmp_path: Path, hub: HubStandin, aws: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    recipe = recipe_file(tmp_path, hub)
    assert main(["fetch", "--recipe", str(recipe), "--token-secret-arn", aws["read"]]) == 0
    model = tmp_path / "models" / "Tiny-Llama"
    served = hub.files(REPO, revision(hub))
    manifest = json.loads((model / FETCH_MANIFEST).read_text())
    assert (manifest["repo_id"], manifest["revision"], manifest["license"]) == (REPO, revision(hub), "llama3.1")
    assert manifest["files"] == {name: hashlib.sha256(content).hexdigest() for name, content in served.items()}
    assert manifest["fetched_at"].endswith("+00:00")
    for name, content in served.items():
        assert (model / name).read_bytes() == content
    assert sorted(p.name for p in model.iterdir()) == sorted([*served, FETCH_MANIFEST, "manifest.json"])
    assert leftovers(tmp_path / "models") == ["Tiny-Llama"]  # no temporary sibling, no download cache
    AutoModelForCausalLM.from_pretrained(str(model))
    AutoTokenizer.from_pretrained(str(model))
    # The token went to the Hub (the gated model needs it) and nowhere else.
    captured = capsys.readouterr()
    assert READ_TOKEN not in captured.out + captured.err
    assert f"GET /api/models/{REPO}/revision/{revision(hub)}" in hub.requests


def test_a_complete_fetch_is_kept_without_asking_the_hub(tmp_path: Path, hub: HubStandin) -> None:
    source = HubSource(repo=REPO, revision=revision(hub))
    output = tmp_path / "model"
    first = fetch_model(source, output, token=READ_TOKEN)
    before = len(hub.requests)
    second = fetch_model(source, output, token=None)  # no token: a download would be refused
    assert (first["skipped"], second["skipped"]) == (False, True)
    assert len(hub.requests) == before
    assert second["fetched_at"] == first["fetched_at"]


def test_a_fetch_missing_a_file_is_fetched_again(tmp_path: Path, hub: HubStandin) -> None:
    source = HubSource(repo=REPO, revision=revision(hub))
    output = tmp_path / "model"
    fetch_model(source, output, token=READ_TOKEN)
    (output / "model.safetensors").unlink()
    again = fetch_model(source, output, token=READ_TOKEN)
    assert not again["skipped"] and (output / "model.safetensors").read_bytes() == hub.files(REPO)["model.safetensors"]
    assert leftovers(tmp_path) == ["model"]


def test_another_revision_in_the_directory_is_refused_unless_overwritten(tmp_path: Path, hub: HubStandin) -> None:
    old = revision(hub)
    output = tmp_path / "model"
    fetch_model(HubSource(repo=REPO, revision=old), output, token=READ_TOKEN)
    files = hub.files(REPO) | {"config.json": hub.files(REPO)["config.json"].replace(b'"hidden_act"', b'"hidden_act" ')}
    new = hub.add_model(REPO, files)
    with pytest.raises(UserError, match=rf"model\.config .*model holds {REPO} at {old}, not {REPO} at {new}; fetch"):
        fetch_model(HubSource(repo=REPO, revision=new), output, token=READ_TOKEN)
    assert json.loads((output / FETCH_MANIFEST).read_text())["revision"] == old
    fetch_model(HubSource(repo=REPO, revision=new), output, token=READ_TOKEN, overwrite=True)
    assert json.loads((output / FETCH_MANIFEST).read_text())["revision"] == new
    assert (output / "config.json").read_bytes() == files["config.json"]


def test_a_hand_copied_model_directory_is_not_replaced(tmp_path: Path, hub: HubStandin) -> None:
    output = tmp_path / "model"
    output.mkdir()
    (output / "config.json").write_text("{}")
    with pytest.raises(UserError, match=r"holds files not fetched by this stage; remove it, or omit model\.hub"):
        fetch_model(HubSource(repo=REPO, revision=revision(hub)), output, token=READ_TOKEN)
    assert leftovers(output) == ["config.json"]


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("licence not accepted", f"Hugging Face model {REPO} is gated: accept its licence on the Hub"),
        ("no token", f"Hugging Face model {REPO} is gated: accept its licence on the Hub"),
        ("bad token", f"Hugging Face model {REPO}: the Hub refused the token (401)"),
        ("missing repository", "Hugging Face model meta-llama/No-Such-Model at revision"),
        ("missing revision", f"Hugging Face model {REPO} has no revision 0000000000000000000000000000000000000000"),
        ("damaged download", f"Hugging Face model {REPO}: downloaded model.safetensors has SHA-256"),
    ],
)
def test_each_refusal_is_one_line_naming_the_model_and_leaves_nothing(
    case: str, expected: str, tmp_path: Path, hub: HubStandin
) -> None:
    repo, rev, token = REPO, revision(hub), READ_TOKEN
    if case == "licence not accepted":
        token = "hf_read_of_bob_0123456789"
    elif case == "no token":
        token = None
    elif case == "bad token":
        token = "hf_revoked_token"
    elif case == "missing repository":
        repo = "meta-llama/No-Such-Model"
    elif case == "missing revision":
        rev = "0" * 40
    elif case == "damaged download":
        weights = hub.files(REPO)["model.safetensors"]
        hub.repos[REPO].served["model.safetensors"] = weights[:-4] + b"\0\0\0\0"  # same size, other bytes
    with pytest.raises(UserError) as refusal:
        fetch_model(HubSource(repo=repo, revision=rev), tmp_path / "model", token=token)
    message = str(refusal.value)
    assert message.startswith(expected) and "\n" not in message, message
    assert leftovers(tmp_path) == []


def test_a_hub_that_does_not_answer_is_one_line(
    tmp_path: Path, hub: HubStandin, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    with socket.socket() as unused:  # a port of 127.0.0.1 nothing listens on
        unused.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{unused.getsockname()[1]}"
    point_client_at(closed, monkeypatch)
    with pytest.raises(UserError) as refusal:
        fetch_model(HubSource(repo=REPO, revision=revision(hub)), tmp_path / "model", token=READ_TOKEN)
    assert str(refusal.value).startswith(f"Hugging Face model {REPO}: the Hub cannot be reached from this node (")
    assert leftovers(tmp_path) == []


def test_the_cli_refusal_is_one_line_with_exit_status_2(
    tmp_path: Path, hub: HubStandin, aws: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    hub.repos[REPO].accepted.clear()
    recipe = recipe_file(tmp_path, hub)
    assert main(["fetch", "--recipe", str(recipe), "--token-secret-arn", aws["read"]]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"Hugging Face model {REPO} is gated" in lines[0], lines
    assert READ_TOKEN not in lines[0]


def test_an_unreadable_secret_is_one_line_naming_it(
    tmp_path: Path, hub: HubStandin, aws: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    missing = aws["read"].replace("hf-read", "hf-gone")
    recipe = recipe_file(tmp_path, hub)
    assert main(["fetch", "--recipe", str(recipe), "--token-secret-arn", missing]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"Hugging Face token secret {missing}: ResourceNotFoundException" in line
    assert not (tmp_path / "models").exists()


def test_the_copy_in_s3_is_complete_once_its_manifest_is_there_and_is_not_uploaded_twice(
    tmp_path: Path, hub: HubStandin, aws: dict[str, str]
) -> None:
    source = HubSource(repo=REPO, revision=revision(hub))
    destination = f"s3://{BUCKET}/fsx/models/Tiny-Llama"
    result = fetch_model(source, tmp_path / "model", token=READ_TOKEN, copy_to=destination)
    s3 = boto3.client("s3", region_name=REGION)

    def objects() -> dict[str, Any]:
        listing = s3.list_objects_v2(Bucket=BUCKET, Prefix="fsx/models/Tiny-Llama/").get("Contents", [])
        return {o["Key"].rsplit("/", 1)[1]: o["LastModified"] for o in listing}

    uploaded = objects()
    assert result["copied_to"] == destination
    assert sorted(uploaded) == sorted([*hub.files(REPO), FETCH_MANIFEST])
    for name, content in hub.files(REPO).items():
        assert s3.get_object(Bucket=BUCKET, Key=f"fsx/models/Tiny-Llama/{name}")["Body"].read() == content
    fetch_model(source, tmp_path / "model", token=READ_TOKEN, copy_to=destination)
    assert objects() == uploaded  # the same fetch is there: nothing uploaded again
    # An upload cut short leaves no manifest: the next fetch (its local copy complete) uploads again.
    s3.delete_object(Bucket=BUCKET, Key=f"fsx/models/Tiny-Llama/{FETCH_MANIFEST}")
    s3.delete_object(Bucket=BUCKET, Key="fsx/models/Tiny-Llama/model.safetensors")
    again = fetch_model(source, tmp_path / "model", token=READ_TOKEN, copy_to=destination)
    assert again["skipped"] and sorted(objects()) == sorted(uploaded)


def test_the_copy_goes_under_models_uri_only_for_a_model_under_models_dir() -> None:
    assert copy_destination(Path("/fsx/models/Llama-3.1-8B"), "/fsx/models", "s3://b/fsx/models") == (
        "s3://b/fsx/models/Llama-3.1-8B"
    )
    assert copy_destination(Path("/fsx/models/meta/Llama"), "/fsx/models/", "s3://b/fsx/models/") == (
        "s3://b/fsx/models/meta/Llama"
    )
    assert copy_destination(Path("/data/Llama-3.1-8B"), "/fsx/models", "s3://b/fsx/models") is None
    assert copy_destination(Path("/fsx/models"), "/fsx/models", "s3://b/fsx/models") is None
    assert copy_destination(Path("/fsx/models/Llama"), None, None) is None


# --- the job graph ---------------------------------------------------------------------------------------------


def cluster_like_site(tmp_path: Path, **settings: Any) -> Site:
    return Site(runs_root=str(tmp_path / "runs"), results=f"s3://{BUCKET}/results", **settings)


def test_the_tokenizer_comes_first_and_prepare_runs_while_the_model_downloads(tmp_path: Path, hub: HubStandin) -> None:
    site = cluster_like_site(
        tmp_path,
        models_dir=str(tmp_path / "models"),
        models_uri=f"s3://{BUCKET}/fsx/models",
        hub_token_secret_arn="arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-read-AbC123",
    )
    plan = plan_run(load_recipe(str(recipe_file(tmp_path, hub))), site, "RUN")
    after = {stage.name: stage.after for stage in plan.stages}
    assert list(after)[:4] == ["fetch-tokenizer", "fetch", "prepare", "convert-in"]
    assert after["fetch-tokenizer"] == () and after["fetch"] == ()
    assert after["prepare"] == ("fetch-tokenizer",) and after["convert-in"] == ("fetch",)
    assert "fetch" in after["compile"]  # the model's config.json, also when no weights are converted
    run_dir = tmp_path / "runs" / "RUN"
    assert plan.resolved.prepare is not None and plan.resolved.prepare.tokenizer == str(run_dir / "tokenizer")
    scripts = render(plan)
    script = scripts["fetch"]
    assert "-m training fetch --recipe " in script and str(run_dir / "recipe.yaml") in script
    assert "--token-secret-arn arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-read-AbC123" in script
    assert f"--copy-to s3://{BUCKET}/fsx/models/Tiny-Llama" in script and "--tokenizer-only" not in script
    tokenizer_script = scripts["fetch-tokenizer"]
    assert f"--tokenizer-only --output {run_dir / 'tokenizer'}" in tokenizer_script
    assert "--token-secret-arn" in tokenizer_script and "--copy-to" not in tokenizer_script
    assert f"--tokenizer {run_dir / 'tokenizer'}" in scripts["prepare"]
    assert READ_TOKEN not in "".join(scripts.values())


def test_the_tokenizer_only_fetch_downloads_no_weights(tmp_path: Path, hub: HubStandin) -> None:
    recipe = load_recipe(str(recipe_file(tmp_path, hub)))
    assert recipe.model.hub is not None
    output = tmp_path / "run" / "tokenizer"
    manifest = fetch_model(tokenizer_source(recipe.model.hub), output, token=READ_TOKEN)
    assert manifest["files"] and not any(name.endswith(".safetensors") for name in manifest["files"])
    assert (output / "tokenizer.json").is_file() and (output / "config.json").is_file()
    assert sorted(p.name for p in output.glob("*.safetensors")) == []


def test_a_model_fetched_already_needs_no_tokenizer_stage(tmp_path: Path, hub: HubStandin) -> None:
    """A new environment whose file system imported the bucket's copy: prepare reads model.config at once."""
    recipe = load_recipe(str(recipe_file(tmp_path, hub)))
    assert recipe.model.hub is not None
    fetch_model(recipe.model.hub, Path(recipe.model.config), token=READ_TOKEN)
    plan = plan_run(recipe, cluster_like_site(tmp_path), "RUN")
    names = [stage.name for stage in plan.stages]
    assert "fetch-tokenizer" not in names and names[:2] == ["fetch", "prepare"]
    assert plan.resolved.prepare is not None
    assert plan.resolved.prepare.tokenizer == str(Path(recipe.model.config).absolute())


def test_a_recipe_without_a_hub_source_has_no_fetch_stage(tmp_path: Path) -> None:
    plan = plan_run(load_recipe("tiny-llama-cpt"), cluster_like_site(tmp_path), "RUN")
    assert [s.name for s in plan.stages][:2] == ["prepare", "convert-in"]
    assert all(not s.name.startswith("fetch") for s in plan.stages)


def test_the_export_stage_pushes_with_the_site_settings(tmp_path: Path) -> None:
    write = "arn:aws:secretsmanager:us-west-2:123456789012:secret:hf-write-XyZ789"
    site = cluster_like_site(tmp_path, hub_push_repo="acme/tiny-cpt", hub_write_token_secret_arn=write)
    script = render(plan_run(load_recipe("tiny-llama-cpt"), site, "RUN"))["export"]
    assert f"--push-to-hub acme/tiny-cpt --hub-token-secret-arn {write}" in script and "--public" not in script
    public = render(plan_run(load_recipe("tiny-llama-cpt"), site.model_copy(update={"hub_private": False}), "RUN"))
    assert "--public" in public["export"]
    assert (
        "--push-to-hub"
        not in render(plan_run(load_recipe("tiny-llama-cpt"), cluster_like_site(tmp_path), "RUN"))["export"]
    )


# --- push ------------------------------------------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path: Path, tiny_hf: Path) -> Path:
    import shutil

    run = tmp_path / "runs" / "tiny-run"
    shutil.copytree(tiny_hf, run / "hf")
    (run / "run.json").write_text(json.dumps({"run_id": "tiny-run"}))
    return run


def test_push_creates_a_private_repository_holding_exactly_hf(run_dir: Path, hub: HubStandin) -> None:
    summary = push_model(run_dir, "alice/tiny-cpt", token=WRITE_TOKEN)
    pushed = hub.repos["alice/tiny-cpt"]
    assert pushed.private and summary["private"] is True
    local = {p.relative_to(run_dir / "hf").as_posix(): p.read_bytes() for p in (run_dir / "hf").rglob("*")}
    assert hub.files("alice/tiny-cpt") == local
    assert summary["commit"] == pushed.branches["main"]


def test_push_refuses_a_failed_gate_unless_told(run_dir: Path, hub: HubStandin) -> None:
    gate = {"gate": {"passed": False, "failures": ["perplexity 41.2 above the base model's 12.0 x 1.05"]}}
    (run_dir / "evaluation.json").write_text(json.dumps(gate))
    with pytest.raises(UserError, match=r"run tiny-run is not pushed: evaluation gate failed: perplexity 41\.2 above"):
        push_model(run_dir, "alice/tiny-cpt", token=WRITE_TOKEN)
    assert "alice/tiny-cpt" not in hub.repos
    push_model(run_dir, "alice/tiny-cpt", token=WRITE_TOKEN, despite_gate=True, private=False)
    assert not hub.repos["alice/tiny-cpt"].private


def test_push_refuses_a_run_whose_evaluate_stage_did_not_finish(run_dir: Path, hub: HubStandin) -> None:
    """A recipe with an evaluate stage and no report: the stage failed or never ran, so there is no verdict."""
    recipe = load_recipe("tiny-llama-cpt")  # a recipe with an evaluate stage, as the run recorded it
    assert recipe.evaluate is not None
    (run_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe_as_dict(recipe)))
    with pytest.raises(UserError, match=r"run tiny-run is not pushed: .*evaluation.json: no evaluation \(the evaluate"):
        push_model(run_dir, "alice/tiny-cpt", token=WRITE_TOKEN)
    assert "alice/tiny-cpt" not in hub.repos


def test_push_without_an_evaluation_warns_and_pushes(
    run_dir: Path, hub: HubStandin, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        push_model(run_dir, "alice/tiny-cpt", token=WRITE_TOKEN)
    assert "no evaluation ran" in caplog.text and "alice/tiny-cpt" in hub.repos


def test_push_with_a_read_token_is_one_line_naming_the_repository(run_dir: Path, hub: HubStandin) -> None:
    with pytest.raises(UserError) as refusal:
        push_model(run_dir, "alice/tiny-cpt", token=READ_TOKEN)
    assert str(refusal.value) == (
        "Hugging Face model alice/tiny-cpt: the Hub refused the token (403); the token needs a write token of an "
        "account that may create and write it"
    )


def test_export_pushes_with_the_write_token_from_secrets_manager(
    run_dir: Path, tmp_path: Path, hub: HubStandin, aws: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["export", "--run-dir", str(run_dir), "--output", str(tmp_path / "results")]
    push = ["--push-to-hub", "alice/tiny-cpt", "--hub-token-secret-arn", aws["write"]]
    assert main([*arguments, *push]) == 0
    assert hub.files("alice/tiny-cpt")["config.json"] == (run_dir / "hf" / "config.json").read_bytes()
    assert (tmp_path / "results" / "hf" / "config.json").is_file()  # the S3-or-directory export ran first
    captured = capsys.readouterr()
    assert WRITE_TOKEN not in captured.out + captured.err
    assert main([*arguments, "--overwrite", "--push-to-hub", "not a repo"]) == 2
