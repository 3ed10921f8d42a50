"""What every Eyrie service imports: recipe schema, run store, queue helpers, conventions.

This package must stay light: importing it never imports torch, transformers or vLLM, so
`eyrie --help` and the rq workers start fast.
"""

__version__ = "0.1.0"
