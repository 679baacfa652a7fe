"""hetc: a declarative compiler for training LLMs on heterogeneous GPU clusters."""

__version__ = "0.1.0"
