"""Fusing the retrievers' rankings: reciprocal rank fusion, or a learned LambdaMART model."""
