#!/usr/bin/env python3
"""CDK entry point: `npx cdk synth|deploy|destroy -c env=NAME` builds environments/NAME.yaml."""

import sys

from aws_cdk import App

from stacks.application import build_app, environment_from_context
from stacks.cost import run_forecast
from training.errors import guarded


def main() -> int:
    app = App()
    config = environment_from_context(app)
    forecast = run_forecast(config)
    if forecast is not None:  # what the run this deploy starts will take, before anything bills
        print(f"pipeline.recipe {config.pipeline.recipe}: {forecast.describe()}", file=sys.stderr)
    build_app(app, config)
    app.synth()
    return 0


# A mistake in a reviewed file is one line per problem and no stack trace, exit status 1.
sys.exit(guarded(main, status=1))
