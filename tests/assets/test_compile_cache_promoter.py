"""The compile cache kept in the results bucket: `compile-cache save` on a node, the promoter Lambda
(assets/lambda/compile_cache_promoter/handler.py, loaded as the Lambda runtime loads it) and `compile-cache restore`
in a new environment, against moto's S3 with a versioned bucket like the stack's.

Lambda itself is the AWS boundary's stand-in: `invoke` hands the payload to the real handler and returns its answer
as Lambda's Invoke response does (moto runs functions only in Docker). The cache trees are the compiler's layout
(`neuronxcc-<version>/MODULE_<hash>+<hash>/` with model.neff, model.hlo_module.pb, compile_flags.json, model.done).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
import yaml
from moto import mock_aws

from tests.support.lambda_handlers import load_handler_file
from training.config.recipe import load_recipe, recipe_as_dict
from training.config.site import Site
from training.pipeline import compile_cache
from training.pipeline.plan import plan_run

pytestmark = pytest.mark.slow  # make test-fast leaves it out (pyproject.toml)

ROOT = Path(__file__).resolve().parents[2]
handler = load_handler_file(ROOT / "assets" / "lambda" / "compile_cache_promoter" / "handler.py", "cache_promoter")
BUCKET = "results-bucket"
STORE = f"s3://{BUCKET}/compile-cache"
VERSION = "neuronxcc-2.21.33363.0+82129205"


class StandInLambda:
    """Lambda's Invoke for the promoter: the real handler, its answer as the response's Payload stream."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.calls: list[dict[str, Any]] = []

    def invoke(self, *, FunctionName: str, InvocationType: str, Payload: bytes) -> dict[str, Any]:
        event = json.loads(Payload)
        self.calls.append(event)
        answer = handler.handler(event, None, client=self.client)
        return {"StatusCode": 200, "Payload": io.BytesIO(json.dumps(answer).encode())}


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": "us-west-2",
        "BUCKET": BUCKET,
        "PREFIX": "compile-cache",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    with mock_aws():
        client = boto3.client("s3", region_name="us-west-2")
        client.create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})
        client.put_bucket_versioning(Bucket=BUCKET, VersioningConfiguration={"Status": "Enabled"})
        yield client


def make_run(
    root: Path, run_id: str, *, promoter: str | None = "trainium-default-cache-promoter", **overrides: Any
) -> Path:
    """A run directory as `submit` leaves it (run.json with the site and settings, recipe.yaml) for the bundled
    Llama recipe on a trn1 site whose compile cache is `root/<run id>-cache`."""
    site = Site(
        runs_root=str(root / "runs"),
        neuron=True,
        instance_type="trn1.32xlarge",
        compile_cache=str(root / f"{run_id}-cache"),
        compile_cache_store=STORE,
        compile_cache_promoter=promoter,
    )
    recipe = load_recipe("llama31-8b-cpt", [f"{key}={value}" for key, value in overrides.items()])
    plan = plan_run(recipe, site, run_id)
    plan.run_dir.mkdir(parents=True)
    settings = recipe_as_dict(plan.resolved)
    (plan.run_dir / "recipe.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    record = {"run_id": run_id, "settings": settings, "site": site.model_dump(mode="json")}
    (plan.run_dir / "run.json").write_text(json.dumps(record))
    return plan.run_dir


def write_entry(cache: Path, module: str, *, done: bool = True, neff: bytes | None = None) -> Path:
    entry = cache / VERSION / module
    entry.mkdir(parents=True)
    (entry / "model.hlo_module.pb").write_bytes(os.urandom(3000))
    (entry / "compile_flags.json").write_text('["--model-type=transformer", "--target=trn1"]')
    (entry / "model.neff").write_bytes(neff if neff is not None else os.urandom(5000))
    if done:
        (entry / "model.done").write_bytes(b"")
    return entry


def tree(directory: Path) -> dict[str, bytes]:
    return {
        path.relative_to(directory).as_posix(): path.read_bytes()
        for path in sorted(directory.rglob("*"))
        if path.is_file()
    }


def keys_under(client: Any, prefix: str) -> list[str]:
    return sorted(item["Key"] for item in client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", []))


def test_save_promote_restore_brings_the_same_finished_entries_to_a_new_environment(
    s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = make_run(tmp_path / "old-environment", "run-a")
    cache = Path(json.loads((first / "run.json").read_text())["site"]["compile_cache"])
    write_entry(cache, "MODULE_111+abc")
    write_entry(cache, "MODULE_222+abc")
    write_entry(cache, "MODULE_333+abc", done=False)  # being compiled (or its compile was killed): not saved
    write_entry(cache, "MODULE_444+abc", neff=b"")  # no compiled graph in it: not saved
    (cache / VERSION / "MODULE_111+abc" / ".model.neff.partial").write_bytes(b"x")  # a writer's temporary file
    lambda_client = StandInLambda(s3)

    saved = compile_cache.save(first, client=s3, lambda_client=lambda_client)

    key = saved["key"]
    assert saved["entries"] == 2 and saved["files"] == 8
    assert lambda_client.calls == [{"bucket": BUCKET, "staging": f"compile-cache/staging/{key}/run-a"}]
    assert saved["promotion"]["status"] == "promoted" and saved["promotion"]["files"] == 8
    promoted = keys_under(s3, f"compile-cache/promoted/{key}/")
    assert f"compile-cache/promoted/{key}/manifest.json" in promoted and len(promoted) == 9
    # S3 holds each object's SHA-256, which a later promotion checks without reading the object.
    head = s3.head_object(
        Bucket=BUCKET, Key=f"compile-cache/promoted/{key}/{VERSION}/MODULE_111+abc/model.neff", ChecksumMode="ENABLED"
    )
    neff = cache / VERSION / "MODULE_111+abc" / "model.neff"
    assert head["ChecksumSHA256"] == compile_cache.sha256_base64(compile_cache.file_hashes(neff)[0])

    # A new environment: another run of the same recipe, its cache directory empty.
    second = make_run(tmp_path / "new-environment", "run-b")
    fresh = Path(json.loads((second / "run.json").read_text())["site"]["compile_cache"])
    capsys.readouterr()
    restored = compile_cache.restore(second, client=s3)

    assert restored == {"key": key, "restored": 2, "refused": 0, "present": 0}
    expected = {name: data for name, data in tree(cache).items() if "/MODULE_111" in name or "/MODULE_222" in name}
    expected = {name: data for name, data in expected.items() if not name.rsplit("/", 1)[1].startswith(".")}
    assert tree(fresh) == expected  # byte for byte, nothing else (no scratch directory left beside the entries)
    assert compile_cache.restore(second, client=s3)["present"] == 2  # a second restore downloads nothing


def test_a_cache_without_a_promoted_entry_starts_cold(
    s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = make_run(tmp_path, "run-a")
    assert compile_cache.restore(run, client=s3)["restored"] == 0
    assert "the compile starts cold" in capsys.readouterr().out


def test_the_promoter_refuses_a_staged_file_that_is_not_the_manifests(s3: Any, tmp_path: Path) -> None:
    run = make_run(tmp_path, "run-a", promoter=None)
    cache = Path(json.loads((run / "run.json").read_text())["site"]["compile_cache"])
    write_entry(cache, "MODULE_111+abc")
    saved = compile_cache.save(run, client=s3)
    staging = saved["staging"]
    # Another write of a staged object after the manifest (a node may write staging/): same size, other bytes.
    original = (cache / VERSION / "MODULE_111+abc" / "model.neff").read_bytes()
    # Uploaded with a checksum of its own: S3's ChecksumSHA256 is what the promoter compares.
    s3.put_object(
        Bucket=BUCKET,
        Key=f"{staging}/{VERSION}/MODULE_111+abc/model.neff",
        Body=bytes(reversed(original)),
        ChecksumAlgorithm="SHA256",
    )

    answer = handler.handler({"bucket": BUCKET, "staging": staging}, None, client=s3)

    assert answer["status"] == "refused"
    assert "model.neff: SHA-256" in answer["problems"][0]
    assert keys_under(s3, "compile-cache/promoted/") == []


def test_the_promoter_reads_an_object_without_a_checksum_and_refuses_it_when_it_differs(
    s3: Any, tmp_path: Path
) -> None:
    run = make_run(tmp_path, "run-a", promoter=None)
    cache = Path(json.loads((run / "run.json").read_text())["site"]["compile_cache"])
    write_entry(cache, "MODULE_111+abc")
    staging = compile_cache.save(run, client=s3)["staging"]
    name = f"{VERSION}/MODULE_111+abc/model.hlo_module.pb"
    data = (cache / name).read_bytes()
    s3.put_object(Bucket=BUCKET, Key=f"{staging}/{name}", Body=data)  # the same bytes, uploaded without a checksum
    assert handler.handler({"bucket": BUCKET, "staging": staging}, None, client=s3)["status"] == "promoted"
    s3.put_object(Bucket=BUCKET, Key=f"{staging}/{name}", Body=data[:-1] + bytes([data[-1] ^ 1]))
    answer = handler.handler({"bucket": BUCKET, "staging": staging}, None, client=s3)
    assert answer["status"] == "refused" and "model.hlo_module.pb: SHA-256" in answer["problems"][0]


@pytest.mark.parametrize(
    ("event", "problem"),
    [
        ({"bucket": "another-bucket", "staging": "compile-cache/staging/" + "a" * 64 + "/run"}, "bucket"),
        ({"bucket": BUCKET, "staging": "compile-cache/promoted/" + "a" * 64}, "is not compile-cache/staging"),
        ({"bucket": BUCKET, "staging": "compile-cache/staging/" + "a" * 64 + "/../promoted"}, "is not"),
        ({"bucket": BUCKET, "staging": "results/run-a"}, "is not"),
    ],
)
def test_the_promoter_refuses_a_request_outside_the_staging_prefix(
    s3: Any, event: dict[str, Any], problem: str
) -> None:
    answer = handler.handler(event, None, client=s3)
    assert answer["status"] == "refused" and problem in answer["problems"][0]


def test_the_promoter_refuses_a_manifest_naming_files_outside_a_cache_entry(s3: Any) -> None:
    key = "b" * 64
    staging = f"compile-cache/staging/{key}/run-a"
    manifest = {
        "kind": "neuron-compile-cache",
        "key": key,
        "files": {"../../promoted/x/model.neff": {"size": 1, "sha256": "0" * 64}},
    }
    s3.put_object(Bucket=BUCKET, Key=f"{staging}/manifest.json", Body=json.dumps(manifest).encode())
    answer = handler.handler({"bucket": BUCKET, "staging": staging}, None, client=s3)
    assert answer["status"] == "refused" and "not a file of a cache entry" in answer["problems"][0]
    assert keys_under(s3, "compile-cache/promoted/") == []


def test_restore_refuses_an_entry_whose_file_differs_and_restores_the_others(
    s3: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = make_run(tmp_path / "old", "run-a")
    cache = Path(json.loads((first / "run.json").read_text())["site"]["compile_cache"])
    write_entry(cache, "MODULE_111+abc")
    write_entry(cache, "MODULE_222+abc")
    key = compile_cache.save(first, client=s3, lambda_client=StandInLambda(s3))["key"]
    # A promoted object that is not what the manifest says (written around the bucket policy, or corrupted).
    s3.put_object(Bucket=BUCKET, Key=f"compile-cache/promoted/{key}/{VERSION}/MODULE_222+abc/model.neff", Body=b"bad")
    second = make_run(tmp_path / "new", "run-b")
    fresh = Path(json.loads((second / "run.json").read_text())["site"]["compile_cache"])
    capsys.readouterr()

    result = compile_cache.restore(second, client=s3)

    assert result["restored"] == 1 and result["refused"] == 1
    assert "MODULE_222+abc/model.neff REFUSED" in capsys.readouterr().err
    assert (fresh / VERSION / "MODULE_111+abc" / "model.done").is_file()
    assert not (fresh / VERSION / "MODULE_222+abc").exists()  # left for the compiler, nothing half-restored
    assert sorted(p.name for p in (fresh / VERSION).iterdir()) == ["MODULE_111+abc"]


def test_a_promotion_replaces_the_earlier_one_of_the_same_key(s3: Any, tmp_path: Path) -> None:
    first = make_run(tmp_path / "one", "run-a")
    cache = Path(json.loads((first / "run.json").read_text())["site"]["compile_cache"])
    write_entry(cache, "MODULE_111+abc")
    key = compile_cache.save(first, client=s3, lambda_client=StandInLambda(s3))["key"]
    second = make_run(tmp_path / "two", "run-b")
    write_entry(Path(json.loads((second / "run.json").read_text())["site"]["compile_cache"]), "MODULE_999+abc")
    answer = compile_cache.save(second, client=s3, lambda_client=StandInLambda(s3))["promotion"]
    assert answer["stale_removed"] == 4
    promoted = keys_under(s3, f"compile-cache/promoted/{key}/")
    assert all("MODULE_111" not in name for name in promoted) and len(promoted) == 5
    manifest = json.loads(
        s3.get_object(Bucket=BUCKET, Key=f"compile-cache/promoted/{key}/manifest.json")["Body"].read()
    )
    assert manifest["run_id"] == "run-b" and manifest["promoted_from"].endswith("/run-b")


def test_the_key_follows_the_graph_settings_and_nothing_else(tmp_path: Path) -> None:
    def key(run_id: str, **overrides: Any) -> str:
        return compile_cache.run_cache(make_run(tmp_path, run_id, **overrides)).key

    base = key("base")
    assert key("again") == base  # another run id, another run directory: the same key
    # Runtime values: the run's length, the learning rate and its schedule, seeds, checkpoints.
    for number, (setting, value) in enumerate(
        [("steps", 700), ("optimizer.lr", 0.01), ("schedule.warmup_steps", 3), ("seed", 5), ("checkpoint.every", 9)]
    ):
        assert key(f"same-{number}", **{setting: value}) == base, setting
    # What changes the graphs.
    for number, (setting, value) in enumerate(
        [
            ("batch.seq_len", 4096),
            ("batch.micro", 2),
            ("parallelism.tp", 8),
            ("nodes", 2),
            ("precision", "fp32"),
            ("optimizer.weight_decay", 0.1),
            ("memory.flash_attention", False),
            ("neuron.compiler_flags", '["--model-type=transformer", "-O1"]'),
        ]
    ):
        assert key(f"other-{number}", **{setting: value}) != base, setting


def test_the_key_follows_the_compiler_model_and_instance() -> None:
    recipe = load_recipe("llama31-8b-cpt")
    versions = dict.fromkeys(compile_cache.GRAPH_PACKAGES, "1.0")

    def key(config: dict[str, Any] | None = None, instance: str = "trn1.32xlarge", **packages: str) -> str:
        inputs = compile_cache.key_inputs(
            recipe, config, instance_type=instance, processes_per_node=32, versions={**versions, **packages}
        )
        return compile_cache.cache_key(inputs)

    base = key({"hidden_size": 4096})
    assert key({"hidden_size": 4096}) == base
    assert key({"hidden_size": 2048}) != base
    assert key({"hidden_size": 4096}, "trn1n.32xlarge") != base
    assert key({"hidden_size": 4096}, **{"neuronx-cc": "2.0"}) != base
    assert key({"hidden_size": 4096}, **{"neuronx-distributed": "2.0"}) != base


def test_a_save_of_what_is_promoted_already_uploads_nothing(s3: Any, tmp_path: Path) -> None:
    first = make_run(tmp_path / "old", "run-a")
    write_entry(Path(json.loads((first / "run.json").read_text())["site"]["compile_cache"]), "MODULE_111+abc")
    compile_cache.save(first, client=s3, lambda_client=StandInLambda(s3))
    second = make_run(tmp_path / "new", "run-b")
    compile_cache.restore(second, client=s3)
    lambda_client = StandInLambda(s3)
    assert compile_cache.save(second, client=s3, lambda_client=lambda_client)["staging"] is None
    assert lambda_client.calls == [] and keys_under(s3, "compile-cache/staging/") == keys_under(
        s3, "compile-cache/staging/" + compile_cache.run_cache(first).key + "/run-a/"
    )
    empty = make_run(tmp_path / "empty", "run-c")  # a compile that left no finished entry: nothing to stage
    assert compile_cache.save(empty, client=s3, lambda_client=lambda_client)["staging"] is None


def test_the_commands_run_against_s3_and_refuse_a_site_without_a_store(tmp_path: Path) -> None:
    """`python -m training compile-cache ...` as the compile job runs it: its own S3 client (the endpoint and
    credentials from the environment), JSON on stdout, and one line with exit status 2 for a run it cannot serve."""
    from tests.support.moto_server import moto_endpoint

    run = make_run(tmp_path, "run-a")
    cache = Path(json.loads((run / "run.json").read_text())["site"]["compile_cache"])
    write_entry(cache, "MODULE_111+abc")
    with moto_endpoint() as endpoint:
        environment = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-west-2",
        }
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-west-2",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=BUCKET, CreateBucketConfiguration={"LocationConstraint": "us-west-2"})

        def command(*arguments: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "training", "compile-cache", *arguments, "--run-dir", str(run)],
                capture_output=True,
                text=True,
                env=environment,
                check=False,
                timeout=120,
            )

        restored = command("restore")
        assert restored.returncode == 0, restored.stderr
        assert "the compile starts cold" in restored.stdout
        assert json.loads(restored.stdout.splitlines()[-1])["restored"] == 0
        # The promoter is the deployment's function; here there is none to call, so the save's refusal is one line.
        saved = command("save")
        assert saved.returncode == 2 and "compile cache saved: 1 entries, 4 files" in saved.stdout
        (line,) = saved.stderr.strip().splitlines()
        assert line.startswith(f"error: compile cache save to {STORE}: ResourceNotFoundException: ")
        assert line.endswith(":function:trainium-default-cache-promoter")
    record = json.loads((run / "run.json").read_text())
    record["site"]["compile_cache_store"] = None
    (run / "run.json").write_text(json.dumps(record))
    refused = subprocess.run(
        [sys.executable, "-m", "training", "compile-cache", "restore", "--run-dir", str(run)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
        timeout=120,
    )
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == "error: run run-a: its site has no compile_cache_store (where the cache is kept)"


GOOD_FILE = {"size": 3, "sha256": "a" * 64}


@pytest.mark.parametrize(
    "files",
    [
        {f"{VERSION}/MODULE_1+2/model.neff": GOOD_FILE},
        {f"{VERSION}/MODULE_1+2/model.neff": GOOD_FILE, f"{VERSION}/MODULE_3+4/model.done": GOOD_FILE},
        {"/abs/MODULE_1/model.neff": GOOD_FILE},
        {f"{VERSION}/../MODULE_1/model.neff": GOOD_FILE},
        {f"{VERSION}/MODULE_1+2": GOOD_FILE},
        {"other/MODULE_1+2/model.neff": GOOD_FILE},
        {f"{VERSION}/MODULE_1+2/model.neff": {"size": -1, "sha256": "a" * 64}},
        {f"{VERSION}/MODULE_1+2/model.neff": {"size": 3, "sha256": "A" * 64}},
        {f"{VERSION}/MODULE_1+2/model.neff": {"size": "3", "sha256": "a" * 64}},
        {f"{VERSION}/MODULE_1+2/model.neff": "not an entry"},
        {},
        "not a mapping",
    ],
)
def test_the_promoter_and_the_restore_refuse_the_same_manifests(files: Any) -> None:
    """The promoter ships alone, with its own copy of the rules: both copies give one verdict on each manifest."""
    key = "k" * 64
    manifest = {"kind": compile_cache.MANIFEST_KIND, "key": key, "files": files}
    on_node, in_lambda = compile_cache.manifest_problems(manifest, key), handler.manifest_problems(manifest, key)
    assert bool(on_node) == bool(in_lambda), (on_node, in_lambda)
    assert on_node == in_lambda or not on_node  # the same words for a bad file
    for other in ({**manifest, "kind": "other"}, {**manifest, "key": "x" * 64}):
        assert compile_cache.manifest_problems(other, key) and handler.manifest_problems(other, key)
