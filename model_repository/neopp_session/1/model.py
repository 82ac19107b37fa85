"""Triton entry point of `neopp_session`; the logic lives in neopp.serving.session_model."""

from neopp.serving.session_model import SessionTritonModel


class TritonPythonModel(SessionTritonModel):
    pass
