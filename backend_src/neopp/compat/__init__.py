"""Drop-in faces of other projects' APIs over this package's runner.

`neopp.compat.lightx2v` is the LightX2V pipeline object LightLLM's image server drives.
"""
