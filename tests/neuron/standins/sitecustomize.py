"""Python imports `sitecustomize` at start-up from the path: the neuron tier puts this folder on PYTHONPATH so
every process it starts (pytest and torchrun's workers alike) has the Neuron stand-ins."""

import neuron_standins

neuron_standins.install()
