"""The search pipeline: loading an index, running its stages, assembling the results."""
