"""The precision regimes and what each asks of the model and the Neuron stack (torch-free: the training job,
job rendering and synth read it).

- `bf16-mixed` (the first document, NxD's "standard mixed precision"): bf16 weights for forward and backward,
  gradients accumulated in fp32, and an fp32 master copy of every weight with fp32 AdamW state, sharded over
  the data-parallel ranks by ZeRO-1. On Neuron NxD's ZeRO-1 optimizer keeps them (`mixed_precision_config`);
  on CPU `training.train.cpu_precision.MasterWeights` does.
- `bf16-sr` (the second document's fork): weights, gradients and AdamW state all bf16, every rounding to bf16
  stochastic so small updates survive on average. On Neuron the runtime rounds
  (`NEURON_RT_STOCHASTIC_ROUNDING_EN=1`); on CPU `training.train.cpu_precision.StochasticRoundingAdamW` does.
- `fp32`: everything fp32 (CPU tests and the demo).
"""

from __future__ import annotations

from training.config.recipe import Precision

# The model's parameter dtype per regime (a `training.model.transformer.DTYPES` name).
PARAMETER_DTYPE: dict[Precision, str] = {"fp32": "float32", "bf16-mixed": "bfloat16", "bf16-sr": "bfloat16"}

# What the training job exports on Neuron, per regime. XLA_USE_BF16 / XLA_DOWNCAST_BF16 are deprecated (torch-xla
# 2.9 still honours them, with a warning, and would turn every fp32 tensor into bf16): the model is built in bf16
# instead and the job unsets both. Standard mixed precision turns stochastic rounding off (the fp32 master
# weights keep the small updates); bf16-sr depends on it.
NEURON_ENVIRONMENT: dict[Precision, dict[str, str]] = {
    "fp32": {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
    "bf16-mixed": {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "0"},
    "bf16-sr": {"NEURON_RT_STOCHASTIC_ROUNDING_EN": "1"},
}


def neuron_mixed_precision_config(precision: Precision) -> dict[str, bool]:
    """neuronx-distributed's `mixed_precision_config` for a regime (master weights need its ZeRO-1 optimizer)."""
    mixed = precision == "bf16-mixed"
    return {
        "use_master_weights": mixed,
        "use_fp32_grad_acc": mixed,
        # Saved, so a resumed run continues from the exact fp32 master weights, not from ones re-derived
        # from bf16 parameters (which would make it drift from the uninterrupted run).
        "use_master_weights_in_ckpt": mixed,
    }
