"""A small demo task for the served generator: coloured shapes described by a fixed prompt grammar.

Not part of the installed runtime: the demo training, its tests and reports import it from the
repository root.
"""
