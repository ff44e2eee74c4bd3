"""Agents above the engine: the agent message protocol, its router and stored traces, the
retrieval and response agents, and the answer step they share with the benchmark solver."""
