"""Imported by a prep-queue worker before it forks work-horses (`eyrie worker prep`).

rq's forking worker runs every job in a fresh fork of the worker process. Importing
transformers and datasets costs 3-10 s on 2 busy cores, which would otherwise be paid by every
tokenize job; imported once here, every fork inherits them.

`EYRIE_PREP_TOKENIZERS` (folders, separated by `os.pathsep`) also loads those tokenizers into
`services.prep.template.load_tokenizer`'s cache, saving ~1-2 s per job. Loading does not
start the Rust tokenizer's thread pool, so forking afterwards is safe.
"""

from __future__ import annotations

import os

import datasets  # noqa: F401
import pyarrow  # noqa: F401
import transformers  # noqa: F401
from transformers import AutoTokenizer  # noqa: F401

import services.prep.jobs  # noqa: F401
import services.prep.samples  # noqa: F401
import services.prep.template  # noqa: F401

for _path in filter(None, os.environ.get("EYRIE_PREP_TOKENIZERS", "").split(os.pathsep)):
    services.prep.template.load_tokenizer(_path)
