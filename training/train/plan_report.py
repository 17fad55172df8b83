"""`python -m training plan`: a recipe's memory plan and forecast on each Trainium generation, side by side.

Each generation gets the recipe as it would run there (its `generations` section applied, then the command line's
overrides), on that generation's training instance type; the summary puts the figures a reader compares in one
table, and each generation's full report follows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from training.config.hardware import Hardware
from training.config.recipe import load_recipe
from training.train.forecast import forecast_of
from training.train.memory import model_config, report


def plan_generations(
    recipe_name: str, overrides: Sequence[str], hardware: Sequence[Hardware]
) -> tuple[list[dict[str, Any]], str]:
    """The plan of the recipe on each of `hardware` (as --json gives it) and the text to print."""
    plans, texts = [], []
    for node in hardware:
        recipe = load_recipe(recipe_name, overrides, generation=node.generation)
        config = model_config(recipe)  # read once for the plan and the forecast
        data, text = report(recipe, node, config)
        forecast = forecast_of(recipe, node, config=config)
        data["generation"] = node.generation
        data["kv_size_multiplier"] = recipe.parallelism.kv_size_multiplier
        data["forecast"] = None if forecast is None else forecast.as_dict()
        plans.append(data)
        texts.append(text if forecast is None else f"{text}\n{forecast.describe()}")
    if len(plans) == 1:
        return plans, texts[0]
    return plans, "\n\n".join([side_by_side(plans), *texts])


def side_by_side(plans: Sequence[dict[str, Any]]) -> str:
    """One column per generation: nodes and layout, memory per core, the forecast's time and cost."""
    rows: list[tuple[str, list[str]]] = [
        ("nodes", [f"{p['nodes']} x {p['hardware']}" for p in plans]),
        ("layout", [layout(p) for p in plans]),
        (
            "per NeuronCore",
            [f"{p['per_core_gib']:.2f} of {p['hbm_gib']:g} GiB, {p['headroom']:.0%} free" for p in plans],
        ),
        ("fits", ["yes" if p["fits"] else "no" for p in plans]),
        ("time", [forecast_cell(p, "hours", "{:.1f} h") for p in plans]),
        ("cost", [forecast_cell(p, "usd", "${:,.0f}") for p in plans]),
    ]
    header = [f"{plans[0]['recipe']}", *(p["generation"] for p in plans)]
    table = [header, *([label, *cells] for label, cells in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table
    )


def layout(plan: dict[str, Any]) -> str:
    kv = plan.get("kv_size_multiplier")
    return f"TP {plan['tp']} x PP {plan['pp']} x DP {plan['dp']}" + (f", K/V x{kv}" if kv and kv > 1 else "")


def forecast_cell(plan: dict[str, Any], key: str, form: str) -> str:
    forecast = plan.get("forecast")
    return "-" if forecast is None or forecast.get(key) is None else form.format(forecast[key])
