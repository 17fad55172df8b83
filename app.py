#!/usr/bin/env python3
"""CDK entry point: `npx cdk synth|deploy|destroy -c env=NAME` builds environments/NAME.yaml."""

import sys

from aws_cdk import App

from stacks.application import build_app, environment_from_context
from training.config.loading import ConfigError
from training.errors import report

app = App()
try:
    config = environment_from_context(app)
except ConfigError as error:
    # One line per problem and no stack trace: these are user errors in a reviewed file.
    report(error)
    sys.exit(1)
build_app(app, config)
app.synth()
