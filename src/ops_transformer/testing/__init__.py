"""Harnesses that check the library against the models it supports: :mod:`.zoo` (a tiny model of
every Hugging Face family with a tensor-parallel plan, and its exactness check). Used by the tests,
by ``tools/hf_zoo.py`` and by ``ops-transformer check --preset hf:MODEL_TYPE``; nothing below the
command line imports them."""
