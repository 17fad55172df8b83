"""A run on Slurm: the job graph, one job a stage (plan, scripts, submit, status, the Slurm client), and the
stages' own commands (fetch, prepare's tokenizer, compile cache, preflight, evaluate, sample, export)."""
