"""A run on Slurm: the job graph (submit, status, cancel), and the sample and export stages."""
