#!/usr/bin/env python3
"""CDK entry point: `npx cdk synth|deploy|destroy -c env=NAME` builds environments/NAME.yaml."""

import sys

from aws_cdk import App

from stacks.application import build_app, environment_from_context
from stacks.cost import run_forecast
from training.errors import UserError, decode_error, os_error, report

app = App()
try:
    config = environment_from_context(app)
except UserError as error:
    # One line per problem and no stack trace: these are user errors in a reviewed file.
    report(error)
    sys.exit(1)
except OSError as error:
    report(os_error(error))
    sys.exit(1)
except UnicodeDecodeError as error:
    report(decode_error(error))
    sys.exit(1)
forecast = run_forecast(config)
if forecast is not None:  # what the run this deploy starts will take, before anything bills
    print(f"pipeline.recipe {config.pipeline.recipe}: {forecast.describe()}", file=sys.stderr)
build_app(app, config)
app.synth()
