"""Triton serving layer of NeoPP.

`tritonserver` runs the real Triton server shipped in the nvidia-pytriton wheel;
`triton_model` holds the logic every generation model's ``model.py`` delegates to.
Nothing here is imported by the core package, so the runner works without Triton.
"""
