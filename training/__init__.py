"""The code that runs on the cluster (and on CPU in the tests): data preparation first; `python -m training`."""
