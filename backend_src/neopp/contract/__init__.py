"""The public rules every process of the server shares, written once: standard library only.

The door and the launcher (their own process), the ``neopp`` command (a client) and the model
stubs all import this package and nothing else of one another, so a rule a client sees (a size's
spelling, an adapter's name, an error's status, a client's lane) cannot be told two ways.
"""
