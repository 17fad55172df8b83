"""What only a developer machine needs: a local Slurm, the demo, tiny stand-in models. Never shipped."""
