"""Triton entry point of `neopp_t2i`; the logic lives in neopp.serving.t2i_model."""

from neopp.serving.t2i_model import T2ITritonModel


class TritonPythonModel(T2ITritonModel):
    pass
