"""AWS Secrets Manager secrets the jobs read at run time (Hub tokens, the W&B API key): named by their complete ARN
in the settings, read into memory by the job, never written to a log, a job script or the template."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, Strict

from training.config.loading import Allowed
from training.errors import UserError

# A secret's complete ARN, with the six characters Secrets Manager appends to its name: the node policies grant
# reading exactly this ARN (IAM would not match a partial one). No named groups: the JSON Schemas carry the pattern,
# and editors read it as an ECMAScript expression.
SECRET_ARN = re.compile(
    r"^arn:aws[a-z-]*:secretsmanager:[a-z]{2}(-gov)?-[a-z]+-\d+:\d{12}:secret:[A-Za-z0-9/_+=.@-]+-[A-Za-z0-9]{6}$"
)
SecretArn = Annotated[
    str,
    Strict(),
    Field(pattern=SECRET_ARN.pattern),
    Allowed("a Secrets Manager secret's complete ARN (arn:aws:secretsmanager:REGION:ACCOUNT:secret:NAME-XXXXXX)"),
]


def read_secret(arn: str, what: str) -> str:
    """The text of secret `arn` (holding `what`), from the secret's own region with short timeouts; a failure is
    one line naming the secret, never its content."""
    import boto3
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError, ClientError

    region = arn.split(":")[3] if SECRET_ARN.match(arn) else None
    config = Config(connect_timeout=10, read_timeout=10, retries={"max_attempts": 3, "mode": "standard"})
    client = boto3.client("secretsmanager", region_name=region, config=config)
    try:
        response = client.get_secret_value(SecretId=arn)
    except ClientError as error:
        code = error.response.get("Error", {}).get("Code", "error")
        raise UserError(f"{what} secret {arn}: {code}; the node's role must read it") from None
    except BotoCoreError as error:
        raise UserError(f"{what} secret {arn}: {error}") from None
    text = str(response.get("SecretString") or "").strip()
    if not text:
        raise UserError(f"{what} secret {arn}: empty; store the {what} as the secret's string")
    return text
