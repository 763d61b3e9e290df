"""What the tests and the benches share: running the agent and the symbolizer as processes, the
fixture inputs they feed them, hostile inputs, cgroups and waits. Not shipped (pyproject.toml packages
bistouri only); tests/ and bench/ import it, neither imports the other.
"""
