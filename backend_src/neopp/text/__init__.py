"""The prompt side: a tokenizer and the language tower that turns a prompt into a KV prefix.

A real deployment gets its prefixes from LightLLM; the embedded demo model carries a small
language tower of its own so that a prompt can go in and an image come out of one server.
"""
