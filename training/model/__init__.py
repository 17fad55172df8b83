"""Llama and Mixtral written once against the parallel facade, and the facade's cpu and neuron backends."""
