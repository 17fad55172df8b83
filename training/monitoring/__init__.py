"""What the cluster reports to CloudWatch: training metrics, the Slurm queue and nodes, Neuron devices."""
