"""The training job: recipes, data loader, optimizer, training checkpoints and the loop."""
