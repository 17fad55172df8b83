"""One configuration layer: the environment file, the recipe and the site settings load the same way."""
