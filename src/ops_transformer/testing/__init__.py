"""Harnesses that check the library against the models it supports: :mod:`.zoo` (a tiny model of
every Hugging Face family with a tensor-parallel plan, and its exactness check). Used by the tests
and by ``tools/hf_zoo.py``; nothing in the library imports them."""
